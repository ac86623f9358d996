#!/usr/bin/env python3
"""Traces of a tiny tied Llama in low precision, with the per-example norms real Opacus 1.6
clips by as the claim: oracles/golden/traces/precision/{bf16,autocast_bf16}_t{10,32,128}.safetensors.

Two settings, each at T = 10, 32 and 128 (B = 4):

- `bf16`: the model cast to bfloat16 (`model.to(torch.bfloat16)`): every site computes in bf16;
- `autocast_bf16`: the float32 model with its forward and loss under
  `torch.autocast("cpu", dtype=torch.bfloat16)`: the linear layers' matmuls run in bf16, the
  embedding and the RMSNorms in f32 (the trace records the precision per site).

The model is Hugging Face's `LlamaForCausalLM` with a random seeded initialization: vocab 64,
hidden 16, 2 layers, 4 heads (2 key/value heads), intermediate 32, the embedding tied to the
head. The claim is what Opacus's hooks mode (`GradSampleModule`, `grad_sample_mode="hooks"`)
and its `DPOptimizer.clip_and_accumulate` compute: the norm of every parameter's `grad_sample`
in the grad sample's dtype, then the norm over parameters (`torch.stack(...).norm(2, dim=1)`).
The script runs `clip_and_accumulate` itself and checks that its clipped sum is the one these
norms give. Opacus adds the two uses of the tied parameter into one `grad_sample`, so its norms
are the true ones up to rounding. C is the midpoint of the two middle claimed norms, so two
of the four examples are clipped. The trace also carries Opacus's clip factors as
`claimed.coefficients`: `(C / (n + 1e-6)).clamp(max=1)` in the norms' dtype, so in the bf16
setting rounded to bf16, which moves a clipped contribution c_i·n_i*/C by up to 2⁻⁸ either way.

Beside the traces, `precision.json` records per trace C, the claimed norms, the norms the
trace's factors give (materialized in float64: the truth the oracle judges against), the
norms of the same weights in a float64 model (a per-example autograd loop, RMSNorm in float64:
what the model would give without low-precision arithmetic, for information), Opacus's clip
factors and the largest clipped contribution c_i·n_i*/C (with Opacus's factors, and with
min(1, C/n_i) for comparison).

    pip install torch transformers "opacus>=1.6,<1.7" safetensors
    python3 python/scripts/make_precision_traces.py
    cargo run --release -- check oracles/golden/traces/precision/bf16_t128.safetensors
"""
import copy
import json
import os
import types
import warnings
from contextlib import nullcontext

import torch
import transformers
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from safetensors import safe_open

from ghost_oracle.torch import export_trace  # noqa: E402

warnings.filterwarnings("ignore")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "oracles", "golden", "traces", "precision")
B, V, D, FF, L = 4, 64, 16, 32, 2
LENGTHS = (10, 32, 128)
SETTINGS = ("bf16", "autocast_bf16")


def build(setting):
    """The tied Llama of `setting`, in training mode (Opacus records activations only there;
    dropout is 0, so the function is the eval one)."""
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max(LENGTHS), tie_word_embeddings=True,
        initializer_range=0.1, attention_dropout=0.0, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(23)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if setting == "bf16":
        model = model.to(torch.bfloat16)
    return model.train()


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    ids = torch.randint(0, V, (B, t), generator=g)
    ids[:, t // 2] = ids[:, 1]  # a repeated token
    return ids


def loss_fn(setting):
    """per_example_loss(model, ids) -> tensor[B]: each example's mean next-token cross entropy
    (logits upcast to float32, as Hugging Face's loss does), the forward under autocast in the
    autocast setting."""
    def per_example_loss(model, ids):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast_bf16" else nullcontext()
        with ctx:
            logits = model(ids).logits.float()
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1),
                                                       reduction="none")
            return losses.view(ids.shape[0], -1).mean(1)
    return per_example_loss


def opacus_norms(model, ids, per_example_loss):
    """(the norms DPOptimizer.clip_and_accumulate clips by, a function that checks its clipped
    sum for a C). Hooks mode; the summed loss gives each example's own gradient."""
    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=ids.shape[0], loss_reduction="sum")
    opt.zero_grad(set_to_none=True)
    per_example_loss(gsm, ids).sum().backward()
    # DPOptimizer.clip_and_accumulate's arithmetic, on the optimizer's own grad samples
    per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in opt.grad_samples]
    norms = torch.stack(per_param, dim=1).norm(2, dim=1)

    def check_clipped_sum(c):
        opt.max_grad_norm = c
        factor = (c / (norms + 1e-6)).clamp(max=1.0)
        opt.clip_and_accumulate()
        for p in opt.params:
            gs = opt._get_flat_grad_sample(p).to(p.dtype)
            want = torch.einsum("i,i...", factor.to(p.dtype), gs)
            if not torch.equal(p.summed_grad, want):
                raise AssertionError("DPOptimizer clipped with other norms than the ones recorded")
        return factor

    return norms, {str(g.dtype).replace("torch.", "") for g in opt.grad_samples}, check_clipped_sum


