"""The trace exporter: dump a ghost-oracle trace (docs/trace-format.md) from a PyTorch model, for
auditing a clipper that lives in PyTorch (`ghost_oracle.check(TRACE)`, `ghost-oracle check TRACE`).

This file is the one copy of the exporter. It is `ghost_oracle.torch.export_trace` in the
package, and `oracles/python/export_trace.py` loads it for the repository's scripts, so it
imports only torch, safetensors and (optionally) transformers, never the rest of the package.

Plain PyTorch: forward hooks record each use's input, and a tensor hook on its output records
the gradient of the summed per-example losses (which, examples being independent, is each
example's own backprop). A parameter used by two modules (a head tied to the embedding) becomes
two sites with one `param`.

Modules are matched by exact type, as Opacus's grad-sampler registry does, never by
`isinstance`: a subclass may change `forward` (Gemma's embedding multiplies its output by √d).
Modelled:

- `nn.Linear` (kind `linear`) and Hugging Face's `Conv1D` (kind `conv1d`), with their biases;
- `nn.Embedding`; embeddings whose forward is the lookup times `embed_scale` (class name ending
  in `ScaledWordEmbedding`, e.g. `GemmaTextScaledWordEmbedding`): the backprops are the gradient
  of the lookup, i.e. the output's gradient times the scale; OPT's learned positions
  (`OPTLearnedPositionalEmbedding`: ids = positions + 2). Rows at `padding_idx` receive no
  gradient from a lookup, so their backprops are zero;
- norms, kind `layernorm` for the weight (`bias` for a bias): `nn.LayerNorm`, `nn.RMSNorm` and any
  module whose class name ends in `RMSNorm` with a `weight` and an `eps` or `variance_epsilon`.
  Llama's x̂ ⊙ w and Gemma's x̂ ⊙ (1 + w) alike: the gradient with respect to w is Σ δ ⊙ x̂. x̂
  is what the module's own forward computes (replayed with the weight set to the identity of its
  form), so a norm that upcasts to float32 inside a float64 model (every Hugging Face RMSNorm)
  is traced with the float32 x̂ it really used; the site's precision is the one in which the
  module multiplies x̂ by its weight (float64 for Llama's, float32 for Gemma's: `_normalized`).
  A norm over the last axis of B×T×H×k (Qwen3's and Gemma 3's per-head q/k norms, whose one
  weight is shared by every head and position) is one site with T·H rows per example;
- any class declared with `register_module(cls, kind)` (`FalconLinear` as `"linear"`,
  `CohereLayerNorm` as `"layernorm"`), traced as that kind and checked like the others.

Refused, with the parameter named: mixture-of-experts layers whose experts are one fused 3-D
tensor (Qwen3-MoE's), where each token uses the slices its
router picked; freezing the experts and the router traces the rest.

Factors are arranged as B×T×features: an output computed once for the batch (GPT-2's 1×T
position embedding) is expanded to B×T first, so that its gradient stays per example, and
activations flattened to B·T rows inside a block (OPT's MLP) are reshaped back.

Precision is per site: each use is recorded in the dtype its module really computed in. That is
the parameters' dtype (an f32, bf16 or f16 model; for a norm, the dtype of its own product with
its weight, found by replaying it, as above), except where autocast lowered the module's op:
when autocast is enabled for the output's device type inside the module's forward and the
output comes out in autocast's dtype (not the weight's), the site computed in autocast's dtype.
On CPU and CUDA that is true of `nn.Linear` and `Conv1D` (matmuls), not of embeddings or norms,
which stay in the parameters' dtype; the output's dtype decides, not a list of ops. Such a site's
activations are stored as the matmul saw them (cast to autocast's dtype, as autocast casts
them) and its backprops as autograd produced them (in the output's dtype).

Nothing is written unless the trace is complete and right. For every trainable parameter that
received a gradient, the batch gradient rebuilt from its sites' factors (as stored) must equal
autograd's `p.grad` of the summed losses to rounding, at a tolerance that follows each site's
precision (a bf16 site: bf16 factors, products accumulated in f32, the result rounded to bf16);
a parameter with no site, or whose rebuilt gradient differs, is an error naming the parameter,
its module(s) and their classes. The header carries `compute_dtype` (the coarsest of the sites'
precisions; when they differ, every site's entry in `sites` carries its own) and the
`parameters` manifest (every trainable parameter that received a gradient, with its number of
elements; a tied parameter once).

    from ghost_oracle.torch import export_trace
    export_trace(model, per_example_loss, inputs, "trace.safetensors",
                 claimed_norms=my_clipper_norms, max_grad_norm=1.0, clipper="my-clipper")

`inputs` is the batch: a tensor of token ids (B×T) or a dict of tensors (B and T are read from
its `input_ids`, else from its first B×T tensor), or a list of such micro-batches, which is
traced as the logical batch they make up (their concatenation; all of one T);
`per_example_loss(model, inputs) -> tensor(B)`; `claimed_norms` is a tensor, array or list of
the B norms the clipper under audit used, or a callable returning one (it is called after the
trace is recorded, with the model and the batch). `dtype` is the dtype the factors are stored in
(default: each site's compute dtype).

The step (optional): `clipped_sum` and `update` map parameter names (`model.named_parameters()`
names, a tied parameter under any of its names, or the trace's `param` names) to the library's
clipped sum Σ_i c_i g_i before noise and to the update it steps with, (Σ_i c_i g_i + σ C ξ) / D.
Each covers every trainable parameter of the trace or is left out; they are written as
`claimed.clipped_sum.<param>` and `claimed.update.<param>` in the parameter's shape and in the
dtype given. `batch_divisor` is D (required with `update`); `clip_stabilizer` (γ) and `clipping`
(`flat`: c = min(1, C/(n + γ)); `automatic`: c = C/(n + γ)) say how the library forms its
coefficients.

    export_trace(model, per_example_loss, [mb1, mb2], "step.safetensors", claimed_norms=norms,
                 max_grad_norm=1.0, claimed_coefficients=factors, noise_multiplier=1.0,
                 clipped_sum={n: p.summed_grad for n, p in model.named_parameters()},
                 update={n: p.grad for n, p in model.named_parameters()},
                 batch_divisor=4, clip_stabilizer=1e-6)
"""
import contextlib
import json
import math
import os
import warnings
from collections.abc import Mapping

