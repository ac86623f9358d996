"""The self-check of a JAX trace: nothing is written unless every parameter that received a
nonzero gradient is accounted for by its sites, and the batch gradient rebuilt from their
factors (as stored) equals `jax.grad`'s to rounding, each site at its own precision. The
rebuild, its blocks and sketch, and the tolerance are the check both exporters share
(`ghost_oracle._trace.check`); this says which parameters must have sites and hands the check
each one's sites and gradient, in the layout its sites write."""
from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import ml_dtypes
import numpy as np

from .._trace.check import Against, check_parameter
from .._trace.format import TraceExportError
from .._trace.site import Precision
from .kinds import modelled_classes
from .sites import Site, precision_of, raw_bits

STORAGE = {"f64": np.dtype(np.float64), "f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
           "bf16": np.dtype(ml_dtypes.bfloat16)}

JAX_GRAD = Against("jax.grad", "The module's method is not what the exporter models (a subclass, a scale or cast "
                               "inside it)")


def self_check(sites: Sequence[Site], grads: dict[str, np.ndarray], store: str | None) -> list[str]:
    """Raises unless every parameter with a nonzero gradient has sites whose factors rebuild it.
    Returns the parameters left out (exactly zero gradient and no site: not used by the loss)."""
    by_param: dict[str, list[Site]] = {}
    for s in sites:
        by_param.setdefault(s.param, []).append(s)
    unused = []
    for name, grad in grads.items():
        grad = np.asarray(grad)
        uses = by_param.get(name)
        if not uses:
            if np.any(grad != 0):
                raise TraceExportError(
                    f"parameter `{name}` received a gradient but has no site: the exporter models the module methods "
                    f"its kinds know by exact class ({modelled_classes()}); this parameter was used some other way "
                    "(read with self.param inside another module, a subclass)")
            unused.append(name)
            continue
        layouts = {s.layout_name for s in uses}
        if len(layouts) > 1:
            raise TraceExportError(f"parameter `{name}` is used by sites that flatten it differently "
                                   f"({', '.join(sorted(layouts))}); one parameter must have one layout")
        # `store` is one of the trace's precisions (export_trace checked it against PRECISION_NAMES)
        check_parameter(f"parameter `{name}`", [s.handover() for s in uses], raw_bits(uses[0].to_trace_layout(grad)),
                        cast(Precision, precision_of(grad.dtype, f"parameter `{name}`'s gradient")),
                        cast(Precision | None, store), JAX_GRAD)
    return unused
