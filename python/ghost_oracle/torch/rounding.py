"""The rounding of the model's own forward and backward in the traced factors (the trace's
`model.rounding`), and the precision the model really computes in.

The judge's bound covers a clipper's arithmetic on the traced factors. The factors themselves
carry the rounding of the forward and backward that produced them, at the model's precision,
and a norm's backward or a tied embedding/head sum amplifies it by cancellation: an f32 model
whose embedding is tied to its head has per-example norms 0.1 % off the exact ones, hundreds of
times the bound. A clipper that computes the same norms another valid way (the f64 model's,
or its own evaluation order) would be accused. So the exporter measures that rounding, per
example, and writes it for the judge to add:

- **The replay.** The same forward and backward run again on a copy of the model at a second
  precision, the same uses captured (same order and names, each with the layout the recorded
  pass found), the same sites formed, and for every example i the exact
  ‖g_i(traced factors) − g_i(replayed factors)‖₂ over all parameters is computed in f64 from
  the two sets of factors (`_difference_norms`, numpy's arithmetic in
  `ghost_oracle._trace.rounding`, the same as the JAX exporter's).
  - A model coarser than f64 (f32, bf16, f16, or an f64 model with float32 islands, below) is
    replayed in f64 with every down-cast lifted: the replay is exact to f64, and the
    difference is the traced gradient's own rounding (`"replay-float64"`).
  - An f64 model is replayed in f32; the difference, f32's rounding of the same computation,
    times u64/u32 = 2⁻²⁹, estimates f64's own (`"replay-float32-scaled"`).
- **Random rounding.** One replay is one evaluation order's rounding, and it can be far
  smaller than another's by chance (the recorded batch's gradient of one example can round to
  within 1/40 of what the same example alone through the model does, the micro-batch loop of
  a library's own tests). So the rounding is measured again, `RANDOM_ROUNDING_REPLAYS` times,
  in float64 replays in which every arithmetic operation's result, forward and backward, is
  multiplied by 1 + u·ε (ε uniform in [−1, 1], seeded; u the unit roundoff of the precision
  the trace is judged at; `_RandomRounding`): an evaluation at the model's precision with its
  roundings drawn at random (Monte Carlo arithmetic). Each example's `model.rounding` is the
  largest of the replay's and the random-rounding replays' differences from the exact replay
  (an f64 model's: from its traced factors), and the header says so (`+random-rounding`).
  Operations that are exact (copies, views, lookups, comparisons, padding: `_EXACT_OPS`) are
  left unperturbed; an operation not in that list is perturbed, which can only widen the
  bound. Inside a matrix product only the result is perturbed, not each partial sum.
  The copy is made from the parameters and buffers (never the user's model: its parameters,
  gradients, hooks, mode and RNG state are left as they are); its RNG starts from the state the
  recorded forward started from, inside a fork. It is skipped, with a warning that says why and
  without the tensor and the header key (the judge then judges as before), where the copy and
  its factors would take more than `REPLAY_MEMORY_FRACTION` of the available memory, where the
  user's loss does not run at the other precision, or where the replay does not capture the
  recorded uses.
- **Float32 islands.** Hugging Face's Llama, Qwen3 and Gemma 3 compute their RMSNorms and the
  eager attention softmax in float32 even in a float64 model. A `TorchFunctionMode` entered
  around the recorded forward (`CastWatch`) sees every call that turns a tensor requiring
  gradients into a coarser floating dtype (`.to`, `.float()`, `type_as`, `softmax(dtype=)`);
  the trace is then judged at the coarsest such dtype (`precision.with_islands`). Under
  autocast only explicit casts count: autocast's own lowering is per site (`precision.site_dtype`).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .._trace.rounding import (
    F32_TO_F64,
    REPLAY_FLOAT32_SCALED,
    REPLAY_FLOAT64,
    REPLAY_MEMORY_FRACTION,
    available_host_memory,
    difference_norms,
    warn_not_measured,
)
from .._trace.rounding import RoundingNotMeasured as _GiveUp
from .batch import input_leaves, packings
from .errors import TraceExportError
from .kinds import Site, Use
from .layout import refuse_mixing_seen_finer, share_as_recorded
from .precision import DTYPE_NAMES, unit_roundoff
from .record import _HOOK_DICTS, param_names, record

#: How many replays in random rounding (see the module's docstring), and their seed.
RANDOM_ROUNDING_REPLAYS = 2
RANDOM_ROUNDING_SEED = 20261207
RANDOM_ROUNDING = "+random-rounding"

#: The sites of a trace, their factors as written.
Sites = Sequence[Site[torch.Tensor]]

# Calls that name a dtype by themselves.
_CAST_METHODS: dict[Any, torch.dtype] = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
                                         torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64}
_EXPLICIT = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as)


def _coarser(a: torch.dtype, b: torch.dtype) -> bool:
    return unit_roundoff(a) > unit_roundoff(b)


def _tensors(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, and inside its lists and tuples (`torch.cat`)."""
    for v in (*args, *kwargs.values()):
        if torch.is_tensor(v):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if torch.is_tensor(t))


