#!/usr/bin/env python3
"""Traces of one real Opacus 1.6 DP-SGD step, with the step itself: oracles/golden/traces/step/.

Each trace holds, beside the sites' factors, Opacus's per-example norms (`claimed.norms`) and
clip factors (`claimed.coefficients`), its clipped sum before noise (`claimed.clipped_sum.<param>`,
`p.summed_grad`), the update it would step with (`claimed.update.<param>`, `p.grad` after the noise
and the division) and the header keys `batch_divisor`, `clip_stabilizer` (1e-6) and
`noise_multiplier` (docs/trace-format.md, "The step (optional)"). The step is run by
`ghost_oracle.opacus.dp_step`: `PrivacyEngine.make_private` on a copy of the model, the noise
seeded, `optimizer.pre_step()` for the last micro-batch, so the weights never move.

Two tiny float32 Hugging Face models, B = 4, T = 10, weights drawn from a seeded generator
parameter by parameter (not from the library's initialization, so that they do not change with
its version):

- a tied GPT-2 (`GPT2LMHeadModel`: vocab 24, 1 layer, width 12, 3 heads, the head tied to the
  token embedding; its Conv1D weights are stored in×out);
- an untied Llama (`LlamaForCausalLM`: vocab 32, 2 layers, hidden 16, 4 heads with 2 key/value
  heads, intermediate 32). Opacus's ghost clipping refuses tied parameters, so the ghost-mode
  traces use this one.

| file | Opacus | batch |
|---|---|---|
| hooks_tied_gpt2_sigma0 | hooks, σ = 0 | one batch of 4 |
| hooks_tied_gpt2_sigma1 | hooks, σ = 1 | one batch of 4 |
| hooks_llama_microbatches_sigma0 | hooks, σ = 0 | two micro-batches of 2, `signal_skip_step(do_skip=True)` between |
| ghost_llama_sigma0 | ghost, σ = 0 | one batch of 4 |
| ghost_llama_two_backward_sigma0 | ghost, σ = 0 | two micro-batches of 2, two `loss.backward()` then one step |

hooks_llama_microbatches_sigma0 steps its micro-batches as BatchMemoryManager does.

The last one is Opacus's accumulation defect: its loss's `backward()` zeroes the gradients
before the clipped backward pass, so only the last micro-batch's clipped sum survives into
`p.summed_grad` (and the ghost optimizer counts one accumulated iteration, so the divisor is the
micro-batch's size). Its norms and clip factors are right; its clipped sum and update are not.

C is the midpoint of the two middle exact norms of each model's batch, so two of the four
examples are clipped. For each trace the script prints the relative error of the clipped sum
against the exact one, Σ c*_i g*_i with g*_i from a per-example autograd pass of a float64 copy
of the model and c*_i = min(1, C / (n*_i + 1e-6)), and for σ > 0 the noise's size
‖u·D − K‖ / (σ C √entries) (about 1). Recorded in oracles/golden/traces/step/README.md.

    pip install torch transformers opacus safetensors
    python3 python/scripts/make_step_traces.py
"""
import copy
import math
import os
import types
import warnings

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "oracles", "golden", "traces", "step")
B, T = 4, 10
STABILIZER = 1e-6  # Opacus's γ in min(1, C / (n + γ))


# ---------------------------------------------------------------------------------------------
# The models, batches and losses (also used by python/tests/test_step_export.py).


def _draw(model, seed, norm_like, scale):
    """Every parameter drawn from one seeded generator, in `named_parameters()` order (a tied
    parameter once): norm weights 1 + 0.1·r, their biases 0.1·r, everything else scale·r."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if norm_like(name):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * r)
            else:
                p.copy_(scale * r)
    return model


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=24, n_positions=16, n_embd=12, n_layer=1, n_head=3, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    _draw(model, 21, lambda n: ".ln_" in n or "ln_f" in n, 0.4)
    return model.float().train()  # Opacus records activations in training mode; dropout is 0


def llama():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=False, attn_implementation="eager", bos_token_id=0,
                                   eos_token_id=0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _draw(model, 31, lambda n: "norm" in n, 0.35)
    return model.float().train()


MODELS = {"gpt2": gpt2, "llama": llama}


def ids(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, T), generator=g)
    x[:, 4] = x[:, 1]  # a repeated token
    return x


BATCHES = {"gpt2": lambda: ids(24, 22), "llama": lambda: ids(32, 32)}


def causal_lm_loss(logits, x):
    """Mean cross entropy of each example's next-token predictions: tensor[b]."""
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               x[:, 1:].reshape(-1), reduction="none")
    return losses.view(x.shape[0], -1).mean(1)


def gpt2_loss(model, x):
    # explicit b×T position ids: with the default 1×T ones Opacus sums the position table's
    # grad_sample over the batch
    return causal_lm_loss(model(x, position_ids=torch.arange(x.shape[1]).repeat(x.shape[0], 1)).logits, x)


def llama_loss(model, x):
    return causal_lm_loss(model(x).logits, x)


LOSSES = {"gpt2": gpt2_loss, "llama": llama_loss}

