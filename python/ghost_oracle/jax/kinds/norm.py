"""Norms over the last axis (`nn.LayerNorm`, `nn.RMSNorm`, the `gemma` package's `RMSNorm` with
its x̂ ⊙ (1 + scale)): the scale's gradient per example is Σ_r δ_r ⊙ x̂_r, a `layernorm` site;
the bias a `bias` site. x̂ is not rebuilt from a formula but replayed: the derivative of the
module's own output along its scale (a jvp with tangent 1), which is x̂ whatever the module
multiplies by (scale or 1 + scale) and in the precision it computed in. A norm applied per head
(B×T×H×k, one weight of k entries) has T·H rows."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._trace.format import TraceExportError
from ..sites import Call, Site, grad_of, precision_of, rows


class LastAxisNorm:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["x"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        m = call.module
        feature_axes = getattr(m, "feature_axes", -1)
        reduction_axes = getattr(m, "reduction_axes", -1)
        if feature_axes not in (-1, (-1,)) or reduction_axes not in (-1, (-1,)):
            raise TraceExportError(f"{call.where}: a norm over axes {reduction_axes} with features on {feature_axes}; "
                                   "the exporter models norms over the last axis")
        x = jnp.asarray(call.args[0])
        dy = grad_of(call)
        precision = precision_of(call.out_dtype, call.where)
        params = {k: jnp.asarray(v) for k, v in call.params.items()}
        out: list[Site] = []
        if "scale" in params:
            k = params["scale"].size

            def with_scale(s: jax.Array) -> jax.Array:
                y: jax.Array = m.apply({"params": {**params, "scale": s}}, x)
                return y

            _, x_hat = jax.jvp(with_scale, (params["scale"],), (jnp.ones_like(params["scale"]),))
            out.append(Site("layernorm", call.param("scale"),
                            {"activations": rows(np.asarray(x_hat), batch, k, "normalized input", call),
                             "backprops": rows(dy, batch, k, "output gradient", call)}, precision, call))
        if "bias" in params:
            k = params["bias"].size
            out.append(Site("bias", call.param("bias"), {"backprops": rows(dy, batch, k, "output gradient", call)},
                            precision, call))
        return out
