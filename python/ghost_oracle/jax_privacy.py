"""jax_privacy's DP step as claims for the oracle, and the one-line gates.

    from ghost_oracle.jax_privacy import assert_update, dp_step

    step = dp_step(model, params, per_example_loss, batch, l2_clip_norm=1.0, noise_multiplier=1.0,
                   normalize_by=len(batch))
    ghost_oracle.jax.export_trace(model, params, per_example_loss, batch, "step.safetensors",
                                  clipper="jax_privacy", **step.export_kwargs())
    assert_update(model, params, per_example_loss, batch, l2_clip_norm=1.0, noise_multiplier=1.0,
                  normalize_by=len(batch))

Any JAX program, as jax_privacy itself takes it: `fun(params, batch)` returning the loss of the
examples in `batch` (a plain function, Flax NNX through `nnx.merge`, Keras 3's `stateless_call`,
Equinox, Haiku, a wrapped linen `apply`), judged through `ghost_oracle.jax`'s program route:

    from ghost_oracle.jax_privacy import assert_step
    assert_step(fun, params, batch, l2_clip_norm=1.0, noise_multiplier=1.0, normalize_by=len(batch), key=0)

`dp_step` and `fun_step` run jax_privacy itself (one code path, `_run_jax_privacy`):
`clipping.clipped_grad(..., return_grad_norms=True)` gives the claimed norms and the clipped sum,
and `noise_addition.gaussian_privatizer` (stddev σ times the clipped function's sensitivity, as
jax_privacy's own training loop sets it) the noisy update. jax_privacy returns the clipped sum
divided by `normalize_by` (and by C with `rescale_to_unit_norm`): the oracle's clipped sum is that
times the divisor, and the divisor D in u = (Σ c_i g_i + σ C ξ) / D is `normalize_by` (times C).
Padding examples (`is_padding_example`) are left out of the trace, as jax_privacy leaves them out
of the sum.

`shadow()`: while active, every call of a function `clipped_grad` returns is judged (its norms
and its clipped sum), with a tally, as `ghost_oracle.shadow` judges Opacus.

Correlated noise (BandMF, `num_bands > 1`, any `matrix_factorization_privatizer` other than the
identity) adds noise that depends on earlier steps; the oracle's step test models i.i.d. noise
per step, so it is refused by name rather than judged against the wrong model.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ._gate import GateRun
from ._report import Report
from ._trace.format import number
from ._types import Precision
from .jax.capture import PerExampleLoss, flat_params
from .jax.gate import assert_norms as _assert_norms
from .jax.gate import assert_update as _assert_update
from .shadow.computation import OnFailure, Outcome, OutcomeKind, ShadowCheckFailed, describe
from .shadow.report import JsonlReport
from .shadow.summary import Summary

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ClippedGradShadow", "JaxPrivacyStep", "assert_norms", "assert_step", "assert_update", "dp_step",
           "fun_step", "shadow"]


@dataclass
class JaxPrivacyStep:
    """What jax_privacy did on one batch, in the oracle's terms: the norms it clipped by, its
    clipped sum Σ_i c_i g_i (multiplied back by its divisor), its update and that divisor. The
    clipped sum and the update are keyed by Flax path (`dp_step`) or shaped like `params`
    (`fun_step`)."""

    claimed_norms: np.ndarray
    clipped_sum: Any
    update: Any
    batch_divisor: float
    max_grad_norm: float
    noise_multiplier: float
    is_padding_example: np.ndarray | None

    def export_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `ghost_oracle.jax.export_trace` for this step."""
        return {"claimed_norms": self.claimed_norms, "clipped_sum": self.clipped_sum, "update": self.update,
                "batch_divisor": self.batch_divisor, "max_grad_norm": self.max_grad_norm,
                "noise_multiplier": self.noise_multiplier, "is_padding_example": self.is_padding_example}


def _refuse_correlated_noise(num_bands: int) -> None:
    if int(num_bands) != num_bands or num_bands < 1:
        raise ValueError(f"num_bands must be a positive integer, got {num_bands!r}")
    if num_bands > 1:
        raise ValueError(
            f"num_bands={num_bands}: BandMF (banded matrix factorization) correlates the noise of a step with the "
            "noise of the steps before it; the oracle judges a step's noise as i.i.d. N(0, σ²C²), which BandMF's is "
            "not, so the step is refused rather than judged against the wrong model (num_bands=1 is DP-SGD)")


