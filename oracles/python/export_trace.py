#!/usr/bin/env python3
"""Dump a ghost-oracle trace (docs/trace-format.md) from a PyTorch model, for auditing a clipper
that lives in PyTorch with `ghost-oracle check TRACE`.

Plain PyTorch: forward hooks on nn.Linear, nn.Embedding, nn.LayerNorm and Hugging Face's Conv1D
record each use's input, and a tensor hook on its output records the gradient of the summed
per-example losses (which, examples being independent, is each example's own backprop). A
parameter used by two modules (a head tied to the embedding) becomes two sites with one
`param`. An output broadcast over the batch (GPT-2's position embedding, computed once for
shape 1×T) is expanded to B×T first, so that its gradient stays per example.

    from export_trace import export_trace
    export_trace(model, per_example_loss, input_ids, "trace.safetensors",
                 claimed_norms=my_clipper_norms, max_grad_norm=1.0, clipper="my-clipper")

`per_example_loss(model, input_ids) -> tensor(B)`; `claimed_norms` is a tensor(B) of the norms
the clipper under audit used, or a callable returning one (it is called after the trace is
recorded, with the model and the batch).
"""
import json

import torch
from safetensors.torch import save_file

try:  # Hugging Face's Conv1D (GPT-2); optional
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover
    Conv1D = ()

FORMAT = "ghost-oracle-trace/1"


def _param_names(model):
    """Canonical name of every parameter object (a tied tensor keeps its first name)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _record(model, batch_size, input_ids):
    sites, handles = [], []
    names = _param_names(model)

    def hook(module, inputs, output, mod_name):
        x = inputs[0]
        out = output
        if out.dim() >= 1 and out.shape[0] == 1 and batch_size > 1:
            out = out.expand(batch_size, *out.shape[1:])
            if x.dtype in (torch.int64, torch.int32):
                x = x.expand(batch_size, *x.shape[1:])
        entry = {"module": module, "name": mod_name, "input": x.detach(), "grad": None}

        def save_grad(g):
            entry["grad"] = g.detach()

        out.register_hook(save_grad)
        sites.append(entry)
        return out

    for mod_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)) or (
            Conv1D and isinstance(module, Conv1D)
        ):
            handles.append(module.register_forward_hook(lambda m, i, o, n=mod_name: hook(m, i, o, n)))
    return sites, handles, names


def _site_tensors(entry, names, dtype):
    """Yields (spec, tensors) for the weight use and, where present, the bias use."""
    m, n = entry["module"], entry["name"]
    x, g = entry["input"], entry["grad"]
    out = []
    if g is None:
        return out  # output not on the loss path
    if isinstance(m, torch.nn.Embedding):
        spec = {"name": f"{n}.weight", "param": names[id(m.weight)], "kind": "embedding", "vocab": m.num_embeddings}
        out.append((spec, {"ids": x.to(torch.int64), "backprops": g.to(dtype)}))
        return out
    if isinstance(m, torch.nn.LayerNorm):
        xf = x.to(torch.float64)
        mean = xf.mean(-1, keepdim=True)
        var = xf.var(-1, unbiased=False, keepdim=True)
        xhat = ((xf - mean) / torch.sqrt(var + m.eps)).to(dtype)
        if m.weight is not None:
            out.append(({"name": f"{n}.weight", "param": names[id(m.weight)], "kind": "layernorm"},
                        {"activations": xhat, "backprops": g.to(dtype)}))
    else:
        kind = "linear" if isinstance(m, torch.nn.Linear) else "conv1d"
        out.append(({"name": f"{n}.weight", "param": names[id(m.weight)], "kind": kind},
                    {"activations": x.to(dtype), "backprops": g.to(dtype)}))
    if getattr(m, "bias", None) is not None:
        out.append(({"name": f"{n}.bias", "param": names[id(m.bias)], "kind": "bias"}, {"backprops": g.to(dtype)}))
    return out


def export_trace(model, per_example_loss, input_ids, path, claimed_norms, max_grad_norm,
                 clipper="claimed", claimed_coefficients=None, noise_multiplier=None, dtype=torch.float32):
    """Records the trace of one batch and writes it with the claimed norms. Returns the specs."""
    b = input_ids.shape[0]
    sites, handles, names = _record(model, b, input_ids)
    try:
        model.zero_grad(set_to_none=True)
        losses = per_example_loss(model, input_ids)
        if losses.shape != (b,):
            raise ValueError(f"per_example_loss returned shape {tuple(losses.shape)}; expected ({b},)")
        losses.sum().backward()
    finally:
        for h in handles:
            h.remove()
    specs, tensors = [], {}
    for entry in sites:
        for spec, ts in _site_tensors(entry, names, dtype):
            if spec["name"] in {s["name"] for s in specs}:
                raise ValueError(f"module {entry['name']} is called twice; give each call its own site name")
            specs.append(spec)
            for k, v in ts.items():
                tensors[f"{spec['name']}.{k}"] = v.clone().contiguous()  # bias and weight share backprops
    if callable(claimed_norms):
        claimed_norms = claimed_norms(model, input_ids)
    tensors["claimed.norms"] = torch.as_tensor(claimed_norms, dtype=torch.float64).reshape(b).contiguous()
    if claimed_coefficients is not None:
        tensors["claimed.coefficients"] = torch.as_tensor(claimed_coefficients, dtype=torch.float64).reshape(b).contiguous()
    meta = {"format": FORMAT, "max_grad_norm": repr(float(max_grad_norm)), "clipper": clipper, "sites": json.dumps(specs)}
    if noise_multiplier is not None:
        meta["noise_multiplier"] = repr(float(noise_multiplier))
    save_file(tensors, path, metadata=meta)
    return specs