import torch
from safetensors.torch import save_file

try:  # Hugging Face's Conv1D (GPT-2); optional
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover
    Conv1D = None

FORMAT = "ghost-oracle-trace/1"

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class TraceExportError(ValueError):
    """The model cannot be traced faithfully: a parameter without a site, a site whose factors
    do not rebuild autograd's gradient, a module used in a way the exporter does not model."""


# ---------------------------------------------------------------------------------------------
# Module kinds, by exact type, and the registry users extend.

# The kinds a module can be declared to compute, by the names the trace format gives their sites.
KINDS = ("linear", "conv1d", "embedding", "layernorm")

_REGISTRY = {}


def register_module(cls, kind):
    """Declares that modules of exactly the class `cls` compute what the exporter's `kind`
    computes, so that they are traced as such:

    - `"linear"`: y = x Wᵀ (+ b), `weight` out×in (Falcon's `FalconLinear`);
    - `"conv1d"`: y = x W (+ b), `weight` in×out (Hugging Face's Conv1D layout);
    - `"embedding"`: y = W[ids], `weight` vocab×d, the ids the first argument;
    - `"layernorm"`: y = x̂ ⊙ w (+ b) or x̂ ⊙ (1 + w) (+ b), x̂ a normalization of x over its last
      axis that does not depend on w or b (a LayerNorm, an RMSNorm, `CohereLayerNorm`, a
      LayerNorm without bias). x̂ is taken from the module's own forward, so its precision and
      formula are the module's.

    Subclasses are not covered: each class is declared on its own, as a subclass may change
    `forward`. The declaration is not trusted: every trace is still checked against autograd
    before it is written, so a class that does not compute what it is declared to makes
    `export_trace` raise `TraceExportError`, never write a wrong trace. Declaring a class again
    replaces its kind. Returns `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"register_module: {cls!r} is not a torch.nn.Module class")
    if kind not in KINDS:
        hint = " (an RMSNorm is \"layernorm\": its weight's gradient has the same form)" if kind == "rmsnorm" else ""
        raise ValueError(f"register_module({cls.__name__}, {kind!r}): the kind must be one of "
                         f"{', '.join(repr(k) for k in KINDS)}{hint}")
    _REGISTRY[cls] = kind
    return cls


def unregister_module(cls):
    """Withdraws a `register_module` declaration (a no-op for a class never declared)."""
    _REGISTRY.pop(cls, None)


def _kind(module):
    """The exporter's model of `module`, or None when it has none. Exact types only. A norm of
    any form is kind `norm` (its site kind is `layernorm`)."""
    t = type(module)
    name = t.__name__
    declared = _REGISTRY.get(t)
    if declared is not None:
        return "norm" if declared == "layernorm" else declared
    if t is torch.nn.Linear:
        return "linear"
    if Conv1D is not None and t is Conv1D:
        return "conv1d"
    if t is torch.nn.Embedding:
        return "embedding"
    if t is torch.nn.LayerNorm:
        return "norm"
    if t is getattr(torch.nn, "RMSNorm", None):
        return "norm"
    if name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.nn.Parameter) and (
        hasattr(module, "eps") or hasattr(module, "variance_epsilon")
    ):
        return "norm"
    if issubclass(t, torch.nn.Embedding) and name.endswith("ScaledWordEmbedding") and hasattr(module, "embed_scale"):
        return "scaled_embedding"
    if name == "OPTLearnedPositionalEmbedding" and issubclass(t, torch.nn.Embedding) and hasattr(module, "offset"):
        return "opt_positions"
    return None


def _embedding_scale(module):
    """The factor a scaled embedding multiplies its lookup by, as its forward applies it (a
    buffer cast to the weight's dtype in Hugging Face's classes)."""
    s = module.embed_scale
    if torch.is_tensor(s):
        return s.to(module.weight.dtype)
    return float(s)


def _opt_position_ids(module, args, kwargs):
    """The ids OPT's learned-position table is indexed with (its forward, replayed)."""
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if pos is None:
        mask = kwargs.get("attention_mask", args[0] if args else None)
        cache = kwargs.get("cache_length", args[1] if len(args) > 1 else 0)
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, cache:]
    return pos + module.offset


# ---------------------------------------------------------------------------------------------
# Precision: the dtype each use really computed in.


def _autocast_dtype(device_type):
    """Autocast's dtype where autocast is enabled for `device_type` at this point of the forward,
    else None."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError, AttributeError):  # torch < 2.4, or a device type autocast lacks
        if device_type == "cpu" and hasattr(torch, "is_autocast_cpu_enabled"):
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


def _autocast_state(device_type):
    """(device type, dtype) of the autocast enabled at this point of the forward, else None: a
    norm's forward is replayed under it."""
    ac = _autocast_dtype(device_type)
    return None if ac is None else (device_type, ac)


