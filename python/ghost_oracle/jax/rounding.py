"""The rounding of the model's own forward and backward in the traced factors (the trace's
`model.rounding`), measured by a replay at a second precision: the JAX twin of
`ghost_oracle.torch.rounding`, with the same tensor, header key and method names.

The judge's bound covers a clipper's arithmetic on the traced factors. The factors themselves
carry the rounding of the forward and backward that produced them, at the model's precision,
and a norm's backward (a LayerNorm or RMSNorm over few features) or a tied embed/attend sum
amplifies it by cancellation; a clipper computing the same norms another valid way (the f64
model's, or its own order) would be accused. So the exporter measures that rounding per example
and writes it for the judge to add:

- **The replay.** The capture (`capture.py`) runs again on the parameters and the batch cast to
  a second precision, every module computing in it (an interceptor sets each Flax module's
  `dtype` around its call: `_Precision`); the same calls are captured (same keys, in the same
  order) and the same sites formed, and for every example i the exact
  ‖g_i(traced factors) − g_i(replayed factors)‖₂ over all parameters is computed in f64 from
  the two sets of factors (`ghost_oracle._trace.rounding.difference_norms`, numpy only).
  - A model coarser than f64 (f32, bf16, f16 sites, or f64 sites with a cast down to a coarser
    float between them) is replayed in f64 under `jax.enable_x64`: the replay is exact to f64,
    and the difference is the traced gradient's own rounding (`"replay-float64"`).
  - An f64 model is replayed in f32; the difference, f32's rounding of the same computation,
    times u64/u32 = 2⁻²⁹, estimates f64's own (`"replay-float32-scaled"`).
  A cast down outside a module's `dtype` (a loss's `.astype(jnp.float32)`, a float32 island,
  `lax.reduce_precision`) is not lifted: JAX forms its casts in one internal function that its
  own code (an initializer's shape check) calls too, so lifting there breaks it. The replay's
  jaxpr is checked to hold no cast down (`down_casts`), and the replay gives up, naming the
  cast, where one is left: a loss that casts with `x.astype(jnp.promote_types(x.dtype,
  jnp.float32))` keeps it an up-cast at any precision.
- **Skipped**, with a warning saying why and without the tensor and the header key (the judge
  then judges as before): where float64 is not available to JAX (`jax.enable_x64`), where the
  replay's copy of the parameters and its factors (f64, on the host) would take more than
  `REPLAY_MEMORY_FRACTION` of the available memory, where the loss does not run at the other
  precision, or where the replay does not capture the recorded calls and sites.

The replay costs about one more export (the capture and its per-example probes) plus one trace
of the forward to a jaxpr; the difference's memory is one parameter's per-example difference at
a time (or its Gram over rows, where that is smaller), never B per-example gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._trace.format import MODEL_ROUNDING, TraceExportError
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
from .capture import PerExampleLoss, capture
from .kinds import handler_for
from .sites import Call, Site

assert REPLAY_FLOAT64 in MODEL_ROUNDING and REPLAY_FLOAT32_SCALED in MODEL_ROUNDING

_F64, _F32 = np.dtype(np.float64), np.dtype(np.float32)
_UNIT_ROUNDOFF = {np.dtype(np.float64): 2.0**-53, np.dtype(np.float32): 2.0**-24,
                  np.dtype(np.float16): 2.0**-11, np.dtype(ml_dtypes.bfloat16): 2.0**-8}


@dataclass
class ModelRounding:
    """`model.rounding` (B, float64) and how it was measured (the header's `model_rounding`)."""

    rounding: np.ndarray
    method: str


def _float_dtype(value: Any) -> np.dtype[Any] | None:
    """`value` as a floating numpy dtype (bfloat16 included), or None."""
    try:
        dt = np.dtype(value)
    except TypeError:
        return None
    return dt if dt in _UNIT_ROUNDOFF else None


def _coarser(a: np.dtype[Any], b: np.dtype[Any]) -> bool:
    return _UNIT_ROUNDOFF[a] > _UNIT_ROUNDOFF[b]


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    """float64 in JAX for the replay, whatever the caller's setting; `_GiveUp` where this JAX
    cannot give it."""
    enable: Any = getattr(jax, "enable_x64", None)
    if enable is None:
        enable = getattr(getattr(jax, "experimental", None), "enable_x64", None)
    if enable is None:
        raise _GiveUp("this JAX has neither jax.enable_x64 nor jax.experimental.enable_x64, so float64 is not "
                      "available to the replay")
    with enable(True):
        try:
            probe = jnp.ones((2,), jnp.float64) * 3.0
            ok = np.dtype(probe.dtype) == _F64 and float(np.asarray(probe)[0]) == 3.0
        except Exception as e:  # a backend without float64
            raise _GiveUp(f"float64 is not available to JAX here ({type(e).__name__}: {e})") from e
        if not ok:
            raise _GiveUp(f"jax.enable_x64 is on but arrays still compute in {probe.dtype}: float64 is not available "
                          "to the replay")
        yield


class _Precision:
    """An interceptor that makes every Flax module with a floating `dtype` field compute in the
    replay's dtype for the duration of its call (restored after it): a module's `dtype` is where
    Flax casts its inputs and parameters."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype

    def __call__(self, next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 context: Any) -> Any:
        module = context.module
        fields = {f.name for f in dataclasses.fields(module)} if dataclasses.is_dataclass(module) else set()
        old = getattr(module, "dtype", None) if "dtype" in fields else None
        if _float_dtype(old) is None or _float_dtype(old) == self.dtype:
            return next_fun(*args, **kwargs)
        # a Flax module is a frozen dataclass: its field is set around the call, on the bound
        # copy `apply` made, never on the user's module
        object.__setattr__(module, "dtype", jnp.dtype(self.dtype))
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "dtype", old)


def _cast(tree: Any, dtype: np.dtype[Any]) -> Any:
    """The pytree with its floating-point arrays in `dtype` (integer ones as they are)."""
    def conv(v: Any) -> Any:
        if hasattr(v, "dtype") and hasattr(v, "shape") and _float_dtype(v.dtype) is not None:
            return jnp.asarray(np.asarray(v).astype(dtype))
        return v

    return jax.tree_util.tree_map(conv, tree)


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _casts_in(jaxpr: Any, finer_than: np.dtype[Any], found: set[str]) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("convert_element_type", "reduce_precision"):
            src = _float_dtype(eqn.invars[0].aval.dtype)
            dst = _float_dtype(eqn.outvars[0].aval.dtype)
            if eqn.primitive.name == "reduce_precision" and src is not None:
                # rounds to a float of `mantissa_bits` inside its own dtype
                bits = int(eqn.params.get("mantissa_bits", 52))
                if 2.0**-(bits + 1) > _UNIT_ROUNDOFF[finer_than]:
                    found.add(f"reduce_precision to {bits} mantissa bits")
            elif src is not None and dst is not None and _coarser(dst, src) and _coarser(dst, finer_than):
                found.add(f"{src.name} → {dst.name}")
        for p in eqn.params.values():
            for sub in _sub_jaxprs(p):
                _casts_in(sub, finer_than, found)


def down_casts(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any,
               outer: Callable[..., Any] | None, coarser_than: np.dtype[Any]) -> list[str]:
    """The casts of a floating value to a float coarser than `coarser_than` in the forward and
    loss (traced to a jaxpr, not run), sub-computations (scan, jit, cond) included."""
    def losses(p: Any, x: Any) -> Any:
        def apply(*args: Any, **kwargs: Any) -> Any:
            with contextlib.ExitStack() as stack:
                if outer is not None:
                    stack.enter_context(nn.intercept_methods(outer))
                return model.apply({"params": p}, *args, **kwargs)
        return per_example_loss(apply, x)

    jaxpr = jax.make_jaxpr(losses)(params, inputs)
    found: set[str] = set()
    _casts_in(jaxpr.jaxpr, coarser_than, found)
    return sorted(found)


def replay_dtype(sites: Sequence[Site], casts: Sequence[str]) -> np.dtype[Any]:
    """f32 for a model whose sites are all f64 and whose forward casts nothing down, else f64."""
    exact = all(s.precision == "f64" for s in sites) and not casts
    return _F32 if exact else _F64


def _over_budget(params: Any, sites: Sequence[Site], dtype: np.dtype[Any]) -> str | None:
    """Why the replay would take too much memory, or None."""
    leaves = [v for v in jax.tree_util.tree_leaves(params) if hasattr(v, "size")]
    copy = sum(int(v.size) * (dtype.itemsize if _float_dtype(v.dtype) is not None else np.dtype(v.dtype).itemsize)
               for v in leaves)
    factors = 8 * sum(int(v.size) for s in sites for v in s.tensors.values())
    need, have = copy + 2 * factors, available_host_memory()  # the replay's factors, and the trace's read in f64
    if have is not None and need > REPLAY_MEMORY_FRACTION * have:
        return (f"the parameters at {dtype.name} and the replay's f64 factors would take {need / 2**20:.0f} MiB, more "
                f"than {REPLAY_MEMORY_FRACTION:g} of the {have / 2**20:.0f} MiB available")
    return None


def model_rounding(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, b: int,
                   keep: np.ndarray, calls: Sequence[Call], sites: Sequence[Site]) -> ModelRounding | None:
    """The rounding of the traced gradient (its factors as written), per kept example, by a
    replay (see the module's docstring); None, with a warning saying why, where it cannot be
    measured."""
    try:
        casts: list[str] = []
        if all(s.precision == "f64" for s in sites):
            # an f64 model replays in f32 unless its forward casts down somewhere (a float32
            # island), whose rounding only a replay in f64 sees
            try:
                casts = down_casts(model, params, per_example_loss, inputs, None, _F64)
            except Exception as e:  # the capture ran eagerly; a jaxpr of the forward may not trace
                raise _GiveUp(f"the forward does not trace to a jaxpr, to find its casts ({type(e).__name__}: "
                              f"{e})") from e
        dtype = replay_dtype(sites, casts)
        why = _over_budget(params, sites, dtype)
        if why is not None:
            raise _GiveUp(why)
        with _x64():
            replayed = _replay(model, params, per_example_loss, inputs, b, keep, calls, sites, dtype)
        diff = difference_norms([(s.spec(), s.tensors) for s in sites], replayed, int(keep.sum()))
    except _GiveUp as e:
        warn_not_measured(e, stacklevel=3)
        return None
    if dtype == _F32:
        return ModelRounding(diff * F32_TO_F64, REPLAY_FLOAT32_SCALED)
    return ModelRounding(diff, REPLAY_FLOAT64)


def _replay(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, b: int, keep: np.ndarray,
            calls: Sequence[Call], sites: Sequence[Site], dtype: np.dtype[Any]) -> dict[str, dict[str, np.ndarray]]:
    """The replay's factors, in f64 (ids as int64), by site name."""
    name = dtype.name
    precision = _Precision(dtype)
    p, x = _cast(params, dtype), _cast(inputs, dtype)
    try:
        left = down_casts(model, p, per_example_loss, x, precision, dtype)
    except Exception as e:
        raise _GiveUp(f"the forward at {name} does not trace to a jaxpr ({type(e).__name__}: {e})") from e
    if left:
        raise _GiveUp(f"the replay at {name} still casts down ({', '.join(left[:4])}): a cast outside a Flax module's "
                      "`dtype`, which the replay does not lift (in a loss, `x.astype(jnp.promote_types(x.dtype, "
                      "jnp.float32))` keeps the cast an up-cast)")
    try:
        replayed = capture(model, p, per_example_loss, x, b, keep.astype(np.float64), outer=precision)
    except Exception as e:
        raise _GiveUp(f"per_example_loss does not run on the model at {name}, forward and backward "
                      f"({type(e).__name__}: {e})") from e
    if [c.key for c in replayed.calls] != [c.key for c in calls]:
        raise _GiveUp(f"the replay at {name} captured other calls than the recorded forward "
                      f"({len(replayed.calls)} against {len(calls)})")
    out: dict[str, dict[str, np.ndarray]] = {}
    by_call: dict[str, list[Site]] = {}
    for s in sites:
        by_call.setdefault(s.call.key, []).append(s)
    for call in replayed.calls:
        if _float_dtype(call.out_dtype) is None or _coarser(np.dtype(call.out_dtype), dtype):
            raise _GiveUp(f"the replay's {call.where} computed in {np.dtype(call.out_dtype).name}, not {name}")
        handler = handler_for(call.module, call.method)
        assert handler is not None  # the capture records modelled calls only
        try:
            formed = list(handler.sites(call, b))
        except (TraceExportError, ValueError, TypeError) as e:
            raise _GiveUp(f"the replay's {call.where} at {name} does not form its sites ({e})") from e
        recorded = by_call.get(call.key, [])
        if [(s.kind, s.param) for s in formed] != [(s.kind, s.param) for s in recorded]:
            raise _GiveUp(f"the replay's {call.where} at {name} formed other sites than the recorded forward")
        for again, first in zip(formed, recorded, strict=True):
            out[first.name] = {k: (v[keep].astype(np.int64) if k == "ids" else v[keep].astype(np.float64))
                               for k, v in again.tensors.items()}
    if sorted(out) != sorted(s.name for s in sites):
        raise _GiveUp(f"the replay at {name} formed other sites than the recorded forward")
    return out
