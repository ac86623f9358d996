"""Type stubs of the compiled core (`python/src/lib.rs`). Use the wrappers in `ghost_oracle`:
these functions return plain dicts that `ghost_oracle.Report` reads: `json` (the CLI's `--json`
document), `table` (its table), `explanation` (the deciding case in words) and the clippers'
audits. `check`'s also has the trace header's `tied` parameters (each `param` with its `sites`,
(name, kind) pairs) and its step's `batch_divisor` (None where it states none). In `check`'s, a
case whose trace carries a step has a `step` dict (`StepMetrics` of `src/judge/step/mod.rs`:
`true_coefficients`, `clipped_sum` and `update` (each a `SumCheck` dict or None), `noise` (a list
of `NoiseCheck` dicts, each with its `scope`: `{"tensor": name}` or `"whole"`), `noisy_update` (a
`NoisyUpdateCheck` dict or None), `update_not_judged`, `noise_fraction`, `verdict`), read by
`ghost_oracle.StepResult`; None without one."""
from typing import Any

__version__: str
BUILTIN_CLIPPERS: list[str]
VERDICTS: list[str]

def check(
    trace: str,
    *,
    noise_multiplier: float | None = None,
    precision: str | None = None,
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
    max_memory: str | None = None,
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
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
) -> dict[str, Any]: ...
def mutants(
    *,
    precision: str = "f32",
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
) -> dict[str, Any]: ...
def mutant_list() -> list[tuple[str, str]]: ...
def _panic_for_tests() -> None: ...