def _site_dtype(module, output):
    """The dtype `module`'s use computed in: autocast's, where autocast lowered the op (enabled
    for the output's device type, and the output in autocast's dtype instead of the weight's),
    else the weight's."""
    weight = getattr(module, "weight", None)
    if not torch.is_tensor(weight):
        return output.dtype  # refused when its sites are built, naming the module
    w = weight.dtype
    ac = _autocast_dtype(output.device.type)
    if ac is not None and ac != w and output.dtype == ac:
        return ac
    return w


# ---------------------------------------------------------------------------------------------
# Recording.


def _param_names(model):
    """Canonical name of every parameter object (a tied tensor keeps its first name)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _param_owners(model):
    """id(parameter) -> [(module name, class name)] of every module holding it directly."""
    owners = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [])
                entry = (mod_name, type(m).__name__)
                if entry not in owners[id(p)]:
                    owners[id(p)].append(entry)
    return owners


def _btf(t, b, tt, what, entry):
    """`t` arranged as B×T×features (or B×T for ids)."""
    ids = t.dtype in (torch.int64, torch.int32)
    want = 2 if ids else 3
    if t.dim() == want and t.shape[0] == b and t.shape[1] == tt:
        return t
    if t.dim() == want and t.shape[0] == 1 and t.shape[1] == tt:
        return t.expand(b, *t.shape[1:])
    if t.dim() == want - 1 and t.shape[0] == b * tt:
        return t.reshape(b, tt, *t.shape[1:])
    raise TraceExportError(
        f"module `{entry['name']}` ({entry['cls']}): its {what} has shape {list(t.shape)}; the exporter needs "
        f"{b}×{tt}{'' if ids else '×features'} (batch × sequence) or {b * tt} flattened rows"
    )


def _record(model, batch_size):
    entries, handles = [], []
    seen = set()

    def hook(module, args, kwargs, output, mod_name, kind):
        if mod_name in seen:
            raise TraceExportError(
                f"module `{mod_name}` ({type(module).__name__}) is called twice in one forward; "
                "give each call its own module so that each use is its own site"
            )
        seen.add(mod_name)
        x = args[0] if args else None
        if kind == "opt_positions":
            x = _opt_position_ids(module, args, kwargs)
        elif x is None and kwargs:
            x = next(iter(kwargs.values()))
        if x is None:
            raise TraceExportError(f"module `{mod_name}` ({type(module).__name__}) was called without an input")
        out = output
        if type(module) in _REGISTRY and not torch.is_tensor(out):
            raise TraceExportError(
                f"module `{mod_name}` ({type(module).__name__}) is registered as \"{_REGISTRY[type(module)]}\" but its "
                f"forward returns a {type(out).__name__}, not a tensor: a {_REGISTRY[type(module)]} returns its output")
        if not torch.is_tensor(out) or not out.requires_grad:
            return None  # not on a trainable path
        if out.dim() >= 1 and out.shape[0] == 1 and batch_size > 1:
            out = out.expand(batch_size, *out.shape[1:])  # a per-batch output: make its gradient per example
        entry = {"module": module, "name": mod_name, "cls": type(module).__name__, "kind": kind,
                 "input": x.detach(), "grad": None, "dtype": _site_dtype(module, output),
                 "autocast": _autocast_state(output.device.type)}

        def save_grad(g):
            entry["grad"] = g.detach()

        out.register_hook(save_grad)
        entries.append(entry)
        return out if out is not output else None

    for mod_name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None:
            handles.append(module.register_forward_hook(
                lambda m, a, kw, o, n=mod_name, k=kind: hook(m, a, kw, o, n, k), with_kwargs=True))
    return entries, handles


def _rows(t, b, tt, what, entry):
    """A norm's input or output gradient as B×rows×features: B×T×features, or, for a norm applied
    to every head at every position (Qwen3's B×T×H×k q/k norms, Gemma 3's B×H×T×k), B×(T·H)×k,
    position-major: its rows are the (position, head) pairs. The weight's gradient is the sum
    over rows either way; the example must be the leading axis (or flattened with the position)
    so that every row is assigned to its own example."""
    if t.dim() >= 3 and t.shape[0] in (b, 1):
        pos = next((i for i in range(1, t.dim() - 1) if t.shape[i] == tt), None)
        if pos is not None:
            t = t.expand(b, *t.shape[1:]) if t.shape[0] != b else t
            return t.movedim(pos, 1).reshape(b, -1, t.shape[-1])
    if t.dim() >= 2 and t.shape[0] == b * tt:
        return t.reshape(b, -1, t.shape[-1])
    raise TraceExportError(
        f"module `{entry['name']}` ({entry['cls']}): its {what} has shape {list(t.shape)}; the exporter needs "
        f"{b}×{tt}×features (batch × sequence), {b}×{tt}×heads×features, {b}×heads×{tt}×features, or {b * tt} "
        "flattened rows"
    )


# The finest precision first: the first in which a norm's product with its weight reproduces the
# module's output is the precision its weight's gradient is computed in.
_PRECISIONS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _replay(entry, x, params):
    """The module's own forward on `x` with its direct parameters `params` substituted, under the
    autocast the recorded forward ran in, without autograd."""
    ac = entry["autocast"]
    ctx = torch.autocast(ac[0], dtype=ac[1]) if ac is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        y = torch.func.functional_call(entry["module"], params, (x,))
    if not torch.is_tensor(y) or y.shape != x.shape:
        shape = list(y.shape) if torch.is_tensor(y) else type(y).__name__
        raise TraceExportError(f"module `{entry['name']}` ({entry['cls']}): traced as a norm, its forward on an "
                               f"input of shape {list(x.shape)} returns {shape}, not a tensor of that shape")
    return y


def _normalized(entry, x):
    """(x̂, precision) of a norm's use: x̂ as the module's own forward computes it (its upcasts,
    formula and ε, cast back as it casts its output), and the precision in which it multiplies
    x̂ by its weight, which is the precision of the weight's gradient.

    Hugging Face's RMSNorms compute x̂ in float32 even in a float64 model: Llama's then
    multiplies the float32 x̂, cast back to float64, by w in float64, while Gemma's multiplies x̂
    by (1 + w) in float32. Neither is known by name. x̂ is the forward with the weight set to
    the identity of its form (w = 1 for x̂ ⊙ w, w = 0 for x̂ ⊙ (1 + w); bias 0), which is exact;
    the form and the precision are the first pair in which x̂ ⊙ w' (+ b') reproduces the forward
    with a probe weight w' (and bias b'), finest precision first. A module that is neither form
    is refused."""
    m = entry["module"]
    w = m.weight
    extra = [k for k, v in m._parameters.items() if v is not None and k not in ("weight", "bias")]
    if extra:
        raise TraceExportError(f"module `{entry['name']}` ({entry['cls']}): traced as a norm (y = x̂ ⊙ w + b), it "
                               f"holds other parameters too ({', '.join(extra)}), which that form has no place for")
    k = x.shape[-1]
    if w.dim() != 1 or w.shape[0] != k:
        raise TraceExportError(
            f"module `{entry['name']}` ({entry['cls']}): traced as a norm, its weight has shape {list(w.shape)}; the "
            f"exporter models one weight over the input's last axis ({k} features), shared by every position and "
            "head")
    bias = m._parameters.get("bias")
    gen = torch.Generator().manual_seed(20240607)
    w_probe = (0.5 + 0.5 * torch.rand(k, generator=gen, dtype=torch.float64)).to(device=w.device, dtype=w.dtype)
    params = {"weight": w_probe}
    if bias is not None:
        b_probe = (0.25 * torch.rand(k, generator=gen, dtype=torch.float64) - 0.125).to(device=bias.device,
                                                                                       dtype=bias.dtype)
        params["bias"] = b_probe
    y = _replay(entry, x, params)
    dts = {w.dtype, x.dtype, y.dtype, torch.float32} | ({bias.dtype} if bias is not None else set())
    candidates = [d for d in _PRECISIONS if d in dts]
    for form, identity in (("w", torch.ones_like(w)), ("1+w", torch.zeros_like(w))):
        ident = {"weight": identity}
        if bias is not None:
            ident["bias"] = torch.zeros_like(bias)
        xhat = _replay(entry, x, ident)
        scale = w_probe if form == "w" else 1.0 + w_probe
        for d in candidates:
            want = xhat.to(d) * scale.to(d)
            mag = want.abs()
            if bias is not None:
                want = want + params["bias"].to(d)
                mag = mag + params["bias"].to(d).abs()
            err = (y.to(torch.float64) - want.to(y.dtype).to(torch.float64)).abs()
            u = torch.finfo(d).eps / 2
            if bool((err <= 8.0 * u * mag.to(torch.float64) + torch.finfo(d).tiny).all()):
                # A product in a finer precision than the output is rounded to the output's,
                # and so is the weight's gradient (a bf16 Llama's norm: bf16 × bf16 products
                # are exact in float32, so that candidate matches too).
                return xhat, max(d, y.dtype, key=lambda t: torch.finfo(t).eps)
    raise TraceExportError(
        f"module `{entry['name']}` ({entry['cls']}): traced as a norm, its forward is neither y = x̂ ⊙ w nor "
        f"y = x̂ ⊙ (1 + w){' (+ b)' if bias is not None else ''} with x̂ independent of the weight, in any of "
        f"{', '.join(DTYPE_NAMES[d] for d in candidates)}: the exporter has no model of it")


def _site_tensors(entry, names, dtype, b, tt):
    """Yields (spec, tensors) for the weight use and, where present, the bias use, stored in
    `dtype` (None: the use's own compute dtype)."""
    m, n, kind = entry["module"], entry["name"], entry["kind"]
    g = entry["grad"]
    out = []
    if g is None:
        return out  # output not on the loss path

    def trainable(p):
        return isinstance(p, torch.nn.Parameter) and p.requires_grad

    weight = getattr(m, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        raise TraceExportError(f"module `{n}` ({entry['cls']}): traced as {kind}, it has no `weight` parameter")
    if kind in ("embedding", "scaled_embedding", "opt_positions"):
        dtype = entry["dtype"] if dtype is None else dtype
        g = _btf(g, b, tt, "output gradient", entry)
        if getattr(m, "max_norm", None) is not None or getattr(m, "scale_grad_by_freq", False):
            raise TraceExportError(f"module `{n}` ({entry['cls']}): max_norm / scale_grad_by_freq are not modelled")
        ids = _btf(entry["input"].to(torch.int64), b, tt, "ids", entry)
        if kind == "scaled_embedding":
            g = g * _embedding_scale(m)  # the gradient of the lookup, not of the scaled output
        padding_idx = getattr(m, "padding_idx", None)
        if padding_idx is not None:  # the padding row receives no gradient from a lookup
            g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
        if trainable(weight):
            spec = {"name": f"{n}.weight", "param": names[id(weight)], "kind": "embedding",
                    "vocab": weight.shape[0]}
            out.append((spec, {"ids": ids, "backprops": g.to(dtype)}))
        return out
    if kind == "norm":
        if trainable(weight):
            xhat, entry["dtype"] = _normalized(entry, entry["input"])
        dtype = entry["dtype"] if dtype is None else dtype
        g = _rows(g, b, tt, "output gradient", entry)
        if trainable(weight):
            # x̂ ⊙ w and x̂ ⊙ (1 + w) alike: dL/dw = Σ over rows of δ ⊙ x̂
            xhat = _rows(xhat, b, tt, "input", entry)
            out.append(({"name": f"{n}.weight", "param": names[id(weight)], "kind": "layernorm"},
                        {"activations": xhat.to(dtype), "backprops": g.to(dtype)}))
    else:
        dtype = entry["dtype"] if dtype is None else dtype
        g = _btf(g, b, tt, "output gradient", entry)
        # the input as the matmul saw it: under autocast, cast to autocast's dtype
        x = _btf(entry["input"], b, tt, "input", entry).to(entry["dtype"])
        if trainable(weight):
            out.append(({"name": f"{n}.weight", "param": names[id(weight)], "kind": kind},
                        {"activations": x.to(dtype), "backprops": g.to(dtype)}))
    bias = getattr(m, "bias", None)
    if trainable(bias):
        if g.shape[1] != tt:  # a per-head norm's bias: Σ over a position's heads, the rows the format has
            g = g.to(torch.float64).reshape(b, tt, -1, g.shape[-1]).sum(2)
        out.append(({"name": f"{n}.bias", "param": names[id(bias)], "kind": "bias"}, {"backprops": g.to(dtype)}))
    return out


# ---------------------------------------------------------------------------------------------
# The self-check: each parameter's batch gradient rebuilt from its sites' factors.


def _rebuild(spec, ts):
    """(Σ over examples and positions of the site's gradient, the same sum of |terms|), f64, in
    the parameter's layout flattened the way `p.reshape(-1)` is."""
    g = ts["backprops"].to(torch.float64)
    kind = spec["kind"]
    if kind == "bias":
        return g.sum((0, 1)), g.abs().sum((0, 1))
    if kind == "embedding":
        ids = ts["ids"].reshape(-1)
        d = g.shape[-1]
        v = spec["vocab"]
        full = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids, g.reshape(-1, d))
        absum = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids, g.abs().reshape(-1, d))
        return full.reshape(-1), absum.reshape(-1)
    a = ts["activations"].to(torch.float64)
    if kind == "layernorm":
        return (g * a).sum((0, 1)), (g * a).abs().sum((0, 1))
    if kind == "linear":
        return torch.einsum("bto,bti->oi", g, a).reshape(-1), torch.einsum("bto,bti->oi", g.abs(), a.abs()).reshape(-1)
    if kind == "conv1d":
        return torch.einsum("bti,bto->io", a, g).reshape(-1), torch.einsum("bti,bto->io", a.abs(), g.abs()).reshape(-1)
    raise AssertionError(kind)


