"""The exporter on the models of 2025 as Hugging Face ships them: stock float64 Llama and Gemma
(whose norms compute in float32 inside a float64 model), per-head q/k norms (Qwen3, Gemma 3),
classes declared with `register_module` (Falcon, Cohere), and mixture-of-experts refused by
name. The claims are torch.func's (or autograd's, example by example) per-example gradients:
ground truth that shares nothing with the exporter.
"""
import json

import pytest
from conftest import causal_lm_loss, func_norms, torch, transformers
from safetensors import safe_open
from torch.func import functional_call, grad, vmap

import ghost_oracle
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace, register_module, unregister_module

V, B, T = 48, 3, 7
LAYERS = dict(max_position_embeddings=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              vocab_size=V, attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
GEMMA = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)


def stock(cls, cfg, dtype=torch.float64, seed=3):
    """A model as `cls(cfg)` builds it, nothing patched, with weights drawn large enough that
    every path carries gradient (norm scales around their initial 1 or 0)."""
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            p.copy_(p + 0.1 * r if "norm" in name else 0.35 * r)
    return model


def ids():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(1, V, (B, T), generator=g)
    x[:, 4] = x[:, 1]  # a repeated token
    return x


def loss(model, x):
    return causal_lm_loss(model(x).logits, x)


def exact(model, x):
    """‖∇ loss_i‖ over the trainable parameters, by autograd of each example's own loss in turn
    (for models whose forward torch.func cannot vmap, and parameters some of which are frozen)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss(model, x[i:i + 1])[0], trainable)
        out.append(torch.sqrt(sum((g.double() ** 2).sum() for g in gs)))
    return torch.stack(out).detach()


def sites(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, {s["name"]: s for s in json.loads(meta["sites"])}, tensors


@pytest.fixture
def declared():
    """register_module, with every declaration withdrawn after the test."""
    done = []

    def declare(cls, kind):
        done.append(cls)
        return register_module(cls, kind)

    yield declare
    for cls in done:
        unregister_module(cls)


# ---------------------------------------------------------------------------------------------
# Stock float64 models: Hugging Face's float32 islands.


def llama64():
    return stock(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **LAYERS))


def gemma64():
    return stock(transformers.GemmaForCausalLM, transformers.GemmaConfig(
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, **LAYERS))


def test_a_stock_float64_llama_passes_at_float32(tmp_path):
    # LlamaRMSNorm computes x̂ in float32 and multiplies it by w in float64, and the eager softmax
    # computes in float32: every example's gradient is float32-accurate, so the whole trace is
    # judged at float32, its activations the float32 x̂ the module used, stored in float64.
    model, x = llama64(), ids()
    norms = func_norms(model, loss, x)
    path = tmp_path / "llama.safetensors"
    report = assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path)
    assert report.precision == "f32"
    meta, specs, tensors = sites(path)
    assert meta["compute_dtype"] == "f32" and all("compute_dtype" not in s for s in specs.values())
    a = tensors["model.norm.weight.activations"]
    assert a.dtype == torch.float64 and torch.equal(a, a.float().double())  # float32 values
    with pytest.raises(AssertionError):
        assert_norms(model, loss, x, norms * 0.999, max_grad_norm=float(norms.median()))


def test_a_stock_float64_gemma_passes_at_float32(tmp_path):
    # GemmaRMSNorm multiplies x̂ by (1 + w) in float32, and its x̂ and the eager softmax are float32
    # islands of the float64 model: every site, not only the norms', is judged at float32.
    model, x = gemma64(), ids()
    norms = func_norms(model, loss, x)
    path = tmp_path / "gemma.safetensors"
    report = assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path)
    meta, specs, _ = sites(path)
    assert meta["compute_dtype"] == "f32" and report.precision == "f32"
    assert all("compute_dtype" not in s for s in specs.values())
    with pytest.raises(AssertionError):
        assert_norms(model, loss, x, norms * 0.999, max_grad_norm=float(norms.median()))


def test_the_float32_island_is_what_the_self_check_sees(tmp_path, monkeypatch):
    # The x̂ of the old exporter (normalized in the input's float64) is off by float32 rounding
    # from the one Llama's norm used: the self-check refuses it at float64's tolerance.
    import ghost_oracle.torch.kinds.norm as X

    def float64_xhat(use, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + use.module.variance_epsilon), x.dtype

    monkeypatch.setattr(X, "_normalized", float64_xhat)
    with pytest.raises(TraceExportError, match=r"parameter `model\.layers\.0\.input_layernorm\.weight`.*differs"):
        export_trace(llama64(), loss, ids(), tmp_path / "t.safetensors", claimed_norms=[1.0] * B, max_grad_norm=1.0)
    assert not (tmp_path / "t.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# Per-head norms.


def per_example_grads(model, x, name):
    """torch.func's per-example gradient of parameter `name`: B × its shape."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, i):
        return loss(lambda z: functional_call(model, p, (z,), tie_weights=True), i.unsqueeze(0))[0]

    return vmap(grad(one), in_dims=(None, 0))(params, x)[name]


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_a_per_head_norm_is_one_site_with_a_row_per_position_and_head(tmp_path, family):
    if family == "qwen3":
        model = stock(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True, **LAYERS))
        heads, k = {"q_norm": 4, "k_norm": 2}, 4
    else:
        model = stock(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**GEMMA, **LAYERS))
        heads, k = {"q_norm": 2, "k_norm": 1}, 8
    x = ids()
    norms = func_norms(model, loss, x)
    path = tmp_path / f"{family}.safetensors"
    assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path)
    _, specs, tensors = sites(path)
    for norm, h in heads.items():
        name = f"model.layers.1.self_attn.{norm}.weight"
        assert specs[name]["kind"] == "layernorm" and specs[name]["param"] == name
        a, d = tensors[f"{name}.activations"].double(), tensors[f"{name}.backprops"].double()
        assert a.shape == d.shape == (B, T * h, k)
        # Each example's gradient of the shared weight is the sum over its T·H rows.
        want = per_example_grads(model, x, name)
        got = (a * d).sum(1)
        tol = 1e-6 if family == "gemma3_text" else 1e-12  # Gemma's norm multiplies in float32
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())), name
    # A claim without the per-head norms' part is caught.
    params = {n: p.detach() for n, p in model.named_parameters()}
    qk = sum((per_example_grads(model, x, n) ** 2).sum(1) for n in params if "_norm" in n.rsplit(".", 2)[-2])
    with pytest.raises(AssertionError):
        assert_norms(model, loss, x, (norms ** 2 - qk).sqrt(), max_grad_norm=float(norms.median()))