def _finest_source(args: Sequence[Any], kwargs: Mapping[str, Any], grad_only: bool) -> torch.Tensor | None:
    """The finest floating-point argument that requires gradients (any, with `grad_only`
    False), or None."""
    best: torch.Tensor | None = None
    for t in _tensors(args, kwargs):
        if t.is_floating_point() and (t.requires_grad or not grad_only):
            if best is None or _coarser(best.dtype, t.dtype):
                best = t
    return best


def _coarsest_output(out: Any, grad_only: bool) -> torch.dtype | None:
    outs = [out] if torch.is_tensor(out) else [t for t in out if torch.is_tensor(t)] if isinstance(
        out, (list, tuple)) else []
    dts = [t.dtype for t in outs if t.is_floating_point() and (t.requires_grad or not grad_only)]
    return max(dts, key=unit_roundoff) if dts else None


def _explicit(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call asks for a dtype itself (not autocast lowering it)."""
    return func in _CAST_METHODS or func in _EXPLICIT or any(
        isinstance(v, torch.dtype) for v in (*args, *kwargs.values()))


def _autocast_on(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: the device type is not an argument
        return bool(torch.is_autocast_enabled()) if device_type == "cuda" else bool(
            getattr(torch, "is_autocast_cpu_enabled", lambda: False)())


def _lifted(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
            to: torch.dtype) -> tuple[Any, Sequence[Any], Mapping[str, Any]]:
    """The call with every floating dtype coarser than `to` it asks for replaced by `to`."""
    def lift(v: Any) -> Any:
        if isinstance(v, torch.dtype) and v.is_floating_point and _coarser(v, to):
            return to
        return v

    if func in _CAST_METHODS and _coarser(_CAST_METHODS[func], to):
        return torch.Tensor.to, (args[0], to), {}
    if func is torch.Tensor.type_as and len(args) > 1 and torch.is_tensor(args[1]) and (
            args[1].is_floating_point() and _coarser(args[1].dtype, to)):
        return torch.Tensor.to, (args[0], to), {}
    if func is torch.Tensor.to:
        other = next((v for v in (*args[1:], kwargs.get("other")) if torch.is_tensor(v)), None)
        if other is not None and other.is_floating_point() and _coarser(other.dtype, to):
            return torch.Tensor.to, (args[0],), {"device": other.device, "dtype": to}
    return func, tuple(lift(v) for v in args), {k: lift(v) for k, v in kwargs.items()}


class _CastMode(TorchFunctionMode):
    """Sees every call that turns a floating-point tensor requiring gradients into a coarser
    floating dtype. With `lift_to`, runs such calls at `lift_to` instead (a replay's), and
    records the ones it could not lift; with `any_source`, tensors that do not require
    gradients count too (a norm's x̂ replayed without autograd)."""

    def __init__(self, lift_to: torch.dtype | None = None, any_source: bool = False) -> None:
        super().__init__()
        self.lift_to, self.grad_only = lift_to, not any_source
        self.coarsest: torch.dtype | None = None
        self.unlifted: list[str] = []

    def __torch_function__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        src = _finest_source(args, kwargs, self.grad_only)
        if src is None:
            return func(*args, **kwargs)
        if self.lift_to is not None and not _coarser(src.dtype, self.lift_to):
            func, args, kwargs = _lifted(func, args, kwargs, self.lift_to)
        out = func(*args, **kwargs)
        dt = _coarsest_output(out, self.grad_only)
        if dt is None or not _coarser(dt, src.dtype):
            return out
        if _autocast_on(src.device.type) and not _explicit(func, args, kwargs):
            return out  # autocast's lowering: each site's own precision (`precision.site_dtype`)
        if self.lift_to is not None:
            if _coarser(dt, self.lift_to):
                self.unlifted.append(f"{getattr(func, '__name__', func)} → {dt}")
        elif self.coarsest is None or _coarser(dt, self.coarsest):
            self.coarsest = dt
        return out


@contextlib.contextmanager
def _mode(mode: _CastMode) -> Iterator[_CastMode]:
    # Entered through an ExitStack: torch's mode methods carry no annotations.
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        yield mode


@dataclass
class CastWatch:
    """What the recorded forward showed of its precision: the coarsest floating dtype a tensor
    requiring gradients was cast down to (None: none was), and the RNG state it started from
    (the replay starts from it too)."""

    coarsest: torch.dtype | None = None
    rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    _entered: bool = field(default=False, repr=False)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Entered around the recorded forward (inside the recorder's own mode, so that the
        modes leave in the order they came)."""
        initialized: Any = torch.cuda.is_initialized  # untyped in torch
        cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and bool(initialized()) else []
        self.rng = (torch.get_rng_state(), cuda)
        with _mode(_CastMode()) as mode:
            try:
                yield
            finally:
                self.coarsest = mode.coarsest


@dataclass
class ModelRounding:
    """`model.rounding` (B, float64) and how it was measured (the header's `model_rounding`)."""

    rounding: torch.Tensor
    method: str


def replay_dtype(model_dtype: torch.dtype, island: torch.dtype | None) -> torch.dtype:
    """f32 for an f64 model without islands, else f64."""
    exact = model_dtype == torch.float64 and (island is None or island == torch.float64)
    return torch.float32 if exact else torch.float64


def _available(device: torch.device) -> int | None:
    """Bytes of memory available on `device` (None: unknown)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    return available_host_memory()


def _over_budget(model: torch.nn.Module, sites: Sites, dtype: torch.dtype) -> str | None:
    """Why the replay would take too much memory, or None."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    by_device: dict[torch.device, int] = {}
    for t in tensors:
        by_device[t.device] = by_device.get(t.device, 0) + t.numel() * (itemsize if t.is_floating_point()
                                                                        else t.element_size())
    factors = 8 * sum(v.numel() for s in sites for v in s.tensors.values())
    host = torch.device("cpu")
    by_device[host] = by_device.get(host, 0) + factors
    for device, need in by_device.items():
        have = _available(device)
        if have is not None and need > REPLAY_MEMORY_FRACTION * have:
            factors_too = " and the replay's f64 factors" if device == host else ""
            return (f"the copy of the model at {DTYPE_NAMES[dtype]}{factors_too} would take {need / 2**20:.0f} "
                    f"MiB on {device}, more than {REPLAY_MEMORY_FRACTION:g} of the {have / 2**20:.0f} MiB available")
    return None


def _copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the model with its floating-point parameters and buffers in `dtype`: new
    tensors (no gradient, no tensor hook, ties kept), made before the rest is deep-copied, so
    nothing of the user's model is shared or touched; without module hooks."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            data = p.detach().to(dtype) if p.is_floating_point() else p.detach().clone()
            memo[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = b.detach().to(dtype) if b.is_floating_point() else b.detach().clone()
    copied: torch.nn.Module = copy.deepcopy(model, memo)
    # The user's module hooks are not the model's computation: on the copy they would run again
    # (a norm's x̂ is replayed through its module) with closures that write into the user's state.
    for m in copied.modules():
        for attr in _HOOK_DICTS:
            d = getattr(m, attr, None)
            if d:
                setattr(m, attr, type(d)())
    return copied


def _converted(inputs: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating-point tensors in `dtype` (integer ones as they are)."""
    def conv(v: Any) -> Any:
        if isinstance(v, PackedSequence):  # kept whole: the packing is the batch's examples
            return PackedSequence(conv(v.data), v.batch_sizes, v.sorted_indices, v.unsorted_indices)
        if torch.is_tensor(v):
            return v.detach().to(dtype) if v.is_floating_point() else v
        if isinstance(v, Mapping):
            out = {k: conv(x) for k, x in v.items()}
            try:
                rebuilt: Any = type(v)
                return rebuilt(out)
            except TypeError:
                return out
        if isinstance(v, (tuple, list)):
            return type(v)(conv(x) for x in v)
        return v

    return conv(inputs)


# aten operations whose result is exact (no rounding to model): copies, views and layout,
# lookups and scatters of single values, comparisons and selections, padding, constants.
_EXACT_OPS = frozenset({
    "clone", "_to_copy", "copy", "copy_", "detach", "lift_fresh", "lift_fresh_copy", "alias", "cat", "stack",
    "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "fill", "scalar_tensor", "arange", "empty_strided", "new_empty_strided",
    "index_select", "gather", "embedding", "index", "select_backward", "slice_backward", "index_put",
    "floor", "ceil", "round", "trunc", "remainder", "fmod",  # integer values (labels read from inputs)
    "relu", "threshold_backward", "neg", "abs", "sign", "max", "min", "amax", "amin", "maximum", "minimum",
    "where", "masked_fill", "clamp", "clamp_min", "clamp_max", "constant_pad_nd", "reflection_pad1d",
    "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "repeat", "flip", "roll", "sort", "topk", "max_pool1d", "max_pool2d", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "im2col", "col2im_exact", "tril", "triu", "contiguous", "_unsafe_view", "view",
    "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice", "narrow",
    "split", "split_with_sizes", "unbind", "as_strided", "unfold", "diagonal", "movedim", "_reshape_alias",
    "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy", "expand_copy", "transpose_copy",
})


# Fused kernels that round several times inside (a norm's mean, variance, rsqrt and scaling; a
# softmax's max, exp, sum and division): run as their decompositions into aten operations, each
# of which then rounds at random, rather than perturbed once at the end.
_DECOMPOSED_OPS = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "_native_batch_norm_legit_no_training", "native_batch_norm_backward", "_fused_rms_norm",
    "_fused_rms_norm_backward", "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "var_mean", "linalg_vector_norm", "mse_loss_backward",
})


def _decomposition(func: Any) -> Callable[..., Any] | None:
    if func.overloadpacket.__name__ not in _DECOMPOSED_OPS:
        return None
    from torch._decomp import decomposition_table

    found: Callable[..., Any] | None = decomposition_table.get(func)
    return found


class _RandomRounding(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    """Multiplies every floating-point result of an aten operation that rounds, forward and
    backward, by 1 + u·ε, ε uniform in [−1, 1] from a seeded generator per device; results that
    alias an input (views, in-place updates) and `_EXACT_OPS` are left as they are."""

    def __init__(self, u: float, seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.u, self.seed = u, seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def _eps(self, t: torch.Tensor) -> torch.Tensor:
        gen = self.generators.get(t.device)
        if gen is None:
            gen = self.generators[t.device] = torch.Generator(device=t.device).manual_seed(self.seed)
        return torch.rand(t.shape, generator=gen, dtype=t.dtype, device=t.device).mul_(2.0).sub_(1.0)

    def _perturbed(self, t: Any, size: Any = None) -> Any:
        """`t` rounded at random: t·(1 + u·ε), or, for a sum whose terms' absolute values sum
        to `size`, t + u·ε·size."""
        if not torch.is_tensor(t) or not t.is_floating_point() or t.numel() == 0:
            return t
        eps = self._eps(t)
        if torch.is_tensor(size):
            return t + eps.mul_(self.u).mul_(size)
        return t * eps.mul_(self.u).add_(1.0)

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        decomposed = _decomposition(func)
        if decomposed is not None:
            with self:  # its operations through this mode again
                return decomposed(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if (func.overloadpacket.__name__ in _EXACT_OPS or schema.is_mutable
                or any(r.alias_info is not None for r in schema.returns)):
            return out
        sizes = _accumulated(func, args, kwargs or {}, out)
        if isinstance(out, (tuple, list)):
            return type(out)(self._perturbed(t, sz) for t, sz in zip(out, sizes or [None] * len(out), strict=True))
        return self._perturbed(out, sizes[0] if sizes else None)


def _abs(v: Any) -> Any:
    return v.abs() if torch.is_tensor(v) and v.is_floating_point() else v


def _accumulated(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> list[Any] | None:
    """For an operation that sums many products (matrix products, convolutions and their
    backward, sums and means): the same operation on the absolute values of its operands, per
    result, the scale of its partial sums' rounding (a sum of k terms rounds each partial sum,
    whose size is that of the terms', not the result's where they cancel); None for any other
    operation."""
    name = func.overloadpacket.__name__
    if name not in ("mm", "bmm", "addmm", "convolution", "convolution_backward", "sum", "mean"):
        return None
    a = [_abs(v) for v in args]
    kw = {k: (abs(v) if k in ("alpha", "beta") and isinstance(v, (int, float)) else _abs(v))
          for k, v in kwargs.items()}
    sized = func(*a, **kw)
    return list(sized) if isinstance(sized, (tuple, list)) else [sized]


def model_rounding(model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], Any], inputs: Any,
                   b_inputs: int | None, batch_axis: int, b: int, entries: Sequence[Use], sites: Sites,
                   watch: CastWatch, model_dtype: torch.dtype, judged_dtype: torch.dtype,
                   on_replay: Callable[[int, int], None] | None = None) -> ModelRounding | None:
    """The rounding of the traced gradient, per example, by a replay and replays in random
    rounding at `judged_dtype`'s unit roundoff (the precision the trace is judged at; see the
    module's docstring); None, with a warning saying why, where it cannot be measured.
    `on_replay(done, total)` as each replay starts and once after the last (each is a forward
    and backward of the batch in float64: minutes on a CNN at a DP batch size)."""
    total = 1 + RANDOM_ROUNDING_REPLAYS

    def replaying(done: int) -> None:
        if on_replay is not None:
            on_replay(done, total)

    dtype = replay_dtype(model_dtype, watch.coarsest)
    try:
        why = _over_budget(model, sites, torch.float64)
        if why is not None:
            raise _GiveUp(why)
        replaying(0)
        replayed = _replay(model, per_example_loss, inputs, b_inputs, batch_axis, b, entries, sites, watch, dtype,
                           probe_mixing=dtype == torch.float64)
        diff = _difference_norms(sites, replayed, b)
        if dtype == torch.float32:
            diff = diff * F32_TO_F64
        # the random-rounding replays, each against the exact evaluation: the f64 replay, or an
        # f64 model's own traced factors
        exact = sites if dtype == torch.float32 else [replace(s, tensors=replayed[s.name]) for s in sites]
        for k in range(RANDOM_ROUNDING_REPLAYS):
            replaying(1 + k)
            noisy = _replay(model, per_example_loss, inputs, b_inputs, batch_axis, b, entries, sites, watch,
                            torch.float64, probe_mixing=False,
                            rounding=_RandomRounding(unit_roundoff(judged_dtype), RANDOM_ROUNDING_SEED + k))
            diff = torch.maximum(diff, _difference_norms(exact, noisy, b))
        replaying(total)
    except _GiveUp as e:
        warn_not_measured(e, stacklevel=3)
        return None
    return ModelRounding(diff, (REPLAY_FLOAT32_SCALED if dtype == torch.float32 else REPLAY_FLOAT64) + RANDOM_ROUNDING)


def _replay(model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], Any], inputs: Any,
            b_inputs: int | None, batch_axis: int, b: int, entries: Sequence[Use], sites: Sites,
            watch: CastWatch, dtype: torch.dtype, probe_mixing: bool,
            rounding: _RandomRounding | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The replay's factors, in f64 on the host, by site name. With `probe_mixing` (a replay
    finer than the model), the single-example probes run again on the replay
    (`layout.refuse_mixing_seen_finer`), and a model that mixes examples is refused."""
    name = DTYPE_NAMES[dtype]

    def rounded() -> contextlib.AbstractContextManager[Any]:
        # the forward and the backward in random rounding; not the sites' forming, whose check
        # of a norm's output against x̂ ⊙ w holds only for one evaluation of both
        return rounding if rounding is not None else contextlib.nullcontext()

    try:
        twin = _copy(model, dtype)
    except Exception as e:  # a module that cannot be deep-copied
        raise _GiveUp(f"the model could not be copied to replay it ({type(e).__name__}: {e})") from e
    twin.zero_grad(set_to_none=True)
    devices = sorted({p.device.index or 0 for p in twin.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        if watch.rng is not None:
            torch.set_rng_state(watch.rng[0])
            if watch.rng[1]:
                torch.cuda.set_rng_state_all(watch.rng[1])
        twin_inputs, leaves = input_leaves(_converted(inputs, dtype))
        rec, handles = record(twin, b_inputs or 0, batch_axis, twin_inputs)
        losses: Any = None
        mixing: TraceExportError | None = None
        try:
            try:
                with _mode(_CastMode(lift_to=dtype)) as lift, rounded():
                    losses = per_example_loss(twin, twin_inputs)
            finally:
                for h in reversed(handles):
                    h.remove()
            if not torch.is_tensor(losses) or tuple(losses.shape) != (b,):
                shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
                raise _GiveUp(f"per_example_loss returned {shape} on the model at {name}, not ({b},)")
            if lift.unlifted:
                raise _GiveUp(f"the replay at {name} still casts down "
                              f"({', '.join(sorted(set(lift.unlifted))[:4])})")
            if [e.name for e in rec.entries] != [e.name for e in entries]:
                raise _GiveUp(f"the replay at {name} captured other uses than the recorded forward "
                              f"({len(rec.entries)} against {len(entries)})")
            with rounded():
                losses.sum().backward(retain_graph=b > 1)
            rec.probing = True  # the entries keep the batch's gradients
            # the uses the recorded pass found shared by every example: their per-example
            # gradients from the replay's own losses
            with rounded():
                share_as_recorded(entries, rec.entries, losses, b)
            if probe_mixing:
                try:
                    refuse_mixing_seen_finer(entries, rec.entries, losses, b, batch_axis, leaves, name,
                                             packings(twin_inputs))
                except TraceExportError as e:
                    mixing = e
        except _GiveUp:
            raise
        except Exception as e:
            raise _GiveUp(f"per_example_loss does not run on the model at {name}, forward and backward "
                          f"({type(e).__name__}: {e})") from e
        finally:
            for use in rec.entries:
                use.output = None
            losses = None
    if mixing is not None:
        raise mixing  # a refusal of the model, not a reason to skip the measurement
    replay_entries = rec.entries
    names = param_names(twin)
    out: dict[str, dict[str, torch.Tensor]] = {}
    with _mode(_CastMode(lift_to=dtype, any_source=True)) as lift:
        for first, again in zip(entries, replay_entries, strict=True):
            if first.sites_formed == 0 or again.output_grad is None:
                continue
            # what the probes found (the layout) is the recorded pass's: copied, not probed again
            again.take_probed(first)
            try:
                for site in again.form_sites(names, torch.float64, b):
                    out[site.name] = {k: v.detach().to("cpu") for k, v in site.tensors.items()}
            except (TraceExportError, RuntimeError, ValueError, TypeError) as e:
                raise _GiveUp(f"the replay's use `{again.name}` at {name} does not form its sites ({e})") from e
            if _coarser(again.dtype, dtype):
                raise _GiveUp(f"the replay's use `{again.name}` computed in {again.dtype}, not {name}")
            again.input = None
            again.output_grad = None
    if lift.unlifted:
        raise _GiveUp(f"the replay at {name} still casts down ({', '.join(sorted(set(lift.unlifted))[:4])})")
    want = [s.name for s in sites]
    if sorted(out) != sorted(want):
        raise _GiveUp(f"the replay at {name} formed other sites than the recorded forward")
    return out


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A factor as a numpy array on the host, without a copy where it is one already (bfloat16,
    which numpy lacks, widened exactly to float32)."""
    t = t.detach().to("cpu")
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _difference_norms(sites: Sites, replayed: Mapping[str, Mapping[str, torch.Tensor]], b: int) -> torch.Tensor:
    """‖g_i(traced) − g_i(replayed)‖₂ over every parameter, per example, in f64: the two sets of
    factors handed to the framework-neutral `ghost_oracle._trace.rounding.difference_norms`."""
    traced = [(s.spec(), {k: _numpy(v) for k, v in s.tensors.items()}) for s in sites]
    again = {name: {k: _numpy(v) for k, v in ts.items()} for name, ts in replayed.items()}
    return torch.from_numpy(difference_norms(traced, again, b))