def _run_jax_privacy(loss: Callable[..., Any], params: Any, args: tuple[Any, ...], *, l2_clip_norm: float,
                     noise_multiplier: float, normalize_by: float, rescale_to_unit_norm: bool,
                     microbatch_size: int | None, is_padding_example: Any, prng_key: int | jax.Array, num_bands: int,
                     batch_argnums: int | tuple[int, ...] = 1,
                     keep_batch_dim: bool = True) -> tuple[Any, Any, np.ndarray, float, float, float]:
    """jax_privacy's `clipped_grad` (norms returned) and `gaussian_privatizer` on `loss(params,
    *args)`, as its own training loop calls them: (its clipped sum divided by its divisor, the
    noisy update, the norms, the divisor, C, σ). The one code path of the linen and the `fun`
    routes."""
    from jax_privacy import clipping, noise_addition  # type: ignore[import-untyped]

    _refuse_correlated_noise(num_bands)
    c = number(l2_clip_norm, "l2_clip_norm", positive=True)
    sigma = number(noise_multiplier, "noise_multiplier", positive=False)
    nb = number(normalize_by, "normalize_by", positive=True)
    grad_fn = clipping.clipped_grad(loss, l2_clip_norm=c, rescale_to_unit_norm=rescale_to_unit_norm,
                                    normalize_by=nb, return_grad_norms=True, microbatch_size=microbatch_size,
                                    batch_argnums=batch_argnums, keep_batch_dim=keep_batch_dim)
    kwargs = {} if is_padding_example is None else {"is_padding_example": jnp.asarray(is_padding_example)}
    summed, aux = grad_fn(params, *args, **kwargs)
    privatizer = noise_addition.gaussian_privatizer(stddev=sigma * grad_fn.sensitivity(), prng_key=prng_key)
    noisy, _ = privatizer.update(summed, privatizer.init(params))
    divisor = nb * (c if rescale_to_unit_norm else 1.0)
    return summed, noisy, np.asarray(aux.grad_norms, dtype=np.float64), divisor, c, sigma


def _padding(is_padding_example: Any) -> np.ndarray | None:
    return None if is_padding_example is None else np.asarray(is_padding_example)


def dp_step(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, *, l2_clip_norm: float,
            noise_multiplier: float = 0.0, normalize_by: float = 1.0, rescale_to_unit_norm: bool = False,
            microbatch_size: int | None = None, is_padding_example: Any = None, prng_key: int | jax.Array = 0,
            num_bands: int = 1) -> JaxPrivacyStep:
    """Runs jax_privacy's clipped gradient and Gaussian privatizer on `inputs` and returns the
    claims. `per_example_loss(apply, batch)` is the same callable the exporter takes; jax_privacy
    calls it on batches of one example (vmapped, in `microbatch_size` groups)."""

    def summed_loss(p: Any, batch: Any) -> jax.Array:
        def apply(*args: Any, **kwargs: Any) -> Any:
            return model.apply({"params": p}, *args, **kwargs)

        return jnp.sum(per_example_loss(apply, batch))

    summed, noisy, norms, divisor, c, sigma = _run_jax_privacy(
        summed_loss, params, (inputs,), l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier,
        normalize_by=normalize_by, rescale_to_unit_norm=rescale_to_unit_norm, microbatch_size=microbatch_size,
        is_padding_example=is_padding_example, prng_key=prng_key, num_bands=num_bands)
    clipped_sum = {k: np.asarray(v) * np.asarray(divisor, dtype=np.asarray(v).dtype)
                   for k, v in flat_params(summed, "clipped sum").items()}
    update = {k: np.asarray(v) for k, v in flat_params(noisy, "update").items()}
    return JaxPrivacyStep(claimed_norms=norms, clipped_sum=clipped_sum, update=update, batch_divisor=divisor,
                          max_grad_norm=c, noise_multiplier=sigma, is_padding_example=_padding(is_padding_example))


