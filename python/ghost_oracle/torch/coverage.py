"""Coverage: every trainable parameter that received a gradient has a site. Checked before any
gradient is rebuilt (`check.py`): a parameter without one would be left out of the trace, and
its examples' norms with it. A parameter without a site is refused by name, with the reason
(`_why_no_site`): a mixture of experts' fused 3-D expert tensor, torch's fused RNN kernels, a
subclass of a modelled class, or a use no handler describes. What the exporter models is listed
from the registry (`kinds.base.modelled`), so the message cannot fall behind the kinds."""
from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from .errors import TraceExportError
from .kinds.base import modelled, modelled_base


def covered_parameters(model: torch.nn.Module, with_sites: Collection[str], names: Mapping[int, str],
                       owners: Mapping[int, list[tuple[str, str]]]) -> list[torch.nn.Parameter]:
    """The trainable parameters that received a gradient, each once; raises naming the first
    without a site (`with_sites`: the trace names of the parameters the sites write). A fused
    expert tensor is named first: it is the reason the model cannot be traced, and its router
    (whose gradient flows through the routing weights) has no site either."""
    seen: set[int] = set()
    params: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or not p.requires_grad or p.grad is None:
            continue
        seen.add(id(p))
        params.append(p)
    missing = [p for p in params if names[id(p)] not in with_sites]
    for p in missing:
        if _fused_experts(p, names, owners):
            name, mods = names[id(p)], _modules(p, owners)
            raise TraceExportError(
                f"parameter `{name}` (module {mods}) is a {p.dim()}-D tensor {list(p.shape)}, one matrix per "
                "expert of a mixture of experts: each token is multiplied by the slices its router picked, a "
                "per-token choice of matrix that no site kind (linear, conv1d, embedding, bias, layernorm) "
                "represents, so the exporter refuses it rather than write a trace without it. To trace the "
                "dense parts, freeze the experts and the router (requires_grad=False)")
    if missing:
        p = missing[0]
        modules = dict(model.named_modules(remove_duplicate=False))
        raise TraceExportError(f"parameter `{names[id(p)]}` (module {_modules(p, owners)}) received a gradient but "
                               f"has no site: {_why_no_site(p, modules, owners)}")
    return params


def _modules(p: torch.nn.Parameter, owners: Mapping[int, list[tuple[str, str]]]) -> str:
    """The modules holding `p`, as messages name them."""
    return ", ".join(f"`{m}` ({c})" for m, c in owners.get(id(p), []))


def _fused_experts(p: torch.Tensor, names: Mapping[int, str], owners: Mapping[int, list[tuple[str, str]]]) -> bool:
    """A 3-D tensor of stacked expert matrices, by its shape and its name or its module's."""
    labels = [names[id(p)]] + [c for _, c in owners.get(id(p), [])]
    return p.dim() == 3 and any("expert" in s.lower() for s in labels)


def _why_no_site(p: torch.nn.Parameter, modules: Mapping[str, torch.nn.Module],
                 owners: Mapping[int, list[tuple[str, str]]]) -> str:
    """Why a parameter that received a gradient has no site: its module is a subclass of a class
    the exporter models (which is not traced as its base), or it was used in a way no handler or
    captured call describes."""
    for mod_name, cls in owners.get(id(p), []):
        if isinstance(modules.get(mod_name), torch.nn.RNNBase):
            return (f"module `{mod_name}` is torch's {cls}, whose fused kernel (one call for every layer and time "
                    "step, padded or packed) uses its weights where the exporter cannot see the per-step products; "
                    "Opacus's DPLSTM, DPGRU and DPRNN (opacus.layers) compute the same recurrences with a linear "
                    "layer per step, which the exporter traces, on padded and packed batches alike")
        found = modelled_base(modules[mod_name]) if mod_name in modules else None
        if found is not None:
            base, kind = found
            declare = (f"If {cls} computes what {base.__name__} computes, declare it: "
                       f"ghost_oracle.torch.register_module({cls}, \"{kind}\")" if kind is not None else
                       f"If {cls} computes what {base.__name__} computes, declare it with register_module and a "
                       "Handler")
            return (f"module `{mod_name}` is a {cls}, a subclass of {base.__module__}.{base.__name__}, and the "
                    "exporter traces a class by its exact type, never as its base (a subclass may change "
                    f"forward). {declare}")
    return modelled_uses() + (
        "; this parameter was used some other way (an elementwise product, a slice, an add that scales it). If "
        "its module's class computes what one of the kinds computes, declare it: "
        "ghost_oracle.torch.register_module(cls, kind)")


def modelled_uses() -> str:
    """What the exporter models, in words, from the registry."""
    m = modelled()
    declared = f" ({', '.join(m['declared classes'])})" if m["declared classes"] else ""
    return (f"the exporter models the modules of the classes {', '.join(m['module classes'])} (by exact type); "
            f"{'; '.join(m['classes known by name'])}; the classes declared with register_module{declared}; and "
            f"the calls on a parameter of {', '.join(m['functions'])}")
