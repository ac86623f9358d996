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

`dp_step` and `fun_step` run jax_privacy itself (one code path, `_run_jax_privacy`): `clipping.clipped_grad(..., return_grad_norms=True)` gives
the claimed norms and the clipped sum, and `noise_addition.gaussian_privatizer` (stddev σ times
the clipped function's sensitivity, as jax_privacy's own training loop sets it) the noisy update.
jax_privacy returns the clipped sum divided by `normalize_by` (and by C with
`rescale_to_unit_norm`): the oracle's clipped sum is that times the divisor, and the divisor D in
u = (Σ c_i g_i + σ C ξ) / D is `normalize_by` (times C). Padding examples
(`is_padding_example`) are left out of the trace, as jax_privacy leaves them out of the sum.

Correlated noise (BandMF, `num_bands > 1`, any `matrix_factorization_privatizer` other than the
identity) adds noise that depends on earlier steps; the oracle's step test models i.i.d. noise
per step, so it is refused by name rather than judged against the wrong model.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
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

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["JaxPrivacyStep", "assert_norms", "assert_step", "assert_update", "dp_step", "fun_step"]


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
    padding = {} if is_padding_example is None else {"is_padding_example": is_padding_example}
    return _assert_update(fun, params, batch, step.update, clipped_sum=step.clipped_sum,
                          claimed_norms=step.claimed_norms, max_grad_norm=step.max_grad_norm,
                          noise_multiplier=step.noise_multiplier, batch_divisor=step.batch_divisor,
                          clipper="jax_privacy", batch_argnums=batch_argnums, keep_batch_dim=keep_batch_dim,
                          **padding, **run)


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