def _unit_roundoff(dt):
    return torch.finfo(dt).eps / 2


def _low_precision(dt):
    """bf16 and f16: kernels take their products and accumulate them in f32, and store the
    result rounded back."""
    return _unit_roundoff(dt) > _unit_roundoff(torch.float32)


def _site_tolerance(spec, ts, absum, site_dtype, store_dtype, n):
    """How far autograd's batch gradient of one site may lie from the gradient rebuilt (in f64)
    from its stored factors, entry by entry; `absum` is Σ|terms|, n = B·T terms per entry.

    - f32 / f64 sites: autograd reduces the n terms in the site's precision, and an x̂
      recomputed here may differ from the forward's by a few ulps: 2·(n + 16)·u·Σ|terms|.
    - bf16 / f16 sites (a bf16 or f16 model, or a matmul under autocast): the factors are stored
      exactly as the kernel saw them; products are exact in f32 or rounded once to the low
      precision (an RMSNorm's δ ⊙ x̂), accumulated in f32 (up to log2 n partial sums rounded to
      the low precision, as split reductions do), and the result is rounded to the low precision:
      (4 + log2 n)·u·Σ|terms| plus the f32 accumulation. An embedding's backward adds each
      lookup's row into the table in the low precision, one rounding per occurrence of the id:
      (count + 4)·u·Σ|terms| for that row. Products and results that underflow lose up to half
      the smallest subnormal each (f16's is 2⁻²⁴).
    - factors stored in a coarser dtype than the site computed in: each of the two factors of a
      term rounded once, 3·u_store·Σ|terms|.
    A site that is wrong by a structural factor (a missing scale, a skipped use, a wrong
    position) is off by a fraction of Σ|terms| itself."""
    u = _unit_roundoff(site_dtype)
    if _low_precision(site_dtype):
        if spec["kind"] == "embedding":
            ids = ts["ids"].reshape(-1)
            count = torch.zeros(spec["vocab"], dtype=torch.float64).index_add_(
                0, ids, torch.ones(ids.numel(), dtype=torch.float64))
            k = (count + 4.0).unsqueeze(1).expand(-1, ts["backprops"].shape[-1]).reshape(-1)
        else:
            k = 4.0 + math.log2(max(n, 2))
        sub = torch.finfo(site_dtype).smallest_normal * torch.finfo(site_dtype).eps  # smallest subnormal
        tol = k * u * absum + 2.0 * (n + 16) * _unit_roundoff(torch.float32) * absum + (n + 4) * sub / 2
    else:
        tol = 2.0 * (n + 16) * u * absum
    us = _unit_roundoff(store_dtype)
    if us > u:
        tol = tol + 3.0 * us * absum
    return tol


