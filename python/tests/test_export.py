"""The exporter refuses to write a trace that is incomplete or wrong.

    python3 -m pytest python/tests/test_export.py
"""
import io
import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

import ghost_oracle.torch as E
from ghost_oracle.torch.kinds.embedding import ScaledEmbedding

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")

V, D, B, T = 11, 6, 3, 5


class ToyScaledWordEmbedding(torch.nn.Embedding):
    """Gemma's embedding: the lookup times √d, inside forward."""

    def __init__(self, v, d):
        super().__init__(v, d, padding_idx=0)
        self.embed_scale = torch.tensor(d ** 0.5)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class ToyRMSNorm(torch.nn.Module):
    """x̂ ⊙ (1 + w), Gemma's form."""

    def __init__(self, d):
        super().__init__()
        self.eps = 1e-6
        self.weight = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class MeanCenteredRMSNorm(ToyRMSNorm):
    """Named like an RMSNorm, but subtracts the mean first: still x̂ ⊙ (1 + w), with another x̂,
    which the exporter takes from the forward."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return super().forward(x)


class SquaredRMSNorm(ToyRMSNorm):
    """Named like an RMSNorm, but x̂ ⊙ w²: not what the exporter models."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight ** 2


class Gain(torch.nn.Module):
    """A parameter in a module kind the exporter does not model."""

    def __init__(self, d):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.gain


class DoubledLinear(torch.nn.Linear):
    """A subclass that changes forward: must not be taken for an nn.Linear."""

    def forward(self, x):
        return 2 * super().forward(x)


class Toy(torch.nn.Module):
    """Scaled, tied embedding -> norm -> linear (bias) -> extra -> tied head; the MLP runs on B·T
    flattened rows, as OPT's does."""

    def __init__(self, norm=ToyRMSNorm, extra=None, linear=torch.nn.Linear):
        super().__init__()
        self.embed = ToyScaledWordEmbedding(V, D)
        self.norm = norm(D)
        self.fc = linear(D, D)
        self.extra = extra(D) if extra else torch.nn.Identity()
        self.frozen = torch.nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        shape = h.shape
        flat = h.reshape(-1, D)
        h = (flat + torch.tanh(self.frozen(self.fc(flat)))).view(shape)
        return self.head(self.extra(h))


def loss(model, ids):
    logits = model(ids)
    per = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    return per.view(ids.shape[0], -1).mean(1)


def ids():
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    x[0, 1] = 0  # the padding row
    return x


def export(model, path, **kw):
    return E.export_trace(model.double(), loss, ids(), str(path), claimed_norms=torch.ones(B), max_grad_norm=1.0, **kw)


