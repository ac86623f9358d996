"""Type stubs of the compiled core (`python/src/lib.rs`). Use the wrappers in `ghost_oracle`:
these functions return plain dicts that `ghost_oracle.Report` reads: `json` (the CLI's `--json`
document), `table` (its table), `explanation` (the deciding case in words) and the clippers'
audits. `check`'s also has the trace header's `tied` parameters (each `param` with its `sites`,
(name, kind) pairs) and its step's `batch_divisor` (None where it states none). In `check`'s, a
case whose trace carries a step has a `step` dict (`StepMetrics` of `src/judge/step/mod.rs`:
`true_coefficients`, `clipped_sum` and `update` (each a `SumCheck` dict or None), `noise` (a list
of `NoiseCheck` dicts, each with its `scope`: `{"tensor": name}` or `"whole"`), `noisy_update` (a
`NoisyUpdateCheck` dict or None), `update_not_judged`, `noise_fraction`, `verdict`), read by
`ghost_oracle.StepResult`; None without one. `mutants`'s also has `ok`, `cases` (the base cases)
and `rows`: the kill matrix's rows of its JSON document (`clipper`, `mutant`, `reproduces`,
`caught`, `ok`, `invisible_at_precision`, `problems`, `cases`)."""
from typing import Any

from typing_extensions import TypedDict, Unpack

class _Accounting(TypedDict, total=False):
    """The run the ε speaks of, an argument of every function (None: its default)."""

    sampling_rate: float | None
    steps: int | None
    epochs: float | None
    dataset_size: int | None
    delta: float | None

__version__: str
BUILTIN_CLIPPERS: list[str]
VERDICTS: list[str]

def check(
    trace: str,
    *,
    noise_multiplier: float | None = None,
    precision: str | None = None,
    max_memory: str | None = None,
    **accounting: Unpack[_Accounting],
) -> dict[str, Any]: ...
def audit(
    *,
    model: str | None = None,
    batch: str | None = None,
    clippers: list[str] | None = None,
    max_grad_norm: float | None = None,
    noise_multiplier: float = 1.0,
    precision: str = "f32",
    reduction: str = "mean",
    **accounting: Unpack[_Accounting],
) -> dict[str, Any]: ...
def mutants(
    *,
    precision: str = "f32",
    **accounting: Unpack[_Accounting],
) -> dict[str, Any]: ...
def mutant_list() -> list[tuple[str, str]]: ...
def _panic_for_tests() -> None: ...