def _self_check(model, sites, names, owners, store_dtype, b, tt):
    """Raises unless every trainable parameter that received a gradient has a site and its
    sites' factors rebuild autograd's gradient to rounding, each site at its own precision
    (`entry["dtype"]`; `store_dtype` None: each site stored in its own)."""
    by_param = {}
    for spec, ts, entry in sites:
        by_param.setdefault(spec["param"], []).append((spec, ts, entry))
    seen = set()
    params = []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or not p.requires_grad or p.grad is None:
            continue
        seen.add(id(p))
        params.append(p)
    def fused_experts(p):
        """A 3-D tensor of stacked expert matrices, by its shape and its name or its module's."""
        labels = [names[id(p)]] + [c for _, c in owners.get(id(p), [])]
        return p.dim() == 3 and names[id(p)] not in by_param and any("expert" in s.lower() for s in labels)

    # A fused expert tensor is named first: it is the reason the model cannot be traced, and
    # its router (whose gradient flows through the routing weights) has no site either.
    params.sort(key=lambda p: 0 if fused_experts(p) else 1)
    for p in params:
        name = names[id(p)]
        mods = ", ".join(f"`{m}` ({c})" for m, c in owners.get(id(p), []))
        uses = by_param.get(name)
        if fused_experts(p):
            raise TraceExportError(
                f"parameter `{name}` (module {mods}) is a {p.dim()}-D tensor {list(p.shape)}, one matrix per "
                "expert of a mixture of experts: each token is multiplied by the slices its router picked, a "
                "per-token choice of matrix that no site kind (linear, conv1d, embedding, bias, layernorm) "
                "represents, so the exporter refuses it rather than write a trace without it. To trace the "
                "dense parts, freeze the experts and the router (requires_grad=False)"
            )
        if not uses:
            raise TraceExportError(
                f"parameter `{name}` (module {mods}) received a gradient but has no site: the exporter "
                "models nn.Linear, Conv1D, nn.Embedding, nn.LayerNorm, RMSNorms, scaled embeddings and the "
                "classes declared with register_module by exact type, and this module is none of them (or "
                "its output is not what the forward hook sees). If its class computes what one of those "
                "computes, declare it: ghost_oracle.torch.register_module(cls, kind)"
            )
        rebuilt = torch.zeros(p.numel(), dtype=torch.float64)
        absum = torch.zeros(p.numel(), dtype=torch.float64)
        tol = torch.zeros(p.numel(), dtype=torch.float64)
        for spec, ts, entry in uses:
            r, a = _rebuild(spec, ts)
            if r.numel() != p.numel():
                raise TraceExportError(
                    f"parameter `{name}` (module {mods}): site `{spec['name']}` ({spec['kind']}) rebuilds "
                    f"{r.numel()} entries but the parameter has {p.numel()}"
                )
            rebuilt += r
            absum += a
            store = entry["dtype"] if store_dtype is None else store_dtype
            rows = ts["backprops"].shape[0] * ts["backprops"].shape[1]  # B·T, or B·T·H for a per-head norm
            tol += _site_tolerance(spec, ts, a, entry["dtype"], store, rows)
        # autograd adds the uses of a tied parameter into p.grad in the parameter's dtype
        tol += 2.0 * (len(uses) - 1) * _unit_roundoff(p.dtype) * absum + torch.finfo(p.dtype).tiny
        want = p.grad.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        err = (rebuilt - want).abs()
        bad = err > tol
        if bool(bad.any()):
            k = int(torch.argmax(err / tol))
            site_list = ", ".join(f"`{s['name']}` ({s['kind']}, module class {e['cls']}, computed in "
                                  f"{DTYPE_NAMES.get(e['dtype'], e['dtype'])})" for s, _, e in uses)
            raise TraceExportError(
                f"parameter `{name}` (module {mods}): the gradient rebuilt from its sites {site_list} differs "
                f"from autograd's at {int(bad.sum())} of {p.numel()} entries; worst entry {k}: rebuilt "
                f"{float(rebuilt[k]):.6e}, autograd {float(want[k]):.6e}, |error| {float(err[k]):.3e} > "
                f"tolerance {float(tol[k]):.3e}. The module's forward is not what the exporter models "
                "(a subclass that changes forward, a scale or cast inside it, a class declared with "
                "register_module that does not compute what its kind computes)"
            )