def test_a_correct_model_exports_with_scale_padding_and_flattened_rows(tmp_path):
    specs = export(Toy(), tmp_path / "ok.safetensors")
    kinds = {s["name"]: s["kind"] for s in specs}
    assert kinds == {"embed.weight": "embedding", "norm.weight": "layernorm", "fc.weight": "linear",
                     "fc.bias": "bias", "head.weight": "linear"}
    with safe_open(str(tmp_path / "ok.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight.activations").shape == (B, T, D)  # B·T rows reshaped back
        bp = f.get_tensor("embed.weight.backprops")
        assert torch.all(bp[0, 1] == 0)  # the padding row's lookup gets no gradient
        assert f.metadata()["compute_dtype"] == "f64"
        assert f.get_tensor("fc.weight.backprops").dtype == torch.float64


def test_a_missing_embedding_scale_is_refused_naming_the_parameter(tmp_path, monkeypatch):
    # the handler without the scale: the lookup's gradient taken as the output's
    monkeypatch.setattr(ScaledEmbedding, "lookup_grad", lambda self, use, g: g)
    path = tmp_path / "bad.safetensors"
    with pytest.raises(E.TraceExportError) as e:
        export(Toy(), path)
    msg = str(e.value)
    assert "parameter `embed.weight`" in msg and "ToyScaledWordEmbedding" in msg and "differs from autograd" in msg
    assert not path.exists()


def test_a_module_whose_forward_is_not_modelled_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(E.TraceExportError) as e:
        export(Toy(norm=SquaredRMSNorm), path)
    assert "module `norm` (SquaredRMSNorm)" in str(e.value) and "neither y = x̂ ⊙ w nor" in str(e.value)
    assert not path.exists()


def test_a_norms_xhat_is_the_one_its_forward_computes(tmp_path):
    # A mean-centred x̂ is recorded as centred: the norm's own forward, with w at the identity.
    path = tmp_path / "t.safetensors"
    export(Toy(norm=MeanCenteredRMSNorm), path)
    with safe_open(str(path), "pt") as f:
        a = f.get_tensor("norm.weight.activations")
    assert torch.allclose(a.mean(-1), torch.zeros(B, T, dtype=a.dtype), atol=1e-12)


def test_a_parameter_without_a_site_is_refused_naming_it_and_its_class(tmp_path):
    with pytest.raises(E.TraceExportError) as e:
        export(Toy(extra=Gain), tmp_path / "bad.safetensors")
    assert "parameter `extra.gain`" in str(e.value) and "(Gain)" in str(e.value) and "no site" in str(e.value)
    # A subclass of nn.Linear is matched by exact type, so the module handler, which would miss
    # the doubling, does not take it; the F.linear its forward calls is captured instead, the
    # doubling after it is in the output's gradient, and the self-check holds.
    from ghost_oracle.torch.kinds import handler_for

    assert handler_for(DoubledLinear(2, 2)) is None
    specs = export(Toy(linear=DoubledLinear), tmp_path / "ok.safetensors")
    assert {s["name"] for s in specs} >= {"fc.weight", "fc.bias"}


def test_the_manifest_lists_every_trainable_parameter_once(tmp_path):
    model = Toy()
    path = tmp_path / "ok.safetensors"
    specs = export(model, path)
    with safe_open(str(path), "pt") as f:
        listed = json.loads(f.metadata()["parameters"])
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert listed == trainable  # the tied head once, under the embedding's name; frozen left out
    assert "head.weight" not in listed and "frozen.weight" not in listed
    assert {s["param"] for s in specs} == set(listed)


def test_compute_dtype_is_the_models_not_the_files(tmp_path):
    path = tmp_path / "f32.safetensors"
    E.export_trace(Toy().float(), loss, ids(), str(path), claimed_norms=torch.ones(B), max_grad_norm=1.0,
                   dtype=torch.float64)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["compute_dtype"] == "f32"
        assert f.get_tensor("fc.weight.activations").dtype == torch.float64


transformers = pytest.importorskip("transformers")
sys.path.insert(0, SCRIPTS)
try:
    import make_family_traces as F  # noqa: E402  (a script, not part of the package)
finally:
    sys.path.remove(SCRIPTS)


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama", "gemma"])
def test_family_models_pass_the_self_check(tmp_path, family):
    model = F.build(family)
    specs = E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "t.safetensors"),
                           claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    assert any(s["kind"] == "embedding" for s in specs)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_self_check_in_blocks_of_a_few_rows_accepts_and_refuses_as_whole(tmp_path, monkeypatch, family):
    # Blocks of 7 entries: a tied table checked a vocabulary row (or less) at a time, blocks that
    # do not divide the rows. A correct model passes; a wrong embedding gradient is refused.
    from ghost_oracle._trace import check as C

    monkeypatch.setattr(C, "_BLOCK_ENTRIES", 7)
    model = F.build(family)
    blocks = C._blocks
    seen = []
    monkeypatch.setattr(C, "_blocks", lambda uses: seen.append(b := blocks(uses)) or b)
    E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "t.safetensors"),
                   claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    assert max(len(b) for b in seen) > 10
    from ghost_oracle.torch.kinds.embedding import Embedding

    monkeypatch.setattr(Embedding, "lookup_grad", lambda self, use, g: 1.001 * g)
    with pytest.raises(E.TraceExportError, match="differs from autograd"):
        E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "u.safetensors"),
                       claimed_norms=torch.ones(F.B), max_grad_norm=1.0)


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama", "gemma"])
def test_the_sketched_self_check_accepts_right_traces_and_refuses_wrong_ones(tmp_path, monkeypatch, family):
    # Every matrix parameter checked through the ±1 probe matrix (the route of 1B-class sizes),
    # in blocks of a few rows: the right trace passes, a lookup gradient 0.1 % off (the tied
    # table of GPT-2 and Gemma, where the head's sum dominates each probed row) and a missing
    # embedding scale are refused, naming the parameter.
    from ghost_oracle._trace import check as C
    from ghost_oracle.torch.kinds.embedding import Embedding

    monkeypatch.setattr(C, "FULL_CHECK_PRODUCTS", 0)
    monkeypatch.setattr(C, "_BLOCK_ENTRIES", 40)
    probe = C._probe_matrix
    sketched = []
    monkeypatch.setattr(C, "_probe_matrix", lambda uses, numel: sketched.append(v := probe(uses, numel)) or v)
    model = F.build(family)
    E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "t.safetensors"),
                   claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        specs = json.loads(f.metadata()["sites"])
    # every parameter with a matrix product (an embedding alone is a gather, checked whole)
    assert sum(v is not None for v in sketched) == len({s["param"] for s in specs if s["kind"] in ("linear", "conv1d")})
    if family == "gemma":
        monkeypatch.setattr(ScaledEmbedding, "lookup_grad", lambda self, use, g: g)
    else:
        monkeypatch.setattr(Embedding, "lookup_grad", lambda self, use, g: 1.001 * g)
    with pytest.raises(E.TraceExportError, match=r"embed.*differs from autograd's") as e:
        E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "u.safetensors"),
                       claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    # a tied table is sketched (the head is a product); an untied one is a gather, checked whole
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ("through a ±1 probe matrix" in str(e.value)) == tied


