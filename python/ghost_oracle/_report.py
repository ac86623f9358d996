"""The `Report` that `check`, `audit` and `mutants` return.

Each frozen dataclass here mirrors one document the compiled judge serialises, field for field
under the judge's own names (`CaseResult`: `CaseMetrics` of src/judge/metrics.rs, `StepResult`:
`StepMetrics`, `SumCheck`, `DivisorCheck`, `NoiseCheck`, `NoisyUpdateCheck` of src/judge/step/,
`Privacy`: `PrivacyReport`, `ClipperResult`: `ClipperAudit` with its kill-matrix row). The few
departures are declared below (`EXAMPLE_COLUMNS`, `KILL_MATRIX_ROW`), and
python/tests/test_report_mirror.py holds every class to the keys of real reports, both ways.
Names that were renamed to the judge's keep their old spelling as a deprecated property.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

import numpy as np

from . import _native
from ._deprecated import RenamedAttribute
from ._types import Precision

#: Every verdict, from the least to the most severe (the compiled judge's own list).
VERDICTS: tuple[str, ...] = tuple(_native.VERDICTS)
_SEVERITY = {v: k for k, v in enumerate(VERDICTS)}


def _f(x: Any) -> float:
    """A float; None (an undefined metric, or a NaN or infinite one: JSON has neither) as NaN."""
    return math.nan if x is None else float(x)


def _epsilon(x: Any) -> float:
    """An ε; None (no ε holds, written null in JSON) as +∞."""
    return math.inf if x is None else float(x)


def _array(xs: list[Any], dtype: Any = np.float64) -> np.ndarray:
    a = np.asarray(xs, dtype=dtype)
    a.setflags(write=False)
    return a


def _floats(xs: list[Any]) -> np.ndarray:
    """A read-only float array; an undefined entry (None) is NaN."""
    return _array([_f(x) for x in xs])


_Mirror = TypeVar("_Mirror")


def _optional(read: Callable[[dict[str, Any]], _Mirror], d: dict[str, Any] | None) -> _Mirror | None:
    """A document the judge may leave out (null, or absent): its mirror, or None."""
    return None if d is None else read(d)


class _Judged:
    """A mirror of a document with the judge's `verdict`."""

    verdict: str

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


@dataclass(frozen=True)
class Privacy:
    """Stated and actual (ε, δ) of the DP-SGD run a clipper's worst overshoot belongs to.

    A clipped contribution of s·C (s > 1) at noise σC is the Gaussian mechanism at σ/s, so the
    actual ε is that of σ_eff = σ / max(1, s), accounted with the Rényi DP accountant of
    ghost-oracle over `steps` steps at Poisson sampling rate `sampling_rate`.
    """

    sampling_rate: float
    steps: int
    delta: float
    #: True when no sampling_rate/steps/delta was given: the typical fine-tuning run
    #: (q = 0.01, 1000 steps, δ = 1e-5).
    default_setting: bool
    #: The stated noise multiplier σ.
    noise_multiplier: float
    #: ε at the stated σ; +inf without noise (σ = 0).
    stated_epsilon: float
    #: ε at σ_eff; +inf when a norm was invalid.
    actual_epsilon: float
    #: The largest clipped contribution beyond rounding, in units of C (1 when none exceeds C;
    #: NaN when a norm was invalid).
    worst_contribution: float
    #: σ / max(1, worst contribution) (NaN when a norm was invalid).
    effective_noise_multiplier: float
    #: The σ that would keep the stated ε at that overshoot (NaN when none would).
    sigma_needed: float
    #: The optimal Rényi order of the actual ε, and whether it sits at an end of the grid.
    order: float
    order_at_grid_edge: bool
    #: The report's one-sentence summary, as the CLI prints it.
    sentence: str
    #: Where the numbers come from, as the CLI prints it.
    setting: str
    #: When the verdict is no privacy violation, so that any overshoot above C is within the
    #: clipper's rounding bound: the precision whose rounding spent the extra privacy ("f64",
    #: "f32", "f16" or "bf16"); None after a privacy violation.
    rounding_at: str | None = None

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> Privacy:
        return cls(
            sampling_rate=float(d["sampling_rate"]),
            steps=int(d["steps"]),
            delta=float(d["delta"]),
            default_setting=bool(d["default_setting"]),
            noise_multiplier=float(d["noise_multiplier"]),
            # No ε holds without noise, nor after an invalid norm: +∞.
            stated_epsilon=_epsilon(d["stated_epsilon"]),
            actual_epsilon=_epsilon(d["actual_epsilon"]),
            worst_contribution=_f(d["worst_contribution"]),
            effective_noise_multiplier=_f(d["effective_noise_multiplier"]),
            sigma_needed=_f(d["sigma_needed"]),
            order=float(d["order"]),
            order_at_grid_edge=bool(d["order_at_grid_edge"]),
            sentence=str(d["sentence"]),
            setting=str(d["setting"]),
            rounding_at=None if d.get("rounding_at") is None else str(d["rounding_at"]),
        )