def _compute_dtype(model):
    """The precision the model computes in: its trainable parameters' dtype (the coarsest, if
    they differ)."""
    dts = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if not dts:
        raise TraceExportError("the model has no trainable floating-point parameter")
    return max(dts, key=_unit_roundoff)


# ---------------------------------------------------------------------------------------------


def _batch_shape(inputs):
    """(B, T) of a batch: a B×T tensor of ids, or a dict with `input_ids` (else any B×T tensor)."""
    if torch.is_tensor(inputs):
        if inputs.dim() != 2:
            raise ValueError(f"inputs has shape {list(inputs.shape)}; expected batch × sequence (token ids)")
        return tuple(inputs.shape)
    if isinstance(inputs, Mapping):
        t = inputs.get("input_ids")
        if not (torch.is_tensor(t) and t.dim() == 2):
            t = next((v for v in inputs.values() if torch.is_tensor(v) and v.dim() == 2), None)
        if t is None:
            raise ValueError(f"inputs is a dict with keys {sorted(inputs)} but no `input_ids` or other batch × "
                             "sequence tensor: the exporter needs B and T")
        return tuple(t.shape)
    raise TypeError(f"inputs must be a tensor of token ids (batch × sequence) or a dict of tensors, "
                    f"got {type(inputs).__name__}")


def _per_example(values, b, what):
    """`values` (a tensor, array, list or number per example) as a float64 CPU tensor of B."""
    if torch.is_tensor(values):
        values = values.detach().cpu()
    try:
        t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a tensor, array or list of {b} numbers, got {type(values).__name__}") from e
    if t.numel() != b:
        raise ValueError(f"{what} has {t.numel()} values; the batch has {b} examples")
    return t.contiguous()