def test_small_parameters_are_checked_entry_by_entry(tmp_path, monkeypatch):
    from ghost_oracle._trace import check as C

    probe = C._probe_matrix
    sketched = []
    monkeypatch.setattr(C, "_probe_matrix", lambda uses, numel: sketched.append(v := probe(uses, numel)) or v)
    E.export_trace(F.build("llama"), F.per_example_loss, F.batch(), str(tmp_path / "t.safetensors"),
                   claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    assert sketched and all(v is None for v in sketched)


def test_gemma_without_its_embedding_scale_is_refused(tmp_path, monkeypatch):
    model = F.build("gemma")
    # the handler without the scale: the lookup's gradient taken as the output's
    monkeypatch.setattr(ScaledEmbedding, "lookup_grad", lambda self, use, g: g)
    with pytest.raises(E.TraceExportError) as e:
        E.export_trace(model, F.per_example_loss, F.batch(), str(tmp_path / "t.safetensors"),
                       claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    assert "parameter `model.embed_tokens.weight`" in str(e.value)
    assert "GemmaTextScaledWordEmbedding" in str(e.value)


def test_a_stock_float64_llama_records_the_float32_xhat_its_norms_use(tmp_path):
    # LlamaRMSNorm normalizes in float32 even in a float64 model: the site holds that x̂ (float32
    # values), stored in float64; the trace is judged at float32, the precision of those islands.
    model = F.build("llama")
    path = tmp_path / "t.safetensors"
    E.export_trace(model, F.per_example_loss, F.batch(), str(path), claimed_norms=torch.ones(F.B), max_grad_norm=1.0)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["compute_dtype"] == "f32"
        a = f.get_tensor("model.layers.0.input_layernorm.weight.activations")
    assert a.dtype == torch.float64 and torch.equal(a, a.float().double())


def test_progress_is_silent_on_a_short_export_and_says_the_stage_and_time_left_on_a_long_one(monkeypatch):
    from ghost_oracle.torch import progress as P

    clock = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    p = P.Progress(out)
    p.step("probes", 0, 4)
    clock[0] += 1.0
    p.step("probes", 1, 4)
    p.done()
    assert out.getvalue() == ""  # a second in: nothing
    p = P.Progress(out)
    clock[0] += 10.0
    p.step("probes", 1, 4)  # the stage's clock starts at its first line
    clock[0] += 3.0
    p.step("probes", 2, 4)  # one probe in 3 s, two left
    assert "probes 2/4, 6 s left in it (13 s in all)" in out.getvalue()
    clock[0] += 0.5
    p.step("probes", 3, 4)  # within two seconds of the last line: not rewritten
    assert "3/4" not in out.getvalue()
    p.done()
    assert out.getvalue().endswith("done in 14 s\x1b[K\n")
