"""`nn.Dense`: y = x K + b with K in×out, the layout of the trace's `conv1d` kind (y = a W), so
the kernel is written as it is stored."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..sites import Call, Site, grad_of, precision_of, rows


class Dense:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["inputs"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        kernel = call.params["kernel"]
        n_in, n_out = kernel.shape
        dy = grad_of(call)
        precision = precision_of(call.out_dtype, call.where)
        x = np.asarray(call.args[0]).astype(call.out_dtype)  # as the matmul saw it
        out = [Site("conv1d", call.param("kernel"), {"activations": rows(x, batch, n_in, "input", call),
                                                    "backprops": rows(dy, batch, n_out, "output gradient", call)},
                    precision, call)]
        if "bias" in call.params:
            out.append(Site("bias", call.param("bias"), {"backprops": rows(dy, batch, n_out, "output gradient", call)},
                            precision, call))
        return out