def _concat_micro_batches(batches):
    """The logical batch of a list of micro-batches: their concatenation along the batch axis.
    Tensors of ids are concatenated; dicts need the same keys, and each tensor value whose
    leading axis is the micro-batch's B is concatenated, while any other value (a shared 1×T
    tensor, a flag) must be the same in every micro-batch and is kept once. All micro-batches
    need one T."""
    batches = list(batches)
    if not batches:
        raise ValueError("inputs is an empty list: pass the batch, or the list of its micro-batches")
    shapes = []
    for k, mb in enumerate(batches):
        try:
            shapes.append(_batch_shape(mb))
        except (TypeError, ValueError) as e:
            raise type(e)(f"micro-batch {k}: {e}") from e
    t0 = shapes[0][1]
    for k, (bk, tk) in enumerate(shapes):
        if tk != t0:
            raise ValueError(
                f"micro-batch {k} has sequence length T = {tk} but micro-batch 0 has T = {t0}: the trace "
                "of a logical batch needs one T for all its micro-batches (pad them to one length)")
    if len(batches) == 1:
        return batches[0]
    if all(torch.is_tensor(mb) for mb in batches):
        return torch.cat(batches, dim=0)
    if not all(isinstance(mb, Mapping) for mb in batches):
        kinds = sorted({type(mb).__name__ for mb in batches})
        raise TypeError(f"micro-batches must all be tensors of ids or all dicts, got {kinds}")
    keys = list(batches[0])
    out = {}
    for k, mb in enumerate(batches):
        if sorted(mb) != sorted(keys):
            raise ValueError(f"micro-batch {k} has keys {sorted(mb)} but micro-batch 0 has {sorted(keys)}")
    for key in keys:
        values = [mb[key] for mb in batches]
        if all(torch.is_tensor(v) for v in values):
            if all(v.dim() >= 1 and v.shape[0] == bk for v, (bk, _) in zip(values, shapes)):
                out[key] = torch.cat(values, dim=0)  # one row per example
                continue
            if all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values[1:]):
                out[key] = values[0]  # shared by every micro-batch (a 1×T position_ids)
                continue
            k, (v, (bk, _)) = next((k, x) for k, x in enumerate(zip(values, shapes))
                                   if x[0].dim() == 0 or x[0].shape[0] != x[1][0])
            raise ValueError(f"micro-batch {k}: `{key}` has shape {list(v.shape)}; to be concatenated its leading "
                             f"axis must be the micro-batch's {bk} examples (or it must be the same tensor in "
                             "every micro-batch)")
        if any(torch.is_tensor(v) for v in values) or any(v != values[0] for v in values[1:]):
            raise ValueError(f"`{key}` differs between micro-batches and is not a tensor of examples")
        out[key] = values[0]
    return out