def _fun_args(batch: Any, batch_argnums: int | tuple[int, ...]) -> tuple[Any, ...]:
    """fun's arguments after params, as `clipped_grad` is called with them: `batch` itself for
    `batch_argnums=1`, the tuple of fun's arguments 1.. for a tuple of positions."""
    if isinstance(batch_argnums, bool) or not isinstance(batch_argnums, int | tuple) or (
            isinstance(batch_argnums, tuple) and not all(isinstance(a, int) and not isinstance(a, bool)
                                                          for a in batch_argnums)):
        raise TypeError(f"batch_argnums must be an int or a tuple of ints, got {batch_argnums!r}")
    if isinstance(batch_argnums, int):
        if batch_argnums != 1:
            raise ValueError(f"batch_argnums={batch_argnums}: an int names fun's argument 1, the batch; give "
                             "fun's arguments 1.. as a tuple `batch` and their batched positions as a tuple")
        return (batch,)
    if not isinstance(batch, tuple):
        raise TypeError(f"batch_argnums={batch_argnums!r} (a tuple): batch must be the tuple of fun's arguments "
                        f"1.., got {type(batch).__name__}")
    if not batch_argnums or min(batch_argnums) < 1 or max(batch_argnums) > len(batch):
        raise ValueError(f"batch_argnums={batch_argnums!r}: positions must lie in 1..{len(batch)} (fun's "
                         f"arguments after params, {len(batch)} given in batch)")
    return batch


def fun_step(fun: Callable[..., Any], params: Any, batch: Any, *, l2_clip_norm: float, noise_multiplier: float = 0.0,
             normalize_by: float = 1.0, key: int | jax.Array = 0, batch_argnums: int | tuple[int, ...] = 1,
             keep_batch_dim: bool = True, rescale_to_unit_norm: bool = False, microbatch_size: int | None = None,
             is_padding_example: Any = None, num_bands: int = 1) -> JaxPrivacyStep:
    """Runs jax_privacy's `clipped_grad` and `gaussian_privatizer` on `fun(params, batch)`, the
    function it clips (the loss of the examples in `batch`, B first; `batch_argnums` and
    `keep_batch_dim` as `clipped_grad` reads them), and returns the claims. The clipped sum and
    the update are pytrees shaped like `params`."""
    args = _fun_args(batch, batch_argnums)
    summed, noisy, norms, divisor, c, sigma = _run_jax_privacy(
        fun, params, args, l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier, normalize_by=normalize_by,
        rescale_to_unit_norm=rescale_to_unit_norm, microbatch_size=microbatch_size,
        is_padding_example=is_padding_example, prng_key=key, num_bands=num_bands, batch_argnums=batch_argnums,
        keep_batch_dim=keep_batch_dim)
    clipped_sum = jax.tree_util.tree_map(
        lambda v: np.asarray(v) * np.asarray(divisor, dtype=np.asarray(v).dtype), summed)
    update = jax.tree_util.tree_map(np.asarray, noisy)
    return JaxPrivacyStep(claimed_norms=norms, clipped_sum=clipped_sum, update=update, batch_divisor=divisor,
                          max_grad_norm=c, noise_multiplier=sigma, is_padding_example=_padding(is_padding_example))


