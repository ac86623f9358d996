"""The self-check: nothing is written unless every trainable parameter that received a gradient
is accounted for by its sites, and the batch gradient rebuilt from their factors (as stored)
equals autograd's `p.grad` to rounding, at a tolerance that follows each site's precision. It
holds one parameter at a time, a block of rows at a time (a tied embedding and head in blocks of
vocabulary rows): its memory is a few hundred MiB above the model's, not a second copy of every
gradient."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from .errors import TraceExportError
from .kinds.base import modelled_base
from .precision import DTYPE_NAMES, reduction_tolerance, unit_roundoff
from .site_kinds import layout, low_precision_rounds, rebuild, sketch

#: The sites of one parameter: (spec, tensors, the use's entry) each.
Uses = Sequence[tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]


def self_check(model: torch.nn.Module,
               sites: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]],
               names: Mapping[int, str], owners: Mapping[int, list[tuple[str, str]]],
               store_dtype: torch.dtype | None, progress: Any = None) -> None:
    """Raises unless every trainable parameter that received a gradient has a site and its
    sites' factors rebuild autograd's gradient to rounding, each site at its own precision
    (`entry["dtype"]`; `store_dtype` None: each site stored in its own)."""
    by_param: dict[str, list[tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]] = {}
    for spec, ts, entry in sites:
        by_param.setdefault(spec["param"], []).append((spec, ts, entry))
    seen: set[int] = set()
    params: list[torch.nn.Parameter] = []
    modules = dict(model.named_modules(remove_duplicate=False))
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or not p.requires_grad or p.grad is None:
            continue
        seen.add(id(p))
        params.append(p)
    def fused_experts(p: torch.Tensor) -> bool:
        """A 3-D tensor of stacked expert matrices, by its shape and its name or its module's."""
        labels = [names[id(p)]] + [c for _, c in owners.get(id(p), [])]
        return p.dim() == 3 and names[id(p)] not in by_param and any("expert" in s.lower() for s in labels)

    # A fused expert tensor is named first: it is the reason the model cannot be traced, and
    # its router (whose gradient flows through the routing weights) has no site either.
    params.sort(key=lambda p: 0 if fused_experts(p) else 1)
    for n, p in enumerate(params):
        if progress is not None:
            progress.step("self-check against autograd, parameters", n, len(params))
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
            raise TraceExportError(f"parameter `{name}` (module {mods}) received a gradient but has no site: "
                                   + _why_no_site(p, modules, owners))
        for spec, ts, _ in uses:
            r, c = layout(spec, ts)
            if r * c != p.numel():
                raise TraceExportError(
                    f"parameter `{name}` (module {mods}): site `{spec['name']}` ({spec['kind']}) rebuilds "
                    f"{r * c} entries but the parameter has {p.numel()}"
                )
        _check_param(p, name, mods, uses, store_dtype)


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
    return ("the exporter models the modules its handlers know by exact type (linear layers, convolutions, "
            "embeddings and embedding bags, layer, RMS, group and instance norms, Hugging Face's Conv1D and "
            "scaled embeddings), the classes declared with register_module, the calls of F.linear, F.embedding, "
            "F.conv*, the functional norms and `x @ w` on a parameter, and a parameter repeated along the batch "
            "(`repeat`, `expand`, `tile`); this parameter was used some other way (an elementwise product, a "
            "slice, a bias added with `+`). If its module's class computes what one of the kinds computes, "
            "declare it: ghost_oracle.torch.register_module(cls, kind)")