def test_a_norm_whose_examples_are_not_its_leading_axis_is_split_by_its_found_axis(tmp_path):
    # A norm applied to a T×B×k tensor: its rows belong to the examples along its second axis,
    # which the exporter finds by backpropagating each example's loss alone (it used to refuse
    # the layout). The truth is each example's own gradient, by brute force.
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, 6)
            self.norm = torch.nn.RMSNorm(6)
            self.head = torch.nn.Linear(6, V)

        def forward(self, x):
            return self.head(self.norm(self.emb(x).transpose(0, 1)).transpose(0, 1))

    def lm(model, x):
        return causal_lm_loss(model(x), x)

    torch.manual_seed(2)
    model = Model().double()
    path = tmp_path / "t.safetensors"
    export_trace(model, lm, ids(), path, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    truth = ghost_oracle.check(path).true_norms
    params = list(model.parameters())
    losses = lm(model, ids())
    for i in range(B):
        g = torch.autograd.grad(losses[i], params, retain_graph=True)
        want = float(sum((x ** 2).sum() for x in g).sqrt())
        assert abs(float(truth[i]) - want) <= 1e-9 * want


# ---------------------------------------------------------------------------------------------
# The registry.


def falcon(dtype=torch.float64):
    return stock(transformers.FalconForCausalLM, transformers.FalconConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager"), dtype=dtype)


def test_falcon_passes_through_its_functional_matmul_and_declared(tmp_path, declared):
    # FalconLinear computes `x @ self.weight.T`: the functional capture sees the transposed
    # parameter and traces it as a linear site without a declaration; declared, the module
    # handler traces it the same way.
    from transformers.models.falcon.modeling_falcon import FalconLinear

    model, x = falcon(), ids()
    norms = func_norms(model, loss, x)
    path = tmp_path / "captured.safetensors"
    report = assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path)
    _, specs, _ = sites(path)
    assert specs["transformer.h.0.self_attention.query_key_value.weight"]["kind"] == "linear"
    declared(FalconLinear, "linear")
    path = tmp_path / "falcon.safetensors"
    report = assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path)
    assert report.precision == "f32"  # Falcon's eager softmax computes in float32 in a float64 model
    _, specs, _ = sites(path)
    assert specs["transformer.h.0.self_attention.query_key_value.weight"]["kind"] == "linear"
    with pytest.raises(AssertionError):
        assert_norms(model, loss, x, norms * 0.999, max_grad_norm=float(norms.median()))


def test_cohere_passes_with_its_layernorm_declared(declared):
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    declared(CohereLayerNorm, "layernorm")
    for dtype in (torch.float32, torch.float64):
        model = stock(transformers.CohereForCausalLM, transformers.CohereConfig(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **LAYERS), dtype=dtype)
        x = ids()
        norms = func_norms(model, loss, x)
        # CohereLayerNorm multiplies by its weight in float32, so the float64 model's norms are
        # float32 sites.
        assert assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median())).precision == "f32"