def assert_step(fun: Callable[..., Any], params: Any, batch: Any, *, l2_clip_norm: float, noise_multiplier: float,
                normalize_by: float, key: int | jax.Array, batch_argnums: int | tuple[int, ...] = 1,
                keep_batch_dim: bool = True, rescale_to_unit_norm: bool = False, microbatch_size: int | None = None,
                is_padding_example: Any = None, num_bands: int = 1, **run: Unpack[GateRun]) -> Report:
    """Runs jax_privacy's step on `fun(params, batch)` (`fun_step`: its `clipped_grad` with the
    norms returned, and its `gaussian_privatizer` keyed by `key`) and asserts its norms, its
    clipped sum and its noisy update through `ghost_oracle.jax.assert_update` on that same
    function. `run`: the gates' keyword arguments (`precision`, `trace_path`, ...). Raises
    `ClippingCheckFailed` otherwise."""
    __tracebackhide__ = True
    step = fun_step(fun, params, batch, l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier,
                    normalize_by=normalize_by, key=key, batch_argnums=batch_argnums, keep_batch_dim=keep_batch_dim,
                    rescale_to_unit_norm=rescale_to_unit_norm, microbatch_size=microbatch_size,
                    is_padding_example=is_padding_example, num_bands=num_bands)
    return _assert_update(fun, params, batch, step.update, clipped_sum=step.clipped_sum,
                          claimed_norms=step.claimed_norms, max_grad_norm=step.max_grad_norm,
                          noise_multiplier=step.noise_multiplier, batch_divisor=step.batch_divisor,
                          clipper="jax_privacy", batch_argnums=batch_argnums, keep_batch_dim=keep_batch_dim,
                          is_padding_example=is_padding_example, **run)


def assert_norms(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, *,
                 l2_clip_norm: float, noise_multiplier: float = 1.0, microbatch_size: int | None = None,
                 is_padding_example: Any = None, precision: Precision | None = None,
                 trace_path: str | os.PathLike[str] | None = None) -> Report:
    """Asserts that jax_privacy's per-example norms (`clipped_grad(..., return_grad_norms=True)`)
    on `inputs` are the true ones. Raises `ClippingCheckFailed` otherwise."""
    __tracebackhide__ = True
    step = dp_step(model, params, per_example_loss, inputs, l2_clip_norm=l2_clip_norm,
                   microbatch_size=microbatch_size, is_padding_example=is_padding_example)
    return _assert_norms(model, params, per_example_loss, inputs, step.claimed_norms, max_grad_norm=l2_clip_norm,
                         noise_multiplier=noise_multiplier, clipper="jax_privacy", precision=precision,
                         trace_path=trace_path, is_padding_example=is_padding_example)


def assert_update(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, *,
                  l2_clip_norm: float, noise_multiplier: float, normalize_by: float = 1.0,
                  rescale_to_unit_norm: bool = False, microbatch_size: int | None = None,
                  is_padding_example: Any = None, prng_key: int | jax.Array = 0, num_bands: int = 1,
                  precision: Precision | None = None, trace_path: str | os.PathLike[str] | None = None) -> Report:
    """Runs jax_privacy's step and asserts its norms, clipped sum and noisy update. Raises
    `ClippingCheckFailed` otherwise."""
    __tracebackhide__ = True
    step = dp_step(model, params, per_example_loss, inputs, l2_clip_norm=l2_clip_norm,
                   noise_multiplier=noise_multiplier, normalize_by=normalize_by,
                   rescale_to_unit_norm=rescale_to_unit_norm, microbatch_size=microbatch_size,
                   is_padding_example=is_padding_example, prng_key=prng_key, num_bands=num_bands)
    return _assert_update(model, params, per_example_loss, inputs, step.update, clipped_sum=step.clipped_sum,
                          claimed_norms=step.claimed_norms, max_grad_norm=step.max_grad_norm,
                          noise_multiplier=step.noise_multiplier, batch_divisor=step.batch_divisor,
                          clipper="jax_privacy", precision=precision, trace_path=trace_path,
                          is_padding_example=is_padding_example)


# -- shadow mode for jax_privacy: every call of a function `clipped_grad` returned, judged --------
_shadow_lock = threading.RLock()
_sessions: list[ClippedGradShadow] = []
#: (module, attribute, the original) for each place the patch replaced `clipped_grad`
_patched: list[tuple[Any, str, Any]] = []
_judging = threading.local()