def factor_norms(path):
    """Per-example norms the trace's factors give: every site's gradient materialized in
    float64, sites of one parameter summed (what the oracle's reference computes); and, for
    information, the same with every site counted as its own parameter (the tied cross term
    dropped)."""
    with safe_open(path, "pt") as f:
        specs = json.loads(f.metadata()["sites"])
        grads = {}
        untied = 0
        for s in specs:
            n = s["name"]
            d = f.get_tensor(f"{s.get('backprops_of', n)}.backprops").double()  # a bias reads its layer's
            if s["kind"] == "embedding":
                ids = f.get_tensor(f"{n}.ids")
                g = torch.zeros(d.shape[0], s["vocab"], d.shape[2], dtype=torch.float64)
                g.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, d.shape[2]), d)
            elif s["kind"] == "bias":
                g = d.sum(1)
            else:
                a = f.get_tensor(f"{n}.activations").double()
                if s["kind"] == "linear":
                    g = torch.einsum("bto,bti->boi", d, a)
                elif s["kind"] == "conv1d":
                    g = torch.einsum("bti,bto->bio", a, d)
                elif s["kind"] == "layernorm":
                    g = (d * a).sum(1)
                else:
                    raise KeyError(s["kind"])
            g = g.reshape(g.shape[0], -1)
            untied = untied + (g ** 2).sum(1)
            grads[s["param"]] = grads[s["param"]] + g if s["param"] in grads else g
    return sum((g ** 2).sum(1) for g in grads.values()).sqrt(), untied.sqrt()


def float64_norms(model, ids):
    """‖∇ loss_i‖ of the same weights in a float64 model (no autocast), one backward per
    example. Hugging Face's RMSNorm computes in float32 even in a float64 model; here it
    computes in float64 (the rotary angles stay float32-rounded: 1e-7, far below bf16)."""
    m = copy.deepcopy(model).to(torch.float64).eval()
    for mod in m.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
            mod.forward = types.MethodType(forward, mod)
    loss = loss_fn("bf16")  # no autocast; the float upcast is a no-op on float64 logits
    out = []
    for i in range(ids.shape[0]):
        m.zero_grad(set_to_none=True)
        loss(m, ids[i:i + 1])[0].backward()
        out.append(sum((p.grad ** 2).sum() for p in m.parameters() if p.grad is not None).sqrt())
    return torch.stack(out)


def main():
    os.makedirs(OUT, exist_ok=True)
    record = {}
    for setting in SETTINGS:
        for t in LENGTHS:
            model, ids, per_example_loss = build(setting), batch(t), loss_fn(setting)
            claimed, gs_dtypes, check_clipped_sum = opacus_norms(model, ids, per_example_loss)
            claimed64 = claimed.detach().double()
            mid = claimed64.sort().values
            c = float((mid[B // 2 - 1] + mid[B // 2]) / 2)
            factor = check_clipped_sum(c).double()
            name = f"{setting}_t{t}"
            path = os.path.join(OUT, f"{name}.safetensors")
            specs = export_trace(model, per_example_loss, ids, path, claimed_norms=claimed64, max_grad_norm=c,
                                 claimed_coefficients=factor, noise_multiplier=1.0,
                                 clipper=f"opacus-1.6-hooks-{setting.replace('_', '-')}")
            with safe_open(path, "pt") as f:
                compute_dtype = f.metadata()["compute_dtype"]
            truth, untied = factor_norms(path)
            exact = float64_norms(model, ids)
            contribution = factor * truth / c
            contribution_exact_factor = torch.clamp(c / claimed64, max=1.0) * truth / c
            site_dtypes = sorted({s.get("compute_dtype", compute_dtype) for s in specs})
            record[name] = {
                "setting": setting, "B": B, "T": t, "compute_dtype": compute_dtype, "site_dtypes": site_dtypes,
                "grad_sample_dtypes": sorted(gs_dtypes), "claimed_dtype": str(claimed.dtype).replace("torch.", ""),
                "max_grad_norm": c,
                "claimed_norms": claimed64.tolist(),
                "factor_norms": truth.tolist(),
                "float64_model_norms": exact.tolist(),
                "factor_norms_without_tied_cross_term": untied.tolist(),
                "max_rel_error_vs_factor_norms": float(((claimed64 - truth).abs() / truth).max()),
                "max_rel_error_vs_float64_model": float(((claimed64 - exact).abs() / exact).max()),
                "factor_norms_vs_float64_model": float(((truth - exact).abs() / exact).max()),
                "clip_factors": factor.tolist(),
                "max_clipped_contribution": float(contribution.max()),
                "max_clipped_contribution_with_min_1_C_over_claimed": float(contribution_exact_factor.max()),
                "bytes": os.path.getsize(path),
            }
            r = record[name]
            print(f"{name:18s} {r['bytes'] / 1024:6.1f} KB  C {c:.5f}"
                  f"  claimed/factors {r['max_rel_error_vs_factor_norms']:.2e}"
                  f"  claimed/f64 model {r['max_rel_error_vs_float64_model']:.2e}"
                  f"  factors/f64 model {r['factor_norms_vs_float64_model']:.2e}"
                  f"  max c·n*/C {r['max_clipped_contribution']:.5f}"
                  f" ({r['max_clipped_contribution_with_min_1_C_over_claimed']:.5f} with min(1, C/n))"
                  f"  untied/true {float((untied / truth).min()):.3f}"
                  f"..{float((untied / truth).max()):.3f}  sites {site_dtypes}")
    with open(os.path.join(OUT, "precision.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