class DoubledLinear(torch.nn.Linear):
    """Not what nn.Linear computes: y = 2 x Wᵀ + b."""

    def forward(self, x):
        return 2 * super().forward(x)


class SquaredScaleNorm(torch.nn.Module):
    """Not a norm of either form: y = x̂ ⊙ w²."""

    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(k))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight ** 2


class TupleLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x), None


def toy(layer, norm=None):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, 6)
            self.norm = norm if norm is not None else torch.nn.Identity()
            self.proj = layer
            self.head = torch.nn.Linear(6, V)

        def forward(self, x):
            h = self.proj(self.norm(self.emb(x)))
            return self.head(h[0] if isinstance(h, tuple) else h)

    torch.manual_seed(0)
    return Model().double()


def toy_loss(model, x):
    return causal_lm_loss(model(x), x)


@pytest.mark.parametrize("case", ["doubled-linear", "linear-as-conv1d", "squared-norm", "tuple"])
def test_a_wrong_declaration_raises_and_writes_nothing(tmp_path, declared, case):
    if case == "doubled-linear":
        declared(DoubledLinear, "linear")
        model, text = toy(DoubledLinear(6, 6)), r"parameter `proj.weight` \(module `proj` \(DoubledLinear\)\).*differs"
    elif case == "linear-as-conv1d":
        declared(DoubledLinear, "conv1d")  # out×in declared as in×out
        model, text = toy(DoubledLinear(6, 6)), r"parameter `proj.weight`.*differs from autograd's"
    elif case == "squared-norm":
        declared(SquaredScaleNorm, "layernorm")
        norm = SquaredScaleNorm(6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(6))
        model, text = toy(torch.nn.Linear(6, 6), norm), r"module `norm` \(SquaredScaleNorm\).*neither y = x̂ ⊙ w"
    else:
        declared(TupleLinear, "linear")
        model, text = toy(TupleLinear(6, 6)), r"module `proj` \(TupleLinear\) is registered as \"linear\".*tuple"
    path = tmp_path / "t.safetensors"
    with pytest.raises(TraceExportError, match=text):
        export_trace(model, toy_loss, ids(), path, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    assert not path.exists()


def test_a_declared_subclass_is_its_own_class(tmp_path, declared):
    # A declaration covers one class exactly: a subclass of a declared class may change forward.
    # This one doubles its output: the module handler would miss the factor, while the
    # functional capture sees the matmul the subclass really runs, and the factor after it.
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from ghost_oracle.torch.kinds import handler_for

    class Sub(FalconLinear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    declared(FalconLinear, "linear")
    assert handler_for(FalconLinear(6, 6)) is not None and handler_for(Sub(6, 6)) is None
    model = toy(Sub(6, 6, bias=False))  # a bias added by `+` is a use no capture sees
    norms = func_norms(model, toy_loss, ids())
    report = assert_norms(model, toy_loss, ids(), norms, max_grad_norm=float(norms.median()))
    assert report.passed


@pytest.mark.parametrize("args, exc, text", [
    ((torch.nn.Linear(2, 2), "linear"), TypeError, "is not a torch.nn.Module class"),
    ((int, "linear"), TypeError, "is not a torch.nn.Module class"),
    ((DoubledLinear, "rmsnorm"), ValueError, "an RMSNorm is \"layernorm\""),
    ((DoubledLinear, "attention"), ValueError, "the kind must be one of 'linear', 'conv1d', 'embedding', 'layernorm'"),
])
def test_bad_declarations(args, exc, text):
    with pytest.raises(exc, match=text):
        register_module(*args)


# ---------------------------------------------------------------------------------------------
# Mixture of experts.


def qwen3_moe():
    return stock(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, mlp_only_layers=[0], experts_implementation="eager", tie_word_embeddings=True,
        **LAYERS))


def test_fused_experts_are_refused_by_name_and_the_dense_parts_pass(tmp_path):
    model, x = qwen3_moe(), ids()
    path = tmp_path / "t.safetensors"
    with pytest.raises(TraceExportError, match=r"parameter `model\.layers\.1\.mlp\.experts\.gate_up_proj` \(module "
                                               r"`model\.layers\.1\.mlp\.experts` \(Qwen3MoeExperts\)\) is a 3-D "
                                               r"tensor.*mixture of experts"):
        export_trace(model, loss, x, path, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    assert not path.exists()
    for name, p in model.named_parameters():
        if ".mlp.experts." in name or ".mlp.gate." in name:
            p.requires_grad_(False)
    norms = exact(model, x)
    assert assert_norms(model, loss, x, norms, max_grad_norm=float(norms.median()), trace_path=path).passed
    _, specs, _ = sites(path)
    assert not any(".experts." in n or ".mlp.gate." in n for n in specs)
    with pytest.raises(AssertionError):
        assert_norms(model, loss, x, norms * 0.999, max_grad_norm=float(norms.median()))