def _blocks(uses: Uses, numel: int) -> list[tuple[int, int] | None]:
    """Row ranges of the parameter's layout, each a block of about `_BLOCK_ENTRIES` entries:
    a tied embedding and head (V×d) is rebuilt a block of vocabulary rows at a time, never
    whole. One block where the sites lay the parameter out with different rows."""
    layouts = {layout(spec, ts) for spec, ts, _ in uses}
    if len(layouts) != 1:
        return [None]
    rows, cols = layouts.pop()
    step = max(1, _BLOCK_ENTRIES // max(cols, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


#: Entries of one parameter rebuilt at a time: six f64 arrays of this many are 192 MiB.
_BLOCK_ENTRIES = 4 << 20


#: A parameter is checked entry by entry while rebuilding it costs at most this many products
#: (B·T·rows·cols over its linear and conv1d sites; 2²⁶ is a few hundredths of a second here).
#: Past it the check is sketched: at 1B-class sizes the entry-by-entry rebuild, two f64
#: products of every weight's size, took longer than the training step itself.
FULL_CHECK_PRODUCTS = 1 << 26
#: Columns of the sketch's ±1 probe matrix, and its seed.
SKETCH_COLUMNS = 4
_SKETCH_SEED = 0x5EED


def _probe_matrix(uses: Uses, numel: int) -> torch.Tensor | None:
    """The ±1 matrix (cols × SKETCH_COLUMNS) the parameter's gradient is checked through, or
    None where it is checked entry by entry: where rebuilding it is cheap, and where its sites
    have no common matrix layout.

    The sketch compares G·v with autograd's `p.grad`·v, where G is the gradient the sites
    rebuild: a linear site's G·v = gᵀ(a·v) costs B·T·(in + out)·k products, not B·T·in·out.
    Its bound is the entries' bounds summed through |v|, so it never refuses a right trace, and
    a site wrong by a structural factor (a missing scale, a skipped use, a wrong layout) moves
    every row's k sums by about √cols times the entries' error, far past it. What it gives up
    is the entry-by-entry resolution: an error confined to a few entries of a row, below the
    row's summed bound, passes."""
    layouts = {layout(spec, ts) for spec, ts, _ in uses}
    if len(layouts) != 1 or any(spec["kind"] not in ("linear", "conv1d", "embedding") for spec, _, _ in uses):
        return None
    _, cols = layouts.pop()
    cost = sum(ts["backprops"].numel() // ts["backprops"].shape[-1] * numel
               for spec, ts, _ in uses if spec["kind"] in ("linear", "conv1d"))
    if cols == 1 or cost <= FULL_CHECK_PRODUCTS:
        return None
    gen = torch.Generator().manual_seed(_SKETCH_SEED)
    return (torch.randint(0, 2, (cols, SKETCH_COLUMNS), generator=gen) * 2 - 1).to(torch.float64)


def _autograd_rounding(spec: Mapping[str, Any], entry: Mapping[str, Any], block: tuple[int, int] | None, cols: int,
                       v: torch.Tensor | None) -> torch.Tensor | float:
    """The rounding autograd's own backward adds to a site whose factors are exact where autograd's
    are not (`entry["autograd_rounding"]`, by site name, in the parameter's layout): GroupNorm with
    one value a group, whose exact weight gradient 0 autograd forms by a cancellation scaled by
    1/√ε. 0 for every other site."""
    bound = entry.get("autograd_rounding", {}).get(spec["name"])
    if bound is None:
        return 0.0
    bound = bound.reshape(-1) if block is None else bound.reshape(-1)[block[0] * cols:block[1] * cols]
    if v is not None:  # a sketched sum's entries gather a row's bounds through |v|
        bound = bound.view(-1, cols) @ v.abs()
    return cast(torch.Tensor, bound.reshape(-1))


def _check_param(p: torch.nn.Parameter, name: str, mods: str, uses: Uses, store_dtype: torch.dtype | None) -> None:
    """Holds the batch gradient rebuilt from `uses` (the sites of parameter `p`) to autograd's
    `p.grad`, a block of rows at a time, entry by entry or sketched (`_probe_matrix`); raises
    naming the worst entry."""
    assert p.grad is not None  # only the parameters that received a gradient are checked
    grad = p.grad.detach().reshape(-1)
    v = _probe_matrix(uses, p.numel())
    cols = layout(*uses[0][:2])[1]
    mass = 1.0 if v is None else float(cols)  # Σ_i |v_ik|
    # terms per entry of the sketch's second product, B·T (B·T·H for a per-head use)
    terms = max(ts["backprops"].numel() // ts["backprops"].shape[-1] for _, ts, _ in uses)
    worst: tuple[float, int, float, float, float, float] | None = None  # (error / tolerance, entry, rebuilt,
    # autograd, error, tolerance)
    bad_count = 0
    checked = 0
    for block in _blocks(uses, p.numel()):
        rebuilt: torch.Tensor | None = None
        absum: torch.Tensor | None = None
        tol: torch.Tensor | None = None
        for spec, ts, entry in uses:
            rounds = low_precision_rounds(spec, ts, entry["dtype"], block)
            if v is None:
                r, a = rebuild(spec, ts, block)
            else:
                assert block is not None  # a sketched parameter has one layout, so row blocks
                r, a = sketch(spec, ts, block, v)
                r, a = r.reshape(-1), a.reshape(-1)
                if rounds is not None:  # an embedding's count is the same along a row
                    rounds = rounds.view(-1, cols)[:, :1].expand(-1, v.shape[1]).reshape(-1)
            rebuilt = r if rebuilt is None else rebuilt + r
            absum = a if absum is None else absum + a
            store = entry["dtype"] if store_dtype is None else store_dtype
            rows = ts["backprops"].shape[0] * ts["backprops"].shape[1]  # B·T, or B·T·H for a per-head norm
            t = reduction_tolerance(a, entry["dtype"], store, rows, rounds, mass)
            t = t + _autograd_rounding(spec, entry, block, cols, v)
            tol = t if tol is None else tol + t
        assert rebuilt is not None and absum is not None and tol is not None  # a parameter has uses
        # autograd adds the uses of a tied parameter into p.grad in the parameter's dtype
        tol = tol + 2.0 * (len(uses) - 1) * unit_roundoff(p.dtype) * absum + torch.finfo(p.dtype).tiny * mass
        if v is None:
            offset = 0 if block is None else block[0] * cols  # blocks come with one layout only
            want = grad[offset:offset + rebuilt.numel()].to(device="cpu", dtype=torch.float64)
        else:
            assert block is not None
            offset = block[0] * v.shape[1]
            own = grad[block[0] * cols:block[1] * cols].to(device="cpu", dtype=torch.float64).view(-1, cols)
            want = (own @ v).reshape(-1)
            # the two f64 products of the sketch round too: ≤ (cols + B·T)·u64 of their terms
            own_terms = (own.abs() @ v.abs()).reshape(-1)
            tol = tol + 2.0 * (cols + terms) * unit_roundoff(torch.float64) * (absum + own_terms)
        checked += rebuilt.numel()
        err = (rebuilt - want).abs()
        bad = err > tol
        if bool(bad.any()):
            bad_count += int(bad.sum())
            ratio = err / tol
            k = int(torch.argmax(ratio))
            if worst is None or float(ratio[k]) > worst[0]:
                worst = (float(ratio[k]), offset + k, float(rebuilt[k]), float(want[k]), float(err[k]), float(tol[k]))
    if worst is not None:
        _, k, rebuilt_k, want_k, err_k, tol_k = worst
        site_list = ", ".join(f"`{s['name']}` ({s['kind']}, module class {e['cls']}, computed in "
                              f"{DTYPE_NAMES.get(e['dtype'], e['dtype'])})" for s, _, e in uses)
        if v is None:
            what, at = f"at {bad_count} of {checked} entries", f"entry {k}"
        else:
            what = (f"through a ±1 probe matrix (cols × {v.shape[1]}, the check of a large parameter) at "
                    f"{bad_count} of {checked} probed sums")
            at = f"row {k // v.shape[1]}, probe {k % v.shape[1]}"
        raise TraceExportError(
            f"parameter `{name}` (module {mods}): the gradient rebuilt from its sites {site_list} differs "
            f"from autograd's {what}; worst {at}: rebuilt "
            f"{rebuilt_k:.6e}, autograd {want_k:.6e}, |error| {err_k:.3e} > "
            f"tolerance {tol_k:.3e}. The module's forward is not what the exporter models "
            "(a subclass that changes forward, a scale or cast inside it, a class declared with "
            "register_module that does not compute what its kind computes)"
        )