class ClippedGradShadow:
    """`with ghost_oracle.jax_privacy.shadow(...) as session:` — see `shadow`."""

    def __init__(self, *, on_failure: OnFailure = "raise", report: str | os.PathLike[str] | None = None,
                 every: int = 1) -> None:
        if on_failure not in ("raise", "warn", "record"):
            raise ValueError(f"on_failure must be 'raise', 'warn' or 'record', got {on_failure!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer (judge one call in every), got {every!r}")
        self.on_failure: OnFailure = on_failure
        self.every = every
        self.outcomes: list[Outcome] = []
        self.summary = Summary()
        self._calls = 0
        self._report_path = report
        self._report: JsonlReport | None = None

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]

    def __enter__(self) -> ClippedGradShadow:
        if self._report_path is not None:
            self._report = JsonlReport(self._report_path)
        with _shadow_lock:
            if not _sessions:
                _install()
            _sessions.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with _shadow_lock:
            if self in _sessions:
                _sessions.remove(self)
            if not _sessions:
                _uninstall()
        if self._report is not None:
            self._report.close()
            self._report = None

    def _judge(self, fun: Callable[..., Any], settings: dict[str, Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], out: Any) -> None:
        """Judges one call of a clipped-gradient function: `args`/`kwargs` as the caller gave them,
        `out` what jax_privacy returned, `settings` the arguments `clipped_grad` was given."""
        o = Outcome(test=None, call=self._calls, library="jax_privacy", mode="clipped_grad",
                    module=getattr(fun, "__qualname__", type(fun).__name__), outcome="skipped")
        self._calls += 1
        t0 = time.perf_counter()
        why = _not_judged(settings, args, kwargs)
        if o.call % self.every != 0:
            o.message = f"every={self.every}: not this call"
        elif why is not None:
            o.outcome, o.message = why
        else:
            _judging.active = True
            try:
                _judge_call(o, fun, settings, args, kwargs, out)
            finally:
                _judging.active = False
        o.seconds = time.perf_counter() - t0
        self.outcomes.append(o)
        self.summary.add(o)
        if self._report is not None:
            self._report.write(o)
        if o.failed:
            if self.on_failure == "raise":
                raise ShadowCheckFailed(o)
            if self.on_failure == "warn":
                warnings.warn(describe(o) + "\n" + (o.explanation or ""), stacklevel=4)


def shadow(*, on_failure: OnFailure = "raise", report: str | os.PathLike[str] | None = None,
           every: int = 1) -> ClippedGradShadow:
    """A context manager under which every call of a function that jax_privacy's
    `clipped_grad` returned (created while it is active) is judged: the norms it returns
    (`return_grad_norms=True`) against the true ones, and its clipped sum (Σ_i c_i g_i divided by
    `normalize_by`, and by C with `rescale_to_unit_norm`) against the oracle's, through the
    program route on the very function it clips. `jax_privacy.clipping.clipped_grad` and
    `jax_privacy.clipped_grad` are patched on entry and restored on exit, also when the block
    raises (a name bound by `from jax_privacy.clipping import clipped_grad` before entering is
    not patched).

    Args:
        on_failure: "raise": the call judged wrong raises `ghost_oracle.ShadowCheckFailed`;
            "warn": a warning; "record": nothing (read `session.outcomes` / `session.failures`).
        report: a path: one JSON line per call seen, as `ghost_oracle.shadow`'s report.
        every: judge one call in `every` (the others are recorded as skipped).

    Not judged, with the reason recorded: a call under a JAX transformation (`jax.jit`, ...:
    its values are abstract there), gradients with respect to another argument than 0, a
    `prng_argnum`, a `pre_clipping_transform`, an infinite `l2_clip_norm` (refused or skipped).
    `session.summary.lines()` is the tally, as shadow mode prints it."""
    return ClippedGradShadow(on_failure=on_failure, report=report, every=every)


def _current() -> ClippedGradShadow | None:
    if getattr(_judging, "active", False):
        return None
    with _shadow_lock:
        return _sessions[-1] if _sessions else None


def _install() -> None:
    import jax_privacy
    from jax_privacy import clipping

    original = clipping.clipped_grad
    signature = inspect.signature(original)

    @functools.wraps(original)
    def clipped_grad(*args: Any, **kwargs: Any) -> Any:
        bound = original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        settings = dict(call.arguments)
        settings["pre_clipping_transform_given"] = "pre_clipping_transform" in call.arguments and (
            call.arguments["pre_clipping_transform"] is not signature.parameters["pre_clipping_transform"].default)
        fun = settings["fun"]

        def judged(*a: Any, **kw: Any) -> Any:
            out = bound(*a, **kw)
            session = _current()
            if session is not None:
                session._judge(fun, settings, a, kw, out)
            return out

        if dataclasses.is_dataclass(bound) and not isinstance(bound, type):  # keeps .sensitivity()
            return dataclasses.replace(bound, fun=judged)
        return judged

    for module in (clipping, jax_privacy):
        if getattr(module, "clipped_grad", None) is original:
            _patched.append((module, "clipped_grad", original))
            module.clipped_grad = clipped_grad