STEP_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _resolve_step(model, what, tensors, names):
    """`tensors` (a mapping from parameter names to the library's tensors) keyed by each
    parameter's trace name (its `param`), checked against the model: every name is a trainable
    parameter (a tied one under any of its names, once), every value a floating-point tensor with
    the parameter's number of elements. Returns {param: (parameter, tensor)}."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{what} must be a dict from parameter names to tensors, got {type(tensors).__name__}")
    by_name = dict(model.named_parameters(remove_duplicate=False))
    out, given_as = {}, {}
    for key, t in tensors.items():
        p = by_name.get(key)
        if p is None:
            near = ", ".join(f"`{n}`" for n in list(dict.fromkeys(names.values()))[:6])
            raise ValueError(f"{what}: `{key}` is not a parameter of the model (its parameters are named like "
                             f"{near}, ...)")
        param = names[id(p)]
        if not p.requires_grad:
            raise ValueError(f"{what}: parameter `{key}` is not trainable (requires_grad=False): it is not part "
                             "of the step")
        if param in out:
            raise ValueError(f"{what}: parameter `{param}` is given twice, as `{given_as[param]}` and `{key}` "
                             "(one tied parameter): give it once")
        if not torch.is_tensor(t):
            raise ValueError(f"{what}: the value for parameter `{key}` is a {type(t).__name__}, not a tensor")
        if t.dtype not in STEP_DTYPES:
            raise ValueError(f"{what}: the tensor for parameter `{key}` has dtype {t.dtype}; the trace stores "
                             f"{', '.join(DTYPE_NAMES[d] for d in STEP_DTYPES)}")
        if t.numel() != p.numel():
            raise ValueError(f"{what}: the tensor for parameter `{key}` has shape {list(t.shape)} ({t.numel()} "
                             f"elements); the parameter has shape {list(p.shape)} ({p.numel()} elements)")
        out[param] = (p, t)
        given_as[param] = key
    return out


def _number(value, what, positive):
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number, got {value!r}") from e
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} number, got {value}")
    return v


def export_trace(model, per_example_loss, inputs, path, claimed_norms, max_grad_norm,
                 clipper="claimed", claimed_coefficients=None, noise_multiplier=None, dtype=None,
                 update=None, clipped_sum=None, batch_divisor=None, clip_stabilizer=0.0, clipping="flat"):
    """Records the trace of one batch, checks it against autograd and writes it with the claimed
    norms (and, when given, the claimed step: `clipped_sum`, `update`, `batch_divisor`,
    `clip_stabilizer`, `clipping`; see the module's docstring). Returns the site specs. Raises
    `TraceExportError` (a ValueError) instead of writing a trace that is incomplete or wrong.

    `inputs` may be a list of micro-batches: the trace is of their concatenation, the logical
    batch a step is taken on.

    Runs one forward and backward pass of `per_example_loss(model, inputs).sum()`: the model's
    `.grad`s are reset first and hold that batch gradient afterwards."""
    if isinstance(inputs, list):  # micro-batches
        inputs = _concat_micro_batches(inputs)
    b, tt = _batch_shape(inputs)
    c = float(max_grad_norm)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm}")
    if noise_multiplier is not None:
        sigma = float(noise_multiplier)
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"noise_multiplier must be a non-negative number, got {noise_multiplier}")
    compute_dtype = _compute_dtype(model)
    if compute_dtype not in DTYPE_NAMES:
        raise TraceExportError(f"the model computes in {compute_dtype}; traces record {list(DTYPE_NAMES)}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot store a trace; use one of {list(DTYPE_NAMES)}")
    names = _param_names(model)
    owners = _param_owners(model)
    step = {}
    for what, claimed in (("clipped_sum", clipped_sum), ("update", update)):
        if claimed is not None:
            step[what] = _resolve_step(model, what, claimed, names)
    if batch_divisor is not None:
        batch_divisor = _number(batch_divisor, "batch_divisor", positive=True)
    elif update is not None:
        raise ValueError("update needs batch_divisor: the number the library divides the noisy sum by "
                         "(Opacus: expected_batch_size × accumulated_iterations)")
    clip_stabilizer = _number(clip_stabilizer, "clip_stabilizer", positive=False)
    if clipping not in ("flat", "automatic"):
        raise ValueError(f"clipping must be \"flat\" (c = min(1, C/(n + γ))) or \"automatic\" (c = C/(n + γ)), "
                         f"got {clipping!r}")
    entries, handles = _record(model, b)
    try:
        model.zero_grad(set_to_none=True)
        losses = per_example_loss(model, inputs)
        if not torch.is_tensor(losses) or losses.shape != (b,):
            shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
            raise ValueError(f"per_example_loss returned {shape}; expected a tensor of shape ({b},), one loss per example")
        losses.sum().backward()
    finally:
        for h in handles:
            h.remove()
    sites, tensors = [], {}
    for entry in entries:
        for spec, ts in _site_tensors(entry, names, dtype, b, tt):
            if spec["name"] in tensors or any(s["name"] == spec["name"] for s, _, _ in sites):
                raise TraceExportError(f"site name `{spec['name']}` appears twice")
            # bias and weight share backprops; the file is written from host memory
            ts = {k: v.detach().cpu().clone().contiguous() for k, v in ts.items()}
            sites.append((spec, ts, entry))
    for spec, _, entry in sites:
        if entry["dtype"] not in DTYPE_NAMES:
            raise TraceExportError(f"site `{spec['name']}` ({entry['cls']}) computed in {entry['dtype']}; traces "
                                   f"record {list(DTYPE_NAMES)}")
    _self_check(model, sites, names, owners, dtype, b, tt)
    # The precision is per site: the header holds the coarsest (what a reader that knows no
    # per-site precision judges at), and where the sites differ each carries its own.
    site_dtypes = [entry["dtype"] for _, _, entry in sites]
    if site_dtypes:
        compute_dtype = max(site_dtypes, key=_unit_roundoff)
    if len(set(site_dtypes)) > 1:
        for spec, _, entry in sites:
            spec["compute_dtype"] = DTYPE_NAMES[entry["dtype"]]
    specs = [s for s, _, _ in sites]
    for spec, ts, _ in sites:
        for k, v in ts.items():
            tensors[f"{spec['name']}.{k}"] = v
    parameters = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and names[id(p)] not in parameters:
            if p.grad is None:
                warnings.warn(f"parameter `{names[id(p)]}` received no gradient: it is left out of the trace")
                continue
            parameters[names[id(p)]] = p.numel()
    if callable(claimed_norms):
        claimed_norms = claimed_norms(model, inputs)
    tensors["claimed.norms"] = _per_example(claimed_norms, b, "claimed_norms")
    if claimed_coefficients is not None:
        tensors["claimed.coefficients"] = _per_example(claimed_coefficients, b, "claimed_coefficients")
    for what, given in step.items():
        # every parameter of the manifest, each once (a tied parameter under its trace name)
        for param in given:
            if param not in parameters:
                raise ValueError(f"{what}: parameter `{param}` received no gradient in this batch and is left out "
                                 f"of the trace; leave it out of {what} too")
        missing = [param for param in parameters if param not in given]
        if missing:
            raise ValueError(f"{what}: no tensor for parameter(s) {', '.join(f'`{m}`' for m in missing)}: it must "
                             "cover every trainable parameter of the trace, or be left out")
        for param in parameters:  # the manifest's order
            p, t = given[param]
            tensors[f"claimed.{what}.{param}"] = t.detach().to("cpu").reshape(p.shape).contiguous().clone()
    meta = {"format": FORMAT, "max_grad_norm": repr(c), "clipper": str(clipper),
            "sites": json.dumps(specs), "compute_dtype": DTYPE_NAMES[compute_dtype],
            "parameters": json.dumps(parameters)}
    if noise_multiplier is not None:
        meta["noise_multiplier"] = repr(float(noise_multiplier))
    if batch_divisor is not None:
        meta["batch_divisor"] = repr(batch_divisor)
    if step or clip_stabilizer != 0.0:
        meta["clip_stabilizer"] = repr(clip_stabilizer)
    if step or clipping != "flat":
        meta["clipping"] = clipping
    save_file(tensors, os.fspath(path), metadata=meta)
    return specs