def _opt(x: Any) -> float:
    """An optional figure (None: undefined, e.g. a zero exact sum) as NaN."""
    return _f(x)


@dataclass(frozen=True)
class SumCheck(_Judged):
    """One claimed sum X of the step (the clipped sum K, or the update times its divisor u·D)
    against the exact clipped sum S* = Σ_i c*_i g*_i (docs/tolerances.md, "The step")."""

    #: "clipped sum" or "update × divisor".
    what: str
    #: ‖X − S*‖ / ‖S*‖ and the rounding bound on it (NaN where S* = 0).
    rel_err: float
    bound: float
    #: The parameter whose sum is furthest off, relative to its own ‖S*_p‖, and by how much.
    worst_param: str
    worst_param_rel_err: float
    #: ⟨X, S*⟩ / ‖S*‖²: a wrong divisor scales the whole sum by this.
    scale: float
    #: ĉ = G⁺b (b_i = ⟨g*_i, X⟩), what X implies each example was weighted by (read-only array),
    #: and the largest implied contribution ĉ_i·n*_i / C.
    implied_coefficients: np.ndarray = field(repr=False)
    implied_sensitivity: float = math.nan
    #: ĉ_i plus the most the sum's rounding bound can move it: the high end, for privacy
    #: (read-only array).
    coefficient_high: np.ndarray = field(default_factory=lambda: _array([]), repr=False)
    #: ‖X − Σ ĉ_i g*_i‖ / ‖X‖: the part of X no combination of this batch's gradients explains.
    unexplained: float = math.nan
    #: Examples the sum leaves out: ĉ_i under half of c*_i (empty where the Gram is singular).
    missing_examples: tuple[int, ...] = ()
    #: X is S* times one positive `scale` beyond rounding (for the update: divided by another
    #: divisor than the stated one).
    shared_scale: bool = False
    #: The batch's Gram was singular (ĉ is the minimum-norm solution).
    singular: bool = False
    #: Some value of X is NaN or infinite.
    invalid: bool = False
    verdict: str = "pass"

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> SumCheck:
        return cls(what=str(d["what"]), rel_err=_opt(d["rel_err"]), bound=_opt(d["bound"]),
                   worst_param=str(d["worst_param"]), worst_param_rel_err=_opt(d["worst_param_rel_err"]),
                   scale=_opt(d["scale"]), implied_coefficients=_floats(d["implied_coefficients"]),
                   implied_sensitivity=_f(d["implied_sensitivity"]),
                   coefficient_high=_floats(d["coefficient_high"]), unexplained=_opt(d["unexplained"]),
                   missing_examples=tuple(int(i) for i in d["missing_examples"]),
                   shared_scale=bool(d["shared_scale"]), singular=bool(d["singular"]),
                   invalid=bool(d["invalid"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class NoiseCheck(_Judged):
    """The noise of one parameter tensor `scope` (or of the whole update: `scope` None,
    `whole` True): ‖r‖²/(σC)², χ² with `entries` degrees of freedom for noise N(0, σ²C²) on
    every entry, against its Laurent–Massart interval [low, high]."""

    #: The tensor checked, by name; None for the whole update (the judge's `"whole"`).
    scope: str | None
    entries: int
    chi2: float
    low: float
    high: float
    #: σ̂ / σ = √(χ² / entries): the noise the tensor got, in units of the stated.
    sigma_ratio: float
    verdict: str

    @property
    def whole(self) -> bool:
        """The check is over the whole update, every tensor together."""
        return self.scope is None

    #: Deprecated spelling of `scope`.
    param = RenamedAttribute("scope")

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> NoiseCheck:
        # The scope is {"tensor": name} for one tensor, "whole" for the whole update.
        scope = d["scope"]
        tensor = None if scope == "whole" else str(scope["tensor"])
        return cls(scope=tensor, entries=int(d["entries"]), chi2=_f(d["chi2"]), low=_f(d["low"]),
                   high=_f(d["high"]), sigma_ratio=_f(d["sigma_ratio"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class NoisyUpdateCheck(_Judged):
    """An update under noise without its clipped sum: the coefficients it implies,
    (ĉ − c*)ᵀG(ĉ − c*)/(σC)² against the upper end `high` of χ² on `dof` degrees of freedom,
    and the residual noise outside the batch's gradients (`residual`)."""

    implied_coefficients: np.ndarray = field(repr=False)
    chi2: float = math.nan
    dof: int = 0
    high: float = math.nan
    #: The smallest error of the clipped signal this test can see from one update, as a
    #: fraction of ‖S*‖ (σC·√high / ‖S*‖): a signal error below it passes unseen.
    smallest_visible: float = math.nan
    residual: NoiseCheck | None = None
    verdict: str = "pass"

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> NoisyUpdateCheck:
        return cls(implied_coefficients=_floats(d["implied_coefficients"]), chi2=_f(d["chi2"]),
                   dof=int(d["dof"]), high=_f(d["high"]), smallest_visible=_opt(d["smallest_visible"]),
                   residual=NoiseCheck._from_native(d["residual"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class DivisorCheck:
    """The divisor an update was divided by, read from the update itself: without noise from the
    scale of its signal, under noise from its projection on the clipped sum (or on S*)."""

    #: D as the library states it, and as read from the update.
    stated: float
    implied: float
    #: The relative uncertainty of `implied`: one standard deviation of what the noise adds to
    #: it, or the rounding bound without noise.
    spread: float
    #: The batch's actual size.
    drawn: int
    #: `implied` is off the stated divisor and equals the drawn size: the update's normalization
    #: depends on the data, which the stated σ does not account for.
    data_dependent: bool

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> DivisorCheck:
        return cls(stated=_f(d["stated"]), implied=_f(d["implied"]), spread=_f(d["spread"]),
                   drawn=int(d["drawn"]), data_dependent=bool(d["data_dependent"]))


@dataclass(frozen=True)
class StepResult(_Judged):
    """The judged DP-SGD step of a case (a trace with `claimed.clipped_sum.*` and/or
    `claimed.update.*`; docs/tolerances.md, "The step: the clipped sum and the update").

    - `clipped_sum`: the clipped sum before noise against S* (any σ), or None;
    - `update`: the update times its divisor against S* (σ = 0 only), or None;
    - `noise`: under σ > 0 with the clipped sum, one `NoiseCheck` per parameter tensor and one
      over all of them (`param` None, `whole` True);
    - `noisy_update`: under σ > 0 without the clipped sum, the update judged by the
      coefficients it implies (`NoisyUpdateCheck`), or None;
    - `update_not_judged`: an update under noise that nothing could judge;
    - `noise_fraction`: the least noise any tensor got, as a fraction of the stated σ: 1 where
      every tensor's χ² is consistent with it or above, else the low end √(χ²_p / high_p);
    - `contributions`: per example, √(Σ_p ĉ_i²‖g*_{i,p}‖² / (f_p² C²)), its contribution in
      units of what σ and C allow with each tensor's own noise (read-only array);
    - `sigma_eff`: σ / max(1, max contribution), what the run's ε is computed from;
    - `divisor`: the divisor the update implies (`DivisorCheck`: `stated`, `implied`, `spread`,
      `drawn`, `data_dependent`: it is the batch's drawn size, not the stated one), None where it
      cannot be read;
    - `true_coefficients`: c*_i from the true norms by the trace's clipping rule (read-only array).
    """

    verdict: str
    true_coefficients: np.ndarray = field(repr=False)
    clipped_sum: SumCheck | None = None
    update: SumCheck | None = None
    noise: tuple[NoiseCheck, ...] = ()
    noisy_update: NoisyUpdateCheck | None = None
    update_not_judged: bool = False
    noise_fraction: float = 1.0
    contributions: np.ndarray = field(default_factory=lambda: _array([]), repr=False)
    sigma_eff: float = math.nan
    divisor: DivisorCheck | None = None
    #: D, the divisor the trace states (`batch_divisor`), when the report was read from a trace
    #: file that states one. Not the judge's: the trace header's, which `check` hands over.
    batch_divisor: float | None = None

    @property
    def sums(self) -> tuple[SumCheck, ...]:
        """The sum checks present: the clipped sum, then the update × divisor."""
        return tuple(x for x in (self.clipped_sum, self.update) if x is not None)

    #: Deprecated: `divisor.implied` (None where no divisor could be read).
    implied_divisor = RenamedAttribute("divisor.implied", missing=None)
    #: Deprecated: `divisor.data_dependent` (False where no divisor could be read).
    data_dependent_divisor = RenamedAttribute("divisor.data_dependent", missing=False)

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> StepResult:
        return cls(verdict=str(d["verdict"]), true_coefficients=_floats(d["true_coefficients"]),
                   clipped_sum=_optional(SumCheck._from_native, d["clipped_sum"]),
                   update=_optional(SumCheck._from_native, d["update"]),
                   noise=tuple(NoiseCheck._from_native(n) for n in d["noise"]),
                   noisy_update=_optional(NoisyUpdateCheck._from_native, d["noisy_update"]),
                   update_not_judged=bool(d["update_not_judged"]),
                   noise_fraction=_f(d["noise_fraction"]),
                   contributions=_floats(d["contributions"]),
                   sigma_eff=_f(d["sigma_eff"]),
                   divisor=_optional(DivisorCheck._from_native, d["divisor"]))


#: Each per-example figure the judge writes (`ExampleMetrics` of src/judge/example.rs, one per
#: example in a case's `examples`) and the `CaseResult` column, a read-only array over the batch,
#: that holds it. The columns keep the names they have had since the first release (a column of
#: norms is `true_norms`); everything else of a case is a field under the judge's own name.
EXAMPLE_COLUMNS: dict[str, str] = {
    "true_norm": "true_norms",
    "norm": "claimed_norms",
    "norm_rel_err": "norm_rel_err",
    "bound": "bound",
    "bound_exact": "bound_exact",
    "model_rounding": "model_rounding",
    "allowed_contribution": "allowed_contribution",
    "err_units": "err_units",
    "coefficient": "coefficients",
    "true_coefficient": "true_coefficients",
    "sensitivity": "sensitivity",
    "flipped": "flipped",
    "cross_share": "cross_share",
    "invalid": "invalid",
    "judgeable": "judgeable",
}
#: The per-example figures that are yes/no (boolean columns); the others are floats.
_BOOLEAN_COLUMNS = frozenset({"flipped", "invalid", "judgeable", "bound_exact"})


#: The figures of a case that are numbers (NaN where the judge leaves one undefined: null in its
#: document, e.g. `max_sensitivity_ratio` after an invalid norm).
_CASE_FLOATS = (
    "max_grad_norm", "noise_multiplier", "max_sensitivity_ratio", "effective_noise_multiplier",
    "max_norm_rel_err", "max_err_units", "max_coef_abs_diff", "effective_noise_ratio",
    "reference_noise_ratio", "clipped_sum_cosine", "clipped_sum_rel_err", "clipped_sum_bound",
    "max_cross_share", "contribution_slack", "max_bound", "worst_contribution",
)


@dataclass(frozen=True)
class CaseResult(_Judged):
    """One clipper on one case (a batch at one clipping norm C): the case's figures and, per
    example, read-only NumPy arrays of length B (`EXAMPLE_COLUMNS`)."""

    #: The label reports show: `base_case`, with `@C=<c_multiplier>xmedian` where the suite
    #: tried several clipping norms.
    case: str
    #: The case's name without the clipping norm, and C as a multiple of the case's median true
    #: norm (None when C was given).
    base_case: str
    c_multiplier: float | None
    verdict: str
    max_grad_norm: float
    noise_multiplier: float
    #: The example that decided the verdict (largest clipped contribution for a privacy
    #: violation, first invalid norm, loosest bound for cannot-judge, else largest error in
    #: units of the bound).
    worst_example: int
    #: max over examples of c·n*/C: above 1 (beyond rounding) the DP guarantee fails at σ (NaN
    #: after an invalid norm).
    max_sensitivity_ratio: float
    #: σ / max(1, max_sensitivity_ratio).
    effective_noise_multiplier: float
    max_norm_rel_err: float
    max_err_units: float
    max_coef_abs_diff: float
    decision_flips: int
    #: σC / ‖Σ c_i g_i*‖ with the claimed and with the exact coefficients (NaN: undefined).
    effective_noise_ratio: float
    reference_noise_ratio: float
    clipped_sum_cosine: float
    #: ‖S − S*‖ / ‖S*‖ of the clipper's clipped sum and the rounding bound on it, relative to
    #: ‖S*‖ (NaN where the clipper reported no sum, or S* = 0).
    clipped_sum_rel_err: float
    clipped_sum_bound: float
    max_cross_share: float
    invalid_examples: tuple[int, ...]
    #: Examples whose rounding bound is too loose to judge their norm (over a tenth of it, or
    #: letting a passing claim clip them above C·(1 + δ)): any makes the verdict "cannot-judge"
    #: (unless a worse one holds).
    unjudgeable_examples: tuple[int, ...]
    #: Why the loosest of those cannot be judged: the rule that fired, with its numbers (None
    #: when every example can be judged).
    cannot_judge_reason: str | None
    #: δ at the precision judged: the overshoot of C a passing claim may allow.
    contribution_slack: float
    #: The largest relative bound over the examples.
    max_bound: float
    #: Sequence length and widest factor of the trace: what makes a low-precision bound grow.
    seq_len: int
    widest_factor: int
    #: The largest clipped contribution rounding cannot explain, at least 1 (NaN: invalid norm).
    worst_contribution: float
    #: The per-example norms from the f64 reference.
    true_norms: np.ndarray = field(repr=False)
    #: The per-example norms the clipper claimed.
    claimed_norms: np.ndarray = field(repr=False)
    #: The clipper's clipping coefficients c_i, and the exact ones min(1, C/n_i*).
    coefficients: np.ndarray = field(repr=False)
    true_coefficients: np.ndarray = field(repr=False)
    #: Each example's clipped contribution c_i·n_i*/C.
    sensitivity: np.ndarray = field(repr=False)
    #: |n_i − n_i*| / n_i*, the rounding bound on it, and their ratio.
    norm_rel_err: np.ndarray = field(repr=False)
    bound: np.ndarray = field(repr=False)
    #: Whether each `bound` is the figure (False: `check` left the tolerance's statistics as
    #: bounds that gave the example one verdict at both ends, and `bound` is the end on the
    #: verdict's side: the lower for an example within it, the upper for one beyond it).
    bound_exact: np.ndarray = field(repr=False)
    err_units: np.ndarray = field(repr=False)
    #: 2⟨g_in, g_out⟩ / ‖g*‖²: the share of each true squared norm that is the tied cross term
    #: (NaN where the true gradient is zero).
    cross_share: np.ndarray = field(repr=False)
    flipped: np.ndarray = field(repr=False)
    invalid: np.ndarray = field(repr=False)
    #: Whether each example's bound is tight enough to judge its norm.
    judgeable: np.ndarray = field(repr=False)
    #: The largest clipped contribution (units of C) of a claim within each example's bound.
    allowed_contribution: np.ndarray = field(repr=False)
    #: The part of each bound that is the model's own rounding (the trace's `model.rounding`).
    model_rounding: np.ndarray = field(repr=False)
    #: The judged step (`StepResult`), None when the trace carries no step.
    step: StepResult | None = field(default=None, repr=False)

    #: Deprecated spelling of `case`.
    name = RenamedAttribute("case")
    #: Deprecated spelling of `max_sensitivity_ratio`.
    max_sensitivity = RenamedAttribute("max_sensitivity_ratio")

    def __repr__(self) -> str:
        return (f"CaseResult({self.case!r}, {self.verdict}, B={len(self.true_norms)}, worst example "
                f"{self.worst_example}, max sensitivity {self.max_sensitivity_ratio:.4f})")

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> CaseResult:
        examples = d["examples"]

        def column(key: str) -> np.ndarray:
            values = [e[key] for e in examples]
            # An undefined per-example metric (None) is NaN.
            return _array(values, bool) if key in _BOOLEAN_COLUMNS else _floats(values)

        multiplier = d["c_multiplier"]
        numbers: dict[str, Any] = {key: _f(d[key]) for key in _CASE_FLOATS}
        numbers.update((name, column(key)) for key, name in EXAMPLE_COLUMNS.items())
        return cls(
            case=str(d["case"]),
            base_case=str(d["base_case"]),
            c_multiplier=None if multiplier is None else float(multiplier),
            verdict=d["verdict"],
            worst_example=int(d["worst_example"]),
            decision_flips=int(d["decision_flips"]),
            invalid_examples=tuple(int(i) for i in d["invalid_examples"]),
            unjudgeable_examples=tuple(int(i) for i in d["unjudgeable_examples"]),
            cannot_judge_reason=d["cannot_judge_reason"],
            seq_len=int(d["seq_len"]),
            widest_factor=int(d["widest_factor"]),
            step=_optional(StepResult._from_native, d.get("step")),
            **numbers,
        )


#: Each figure of a kill-matrix row (`kill_matrix_json` of src/report/kill_matrix.rs) and the
#: `ClipperResult` field that holds it: the row's `clipper` is the audit's `name`, and its `cases`
#: (verdict per base case) are `cells`, since `cases` is the audit's `CaseResult`s.
KILL_MATRIX_ROW: dict[str, str] = {
    "clipper": "name",
    "mutant": "mutant",
    "reproduces": "reproduces",
    "caught": "caught",
    "ok": "ok",
    "invisible_at_precision": "invisible_at_precision",
    "problems": "problems",
    "cases": "cells",
}


@dataclass(frozen=True)
class ClipperResult(_Judged):
    """One clipper's results over every case of a report."""

    name: str
    verdict: str
    cases: tuple[CaseResult, ...]
    #: Index into `cases` of the case that decided the verdict.
    worst_case: int
    warnings: tuple[str, ...]
    #: The precision the tolerance assumed ("f64", "f32", "f16" or "bf16").
    precision: Precision
    privacy: Privacy | None
    #: Kill matrix only: whether this clipper is a seeded bug, the library behaviour it
    #: reproduces, its most severe verdict per base case, how many base cases flag it, whether
    #: its bug is one this precision cannot see, and what the matrix's checks found wrong with it
    #: (empty, and `ok`: caught as expected, or a correct clipper not flagged).
    mutant: bool = False
    reproduces: str | None = None
    cells: dict[str, str] = field(default_factory=dict)
    caught: int = 0
    invisible_at_precision: bool = False
    ok: bool = True
    problems: tuple[str, ...] = ()

    @property
    def worst(self) -> CaseResult:
        """The case that decided the verdict."""
        return self.cases[self.worst_case]

    def __repr__(self) -> str:
        return f"ClipperResult({self.name!r}, {self.verdict}, {len(self.cases)} case(s), worst {self.worst.case!r})"

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> ClipperResult:
        return cls(
            name=d["name"],
            verdict=d["verdict"],
            cases=tuple(CaseResult._from_native(c) for c in d["cases"]),
            worst_case=int(d["worst_case"]),
            warnings=tuple(d["warnings"]),
            precision=d["precision"],
            privacy=_optional(Privacy._from_native, d["privacy"]),
        )

    def _with_row(self, row: dict[str, Any]) -> ClipperResult:
        """This audit with its kill-matrix row."""
        if row["clipper"] != self.name:
            raise RuntimeError(f"kill matrix row {row['clipper']!r} beside the audit of {self.name!r}")
        return dataclasses.replace(
            self, mutant=bool(row["mutant"]), reproduces=row["reproduces"],
            cells={str(k): str(v) for k, v in row["cases"].items()}, caught=int(row["caught"]),
            invisible_at_precision=bool(row["invisible_at_precision"]), ok=bool(row["ok"]),
            problems=tuple(str(p) for p in row["problems"]))


_T = TypeVar("_T")


class _OfWorstCase(Generic[_T]):
    """A `Report` attribute that is the same-named field of its deciding case (`Report.worst`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, report: None, owner: type) -> _OfWorstCase[_T]: ...
    @overload
    def __get__(self, report: Report, owner: type) -> _T: ...

    def __get__(self, report: Report | None, owner: type) -> _OfWorstCase[_T] | _T:
        if report is None:
            return self
        value: _T = getattr(report.worst, self._name)
        return value


class Report:
    """What ghost-oracle found: one entry per audited clipper.

    - `passed`: every clipper passed (for `mutants()`: every seeded bug was caught with the
      verdict it must get and no correct clipper was flagged);
    - `verdict`: the most severe verdict, one of `VERDICTS` (for `mutants()`: "pass" or
      "detection-check-failed");
    - `clippers`: a `ClipperResult` per clipper, each with its `CaseResult`s;
    - `true_norms`, `claimed_norms`, `coefficients`, `true_coefficients`, `sensitivity`,
      `cross_share`, `judgeable`: per-example NumPy arrays of the deciding case (the only case
      of a `check`), with its `unjudgeable_examples`, `cannot_judge_reason` and `max_bound`;
    - `privacy`: stated and actual ε of the deciding clipper;
    - `tied_parameters`: for a `check`, each parameter the trace's sites share, with its sites;
    - `step`: for a `check` of a trace with a step, the deciding case's `StepResult` (None
      without a step; every `CaseResult` has its own);
    - `to_json()`: the document the CLI writes with `--json`; `repr()`: the CLI's table;
      `explain()`: the deciding case in words (what `assert_norms` raises with).
    """

    dtype = RenamedAttribute("precision")  # its old spelling

    def __init__(self, native: dict[str, Any]) -> None:
        self.kind: str = native["kind"]
        #: The precision the bound assumed (a check) or the clippers computed in.
        self.precision: Precision = native["precision"]
        self.device: str = native["device"]
        self.trace: str | None = native.get("trace")
        self.tied_parameters: dict[str, tuple[tuple[str, str], ...]] = {
            t["param"]: tuple((str(n), str(k)) for n, k in t["sites"]) for t in native.get("tied", [])
        }
        self._json: str = native["json"]
        self._table: str = native["table"]
        self._explanation: str = native["explanation"]
        clippers = [ClipperResult._from_native(c) for c in native["clippers"]]
        if self.kind == "mutants":
            clippers = [c._with_row(r) for c, r in zip(clippers, native["rows"], strict=True)]
            self.cases: tuple[str, ...] = tuple(native["cases"])
            self.passed: bool = bool(native["ok"])
            self.verdict: str = "pass" if self.passed else "detection-check-failed"
        else:
            self.cases = tuple(dict.fromkeys(k.case for c in clippers for k in c.cases))
            self.passed = all(c.passed for c in clippers)
            self.verdict = max((c.verdict for c in clippers), key=_SEVERITY.__getitem__, default="pass")
        divisor = native.get("batch_divisor")
        if divisor is not None:
            clippers = [dataclasses.replace(c, cases=tuple(
                k if k.step is None
                else dataclasses.replace(k, step=dataclasses.replace(k.step, batch_divisor=float(divisor)))
                for k in c.cases)) for c in clippers]
        self.clippers: tuple[ClipperResult, ...] = tuple(clippers)

    # -- the deciding clipper and case ---------------------------------------------------------

    @property
    def deciding(self) -> ClipperResult:
        """The clipper that decided the verdict: the most severe, then the largest clipped
        contribution (for the kill matrix, the first whose check failed, else the first)."""
        if self.kind == "mutants":
            return next((c for c in self.clippers if c.problems), self.clippers[0])
        return max(self.clippers, key=lambda c: (_SEVERITY[c.verdict], c.worst.max_sensitivity_ratio))

    @property
    def worst(self) -> CaseResult:
        """The deciding clipper's deciding case."""
        return self.deciding.worst

    @property
    def privacy(self) -> Privacy | None:
        return self.deciding.privacy

    @property
    def step(self) -> StepResult | None:
        """The deciding case's judged step (`StepResult`); None when its trace has no step."""
        return self.worst.step

    # The deciding case's figures, read through to `worst` (a `CaseResult`).
    true_norms = _OfWorstCase[np.ndarray]()
    claimed_norms = _OfWorstCase[np.ndarray]()
    coefficients = _OfWorstCase[np.ndarray]()
    true_coefficients = _OfWorstCase[np.ndarray]()
    sensitivity = _OfWorstCase[np.ndarray]()
    cross_share = _OfWorstCase[np.ndarray]()
    judgeable = _OfWorstCase[np.ndarray]()
    unjudgeable_examples = _OfWorstCase[tuple[int, ...]]()
    cannot_judge_reason = _OfWorstCase["str | None"]()
    max_bound = _OfWorstCase[float]()
    max_sensitivity_ratio = _OfWorstCase[float]()
    effective_noise_multiplier = _OfWorstCase[float]()

    #: Deprecated spelling of `max_sensitivity_ratio` (the worst case's).
    max_sensitivity = RenamedAttribute("worst.max_sensitivity_ratio")

    # -- output ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The JSON document the CLI writes with `--json` (`ghost-oracle check/audit/mutants`)."""
        return self._json

    def __repr__(self) -> str:
        return self._table.lstrip("\n").rstrip("\n")

    def __str__(self) -> str:
        return repr(self)

    def explain(self) -> str:
        """The deciding case in words, as ghost-oracle's judge reads it: the verdict, the worst
        example with its true and claimed norm, the sensitivity, σ_eff, stated and actual ε, and
        the tied parameter involved. When the step decided the verdict: each failing check of the
        step with what it shows (examples missing from a sum, a sum scaled by a wrong divisor, too
        little or too much noise), σ_eff and ε, and the true and implied coefficients per
        example. For the kill matrix: the clippers whose check failed."""
        return self._explanation