def _uninstall() -> None:
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)


def _not_judged(settings: dict[str, Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[OutcomeKind, str] | None:
    if settings.get("argnums", 0) != 0:
        return "refused", (f"argnums={settings['argnums']!r}: the oracle judges the gradient with respect to "
                           "argument 0, the params")
    if settings.get("prng_argnum") is not None:
        return "refused", f"prng_argnum={settings['prng_argnum']}: a loss drawn per example is not one program"
    if settings.get("pre_clipping_transform_given"):
        return "refused", "pre_clipping_transform: the gradient clipped is not the loss's gradient"
    if not np.isfinite(float(settings["l2_clip_norm"])):
        return "skipped", "l2_clip_norm=inf: nothing is clipped"
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
        return "skipped", "called under a JAX transformation (jax.jit, jax.vmap, ...): its values are abstract there"
    if len(args) < 2:
        return "refused", f"called with {len(args)} positional argument(s): params and the batch are needed"
    return None


def _judge_call(o: Outcome, fun: Callable[..., Any], settings: dict[str, Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], out: Any) -> None:
    from ._failure import ClippingCheckFailed
    from ._trace.format import TraceExportError

    batch_argnums = settings["batch_argnums"]
    if isinstance(batch_argnums, int) and batch_argnums == 1 and len(args) == 2:
        positions: int | tuple[int, ...] = 1
        batch: Any = args[1]
    else:  # fun's arguments 1.., the listed ones batched
        positions = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
        batch = tuple(args[1:])
    first = jax.tree_util.tree_leaves(args[positions if isinstance(positions, int) else positions[0]])
    o.batch_size = int(first[0].shape[0]) if first and np.ndim(first[0]) else 0
    with_aux = settings["has_aux"] or settings["return_values"] or settings["return_grad_norms"]
    grads = out[0] if with_aux else out
    norms = (np.asarray(out[1].grad_norms, dtype=np.float64) if settings["return_grad_norms"] else None)
    c = float(settings["l2_clip_norm"])
    divisor = float(settings["normalize_by"]) * (c if settings["rescale_to_unit_norm"] else 1.0)
    update = jax.tree_util.tree_map(np.asarray, grads)
    clipped_sum = jax.tree_util.tree_map(lambda v: v * np.asarray(divisor, dtype=v.dtype), update)
    loss = (lambda *a: fun(*a)[0]) if settings["has_aux"] else fun
    try:
        with warnings.catch_warnings():  # σ 0 is what clipped_grad computes: no noise is added yet
            warnings.filterwarnings("ignore", message="noise_multiplier 0")
            report = _assert_update(loss, args[0], batch, update, clipped_sum=clipped_sum, claimed_norms=norms,
                                    max_grad_norm=c, noise_multiplier=0.0, batch_divisor=divisor,
                                    clipper="jax_privacy", batch_argnums=positions,
                                    keep_batch_dim=bool(settings["keep_batch_dim"]),
                                    is_padding_example=kwargs.get("is_padding_example"))
    except ClippingCheckFailed as e:
        report = e.report
    except TraceExportError as e:
        o.outcome, o.message = "refused", str(e)
        return
    except (ValueError, TypeError, NotImplementedError) as e:
        o.outcome, o.message = "refused", f"the program route could not trace it: {type(e).__name__}: {e}"
        return
    o.outcome, o.verdict, o.report = "judged", str(report.verdict), report
    if norms is not None:
        true = np.asarray(report.true_norms, dtype=np.float64)
        o.max_rel_err = float(np.max(np.abs(norms - true) / np.where(true > 0, true, np.inf))) if len(true) else 0.0
    if o.failed:
        o.explanation = report.explain()
