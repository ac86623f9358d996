"""`nn.Conv`: a linear map over unfolded patches, one row per output position, a `conv1d` site
(in×out) whose `in` is the patch in `conv_general_dilated_patches`' order (channel first, then
the window), so the kernel (window…, C_in, C_out) is permuted to (C_in, window…, C_out)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._trace.format import TraceExportError
from ..sites import Call, Site, grad_of, precision_of, rows


class Conv:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["inputs"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        m = call.module
        kernel = call.params["kernel"]
        window = tuple(kernel.shape[:-2])
        c_in, c_out = kernel.shape[-2:]
        nd = len(window)
        if getattr(m, "feature_group_count", 1) != 1:
            raise TraceExportError(f"{call.where}: a grouped convolution (feature_group_count > 1) is not modelled")
        padding = m.padding
        if isinstance(padding, str):
            if padding.upper() not in ("SAME", "VALID"):
                raise TraceExportError(f"{call.where}: padding {padding!r} is not modelled (SAME, VALID or explicit)")
        elif isinstance(padding, int):
            padding = [(padding, padding)] * nd
        else:
            padding = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]

        def per_axis(v: Any) -> tuple[int, ...]:
            if v is None:
                return (1,) * nd
            return (v,) * nd if isinstance(v, int) else tuple(v)

        x = jnp.asarray(call.args[0]).astype(call.out_dtype)
        if x.ndim != nd + 2:
            raise TraceExportError(f"{call.where}: input of shape {list(x.shape)}; expected batch, {nd} spatial "
                                   "axes and channels")
        spatial = "".join("HWD"[i] for i in range(nd))
        patches = jax.lax.conv_general_dilated_patches(
            x, window, per_axis(m.strides), padding, lhs_dilation=per_axis(m.input_dilation),
            rhs_dilation=per_axis(m.kernel_dilation),
            dimension_numbers=(f"N{spatial}C", f"{spatial}IO", f"N{spatial}C"))
        width = c_in * int(np.prod(window))
        perm = [nd, *range(nd), nd + 1]
        shape = tuple(kernel.shape)

        def to_layout(a: np.ndarray) -> np.ndarray:
            return np.transpose(a.reshape(shape), perm).reshape(-1)

        dy = grad_of(call)
        precision = precision_of(call.out_dtype, call.where)
        out = [Site("conv1d", call.param("kernel"),
                    {"activations": rows(np.asarray(patches), batch, width, "unfolded input", call),
                     "backprops": rows(dy, batch, c_out, "output gradient", call)}, precision, call,
                    to_trace_layout=to_layout, layout_name="conv-patches")]
        if "bias" in call.params:
            out.append(Site("bias", call.param("bias"), {"backprops": rows(dy, batch, c_out, "output gradient", call)},
                            precision, call))
        return out
