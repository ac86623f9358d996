"""The parts of writing a trace file (docs/trace-format.md) that do not depend on the framework
the model lives in: the format's name, the exporters' error type, the placeholder for unclaimed
norms, the checks of the header's numbers and the header's keys. The PyTorch exporter
(`ghost_oracle.torch`) and the JAX one (`ghost_oracle.jax`) both build their `__metadata__`
here and write it through `writer.py`, so the two write the same keys in the same spelling."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .site import PRECISIONS

FORMAT = "ghost-oracle-trace/1"
#: The format of a trace with a convolution stored as its input and geometry (a site's `conv`
#: entry); every other trace is written as `FORMAT`, byte for byte as before it.
FORMAT_CONV_INPUTS = "ghost-oracle-trace/2"
#: The format of a trace where a site's backprops are another site's tensor (a site's
#: `backprops_of` entry); it may also hold convolutions stored as their input.
FORMAT_SHARED = "ghost-oracle-trace/3"


def format_of(sites: Sequence[Mapping[str, Any]]) -> str:
    """The header's `format` for these site entries: the oldest that holds them, /3 where any
    carries `backprops_of`, else /2 where any carries `conv`, else /1 (so that a trace that needs
    neither is byte for byte what it was, and reads in every version)."""
    if any("backprops_of" in s for s in sites):
        return FORMAT_SHARED
    return FORMAT_CONV_INPUTS if any("conv" in s for s in sites) else FORMAT

# Names of the precisions a trace records, finest first.
PRECISION_NAMES = PRECISIONS

CLIPPING_RULES = ("flat", "automatic")

# How a trace's `model.rounding` (each example's rounding of its traced gradient, absolute) was
# measured: the model replayed in float64 (the difference is the traced gradient's own rounding),
# or a float64 model replayed in float32 (the difference times u64/u32 = 2⁻²⁹ estimates
# float64's own).
# "+random-rounding": the largest of that and of replays in random rounding at the trace's
# precision (ghost_oracle/torch/rounding.py).
MODEL_ROUNDING = ("replay-float64", "replay-float32-scaled", "replay-float64+random-rounding",
                  "replay-float32-scaled+random-rounding")


class _Unclaimed:
    """The type of `UNCLAIMED`: one object, named in reprs."""

    def __repr__(self) -> str:
        return "UNCLAIMED"


#: `claimed_norms=UNCLAIMED` writes norms of 1, for a caller that replaces them once the check
#: has computed the true ones (the gates do, to judge a step alone). One object for both
#: exporters: `ghost_oracle.torch.UNCLAIMED is ghost_oracle.jax.UNCLAIMED`.
UNCLAIMED: Any = _Unclaimed()


class TraceExportError(ValueError):
    """The model cannot be traced faithfully: a parameter without a site, a site whose factors
    do not rebuild autograd's gradient, a module used in a way the exporter does not model, a
    model that mixes examples."""


def number(value: Any, what: str, *, positive: bool) -> float:
    """`value` as a finite float, ≥ 0 (> 0 with `positive`), or a ValueError naming `what`."""
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number, got {value!r}") from e
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} number, got {value}")
    return v


def step_rule(*, batch_divisor: Any, clip_stabilizer: Any, clipping: str, has_update: bool,
              divisor_is: str) -> tuple[float | None, float]:
    """The step's header numbers checked as the reader checks them: (D or None, γ). `update`
    needs D (`divisor_is` says what the library's D is); automatic clipping C/(n + γ) needs
    γ > 0, unbounded for a zero gradient otherwise."""
    divisor = None if batch_divisor is None else number(batch_divisor, "batch_divisor", positive=True)
    if divisor is None and has_update:
        raise ValueError(f"update needs batch_divisor: the number the library divides the noisy sum by ({divisor_is})")
    gamma = number(clip_stabilizer, "clip_stabilizer", positive=False)
    if clipping not in ("flat", "automatic"):
        raise ValueError(f"clipping must be \"flat\" (c = min(1, C/(n + γ))) or \"automatic\" (c = C/(n + γ)), "
                         f"got {clipping!r}")
    if clipping == "automatic" and gamma == 0.0:
        raise ValueError("clipping \"automatic\" (c = C/(n + γ)) needs γ > 0 (clip_stabilizer), got 0")
    return divisor, gamma


def trace_metadata(
    *,
    max_grad_norm: float,
    clipper: str,
    sites: Sequence[Mapping[str, Any]],
    compute_dtype: str,
    parameters: Mapping[str, int],
    noise_multiplier: float | None = None,
    batch_divisor: float | None = None,
    clip_stabilizer: float = 0.0,
    clipping: str = "flat",
    has_step: bool = False,
    model_rounding: str | None = None,
) -> dict[str, str]:
    """The trace's `__metadata__`: every value a string, the optional step keys written where a
    step is claimed or they differ from their defaults (a reader then needs no default of its
    own to agree with the writer). `model_rounding` says how the trace's `model.rounding` was
    measured (one of `MODEL_ROUNDING`), written with that tensor only."""
    if compute_dtype not in PRECISION_NAMES:
        raise ValueError(f"compute_dtype must be one of {list(PRECISION_NAMES)}, got {compute_dtype!r}")
    if clipping not in CLIPPING_RULES:
        raise ValueError(f"clipping must be \"flat\" (c = min(1, C/(n + γ))) or \"automatic\" (c = C/(n + γ)), "
                         f"got {clipping!r}")
    if model_rounding is not None and model_rounding not in MODEL_ROUNDING:
        raise ValueError(f"model_rounding must be one of {list(MODEL_ROUNDING)}, got {model_rounding!r}")
    meta = {"format": format_of(sites), "max_grad_norm": repr(float(max_grad_norm)), "clipper": str(clipper),
            "sites": json.dumps([dict(s) for s in sites]), "compute_dtype": compute_dtype,
            "parameters": json.dumps(dict(parameters))}
    if noise_multiplier is not None:
        meta["noise_multiplier"] = repr(float(noise_multiplier))
    if batch_divisor is not None:
        meta["batch_divisor"] = repr(float(batch_divisor))
    if has_step or clip_stabilizer != 0.0:
        meta["clip_stabilizer"] = repr(float(clip_stabilizer))
    if has_step or clipping != "flat":
        meta["clipping"] = clipping
    if model_rounding is not None:
        meta["model_rounding"] = model_rounding
    return meta