# name -> (model, grad_sample_mode, σ, micro-batch sizes, accumulation)
CASES = {
    "hooks_tied_gpt2_sigma0": ("gpt2", "hooks", 0.0, [4], None),
    "hooks_tied_gpt2_sigma1": ("gpt2", "hooks", 1.0, [4], None),
    "hooks_llama_microbatches_sigma0": ("llama", "hooks", 0.0, [2, 2], "skip_step"),
    "ghost_llama_sigma0": ("llama", "ghost", 0.0, [4], None),
    "ghost_llama_two_backward_sigma0": ("llama", "ghost", 0.0, [2, 2], "backward"),
}


# ---------------------------------------------------------------------------------------------
# The exact step, in float64.


def float64_copy(model):
    """The model in float64, Llama's RMSNorm computing x̂ ⊙ w in float64 too (Hugging Face's
    computes it in float32 whatever the model's dtype)."""
    m = copy.deepcopy(model).double().eval()
    for mod in m.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            eps = float(mod.variance_epsilon)

            def forward(self, x, eps=eps):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

            mod.forward = types.MethodType(forward, mod)
    return m


def per_example_gradients(model, loss, x):
    """{param: tensor[B, *shape]}: each example's own gradient by autograd, in float64 (a tied
    parameter once, its uses summed by autograd)."""
    m = float64_copy(model)
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    out = {n: [] for n in params}
    for i in range(x.shape[0]):
        li = loss(m, x[i:i + 1])[0]
        gs = torch.autograd.grad(li, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), gs, strict=True):
            out[n].append(torch.zeros_like(p) if g is None else g.detach())
    return {n: torch.stack(v) for n, v in out.items()}


def exact_clipped_sum(model, loss, x, max_grad_norm):
    """(n*, c*, {param: Σ_i c*_i g*_i}) in float64, c* = min(1, C / (n* + 1e-6))."""
    g = per_example_gradients(model, loss, x)
    n = sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in g.values()).sqrt()
    c = (max_grad_norm / (n + STABILIZER)).clamp(max=1.0)
    return n, c, {k: torch.einsum("i,i...->...", c, v) for k, v in g.items()}


def relative_error(claimed, exact):
    """‖claimed − exact‖ / ‖exact‖ over all parameters together, in float64."""
    num = sum(float((claimed[k].double().reshape(-1) - exact[k].reshape(-1)).pow(2).sum()) for k in exact)
    den = sum(float(exact[k].pow(2).sum()) for k in exact)
    return math.sqrt(num / den)


def max_grad_norm(model, loss, x):
    """The midpoint of the two middle exact norms: two of the four examples are clipped."""
    g = per_example_gradients(model, loss, x)
    n = sorted(float(v) for v in sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in g.values()).sqrt())
    return 0.5 * (n[1] + n[2])


# ---------------------------------------------------------------------------------------------


def main():
    warnings.filterwarnings("ignore")
    import ghost_oracle.opacus as dp
    from ghost_oracle.torch import export_trace

    os.makedirs(OUT, exist_ok=True)
    rows = []
    for name, (family, mode, sigma, sizes, accumulation) in CASES.items():
        model, loss, x = MODELS[family](), LOSSES[family], BATCHES[family]()
        c = max_grad_norm(model, loss, x)
        mbs = list(torch.split(x, sizes)) if len(sizes) > 1 else [x]
        step = dp.dp_step(model, loss, mbs if len(mbs) > 1 else x, max_grad_norm=c, noise_multiplier=sigma,
                          grad_sample_mode=mode, accumulation=accumulation or "skip_step", seed=0)
        path = os.path.join(OUT, f"{name}.safetensors")
        export_trace(model, loss, step.inputs, path, clipper=f"opacus-{mode}", **step.export_kwargs())
        n_star, c_star, s_star = exact_clipped_sum(model, loss, x, c)
        err = relative_error(step.clipped_sum, s_star)
        norm_err = float(((step.norms - n_star) / n_star).abs().max())
        noisy = {k: step.update[k].double() * step.batch_divisor for k in step.update}
        r2 = sum(float((noisy[k] - step.clipped_sum[k].double()).pow(2).sum()) for k in noisy)
        entries = sum(v.numel() for v in noisy.values())
        noise = math.sqrt(r2) / (sigma * c * math.sqrt(entries)) if sigma > 0 else math.sqrt(r2)
        rows.append((name, mode, sigma, sizes, step.expected_batch_size, step.accumulated_iterations,
                     step.batch_divisor, c, norm_err, err, noise, os.path.getsize(path)))
        print(f"{name}: C = {c:.6g}, D = {step.batch_divisor:g} (expected_batch_size {step.expected_batch_size} × "
              f"accumulated_iterations {step.accumulated_iterations}), norms rel err {norm_err:.2e}, clipped sum rel "
              f"err {err:.2e}, {'noise ‖uD−K‖/(σC√N)' if sigma > 0 else '‖uD−K‖'} {noise:.4g}, "
              f"{os.path.getsize(path)} bytes")
    print()
    print("| trace | D | C | max rel err of norms | rel err of clipped sum | ‖u·D − K‖ / (σC√N) |")
    print("|---|---|---|---|---|---|")
    for name, _, sigma, _, ebs, acc, d, c, ne, err, noise, _ in rows:
        nz = f"{noise:.4f}" if sigma > 0 else f"{noise:.1e} (σ = 0)"
        print(f"| {name} | {d:g} = {ebs} × {acc} | {c:.6g} | {ne:.2e} | {err:.2e} | {nz} |")


if __name__ == "__main__":
    main()
