"""The `Report` that `check`, `audit` and `mutants` return."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _native
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
    def _from_native(cls, d: dict[str, Any] | None) -> Privacy | None:
        if d is None:
            return None
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
class SumCheck:
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

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @classmethod
    def _from_native(cls, d: dict[str, Any] | None) -> SumCheck | None:
        if d is None:
            return None
        return cls(what=str(d["what"]), rel_err=_opt(d["rel_err"]), bound=_opt(d["bound"]),
                   worst_param=str(d["worst_param"]), worst_param_rel_err=_opt(d["worst_param_rel_err"]),
                   scale=_opt(d["scale"]), implied_coefficients=_array([_f(x) for x in d["implied_coefficients"]]),
                   implied_sensitivity=_f(d["implied_sensitivity"]), unexplained=_opt(d["unexplained"]),
                   missing_examples=tuple(int(i) for i in d["missing_examples"]),
                   shared_scale=bool(d["shared_scale"]), singular=bool(d["singular"]),
                   invalid=bool(d["invalid"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class NoiseCheck:
    """The noise of one parameter tensor `param` (or of the whole update: `param` None,
    `whole` True): ‖r‖²/(σC)², χ² with `entries` degrees of freedom for noise N(0, σ²C²) on
    every entry, against its Laurent–Massart interval [low, high]."""

    param: str | None
    entries: int
    chi2: float
    low: float
    high: float
    #: σ̂ / σ = √(χ² / entries): the noise the tensor got, in units of the stated.
    sigma_ratio: float
    verdict: str

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def whole(self) -> bool:
        """The check is over the whole update, every tensor together."""
        return self.param is None

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> NoiseCheck:
        # The scope is {"tensor": name} for one tensor, "whole" for the whole update.
        scope = d["scope"]
        param = None if scope == "whole" else str(scope["tensor"])
        return cls(param=param, entries=int(d["entries"]), chi2=_f(d["chi2"]), low=_f(d["low"]),
                   high=_f(d["high"]), sigma_ratio=_f(d["sigma_ratio"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class NoisyUpdateCheck:
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

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @classmethod
    def _from_native(cls, d: dict[str, Any] | None) -> NoisyUpdateCheck | None:
        if d is None:
            return None
        return cls(implied_coefficients=_array([_f(x) for x in d["implied_coefficients"]]), chi2=_f(d["chi2"]),
                   dof=int(d["dof"]), high=_f(d["high"]), smallest_visible=_opt(d["smallest_visible"]),
                   residual=NoiseCheck._from_native(d["residual"]), verdict=str(d["verdict"]))


@dataclass(frozen=True)
class StepResult:
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
    - `implied_divisor`: the divisor the update implies (None where it cannot be read), and
      `data_dependent_divisor`: it is the batch's drawn size, not the stated one;
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
    implied_divisor: float | None = None
    data_dependent_divisor: bool = False
    #: D, the divisor the trace states (`batch_divisor`), when the report was read from a trace
    #: file that states one.
    batch_divisor: float | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def sums(self) -> tuple[SumCheck, ...]:
        """The sum checks present: the clipped sum, then the update × divisor."""
        return tuple(x for x in (self.clipped_sum, self.update) if x is not None)

    @classmethod
    def _from_native(cls, d: dict[str, Any] | None) -> StepResult | None:
        if d is None:
            return None
        return cls(verdict=str(d["verdict"]), true_coefficients=_array([_f(x) for x in d["true_coefficients"]]),
                   clipped_sum=SumCheck._from_native(d.get("clipped_sum")),
                   update=SumCheck._from_native(d.get("update")),
                   noise=tuple(NoiseCheck._from_native(n) for n in d.get("noise", [])),
                   noisy_update=NoisyUpdateCheck._from_native(d.get("noisy_update")),
                   update_not_judged=bool(d.get("update_not_judged", False)),
                   noise_fraction=_f(d.get("noise_fraction", 1.0)),
                   contributions=_array([_f(x) for x in d.get("contributions", [])]),
                   sigma_eff=_f(d.get("sigma_eff", math.nan)),
                   implied_divisor=_opt((d.get("divisor") or {}).get("implied")),
                   data_dependent_divisor=bool((d.get("divisor") or {}).get("data_dependent", False)))


@dataclass(frozen=True)
class CaseResult:
    """One clipper on one case (a batch at one clipping norm C): the case's figures and, per
    example, read-only NumPy arrays of length B."""

    name: str
    verdict: str
    max_grad_norm: float
    noise_multiplier: float
    #: The example that decided the verdict (largest clipped contribution for a privacy
    #: violation, first invalid norm, loosest bound for cannot-judge, else largest error in
    #: units of the bound).
    worst_example: int
    #: max over examples of c·n*/C: above 1 (beyond rounding) the DP guarantee fails at σ.
    max_sensitivity: float
    #: σ / max(1, max_sensitivity).
    effective_noise_multiplier: float
    max_norm_rel_err: float
    max_err_units: float
    max_coef_abs_diff: float
    decision_flips: int
    #: σC / ‖Σ c_i g_i*‖ with the claimed and with the exact coefficients (NaN: undefined).
    effective_noise_ratio: float
    reference_noise_ratio: float
    clipped_sum_cosine: float
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

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def __repr__(self) -> str:
        return (f"CaseResult({self.name!r}, {self.verdict}, B={len(self.true_norms)}, worst example "
                f"{self.worst_example}, max sensitivity {self.max_sensitivity:.4f})")

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> CaseResult:
        examples = d["examples"]

        def column(key: str, dtype: Any = np.float64) -> np.ndarray:
            # An undefined per-example metric (None) is NaN.
            values = [e[key] for e in examples]
            return _array([_f(v) for v in values] if dtype is np.float64 else values, dtype)

        return cls(
            name=d["case"],
            verdict=d["verdict"],
            max_grad_norm=float(d["max_grad_norm"]),
            noise_multiplier=float(d["noise_multiplier"]),
            worst_example=int(d["worst_example"]),
            # NaN after an invalid norm (null in the document).
            max_sensitivity=_f(d["max_sensitivity_ratio"]),
            effective_noise_multiplier=_f(d["effective_noise_multiplier"]),
            max_norm_rel_err=_f(d["max_norm_rel_err"]),
            max_err_units=_f(d["max_err_units"]),
            max_coef_abs_diff=_f(d["max_coef_abs_diff"]),
            decision_flips=int(d["decision_flips"]),
            effective_noise_ratio=_f(d["effective_noise_ratio"]),
            reference_noise_ratio=_f(d["reference_noise_ratio"]),
            clipped_sum_cosine=_f(d["clipped_sum_cosine"]),
            max_cross_share=_f(d["max_cross_share"]),
            invalid_examples=tuple(int(i) for i in d["invalid_examples"]),
            unjudgeable_examples=tuple(int(i) for i in d["unjudgeable_examples"]),
            cannot_judge_reason=d["cannot_judge_reason"],
            contribution_slack=float(d["contribution_slack"]),
            max_bound=_f(d["max_bound"]),
            seq_len=int(d["seq_len"]),
            widest_factor=int(d["widest_factor"]),
            worst_contribution=_f(d["worst_contribution"]),
            true_norms=column("true_norm"),
            claimed_norms=column("norm"),
            coefficients=column("coefficient"),
            true_coefficients=column("true_coefficient"),
            sensitivity=column("sensitivity"),
            norm_rel_err=column("norm_rel_err"),
            bound=column("bound"),
            err_units=column("err_units"),
            cross_share=column("cross_share"),
            flipped=column("flipped", bool),
            invalid=column("invalid", bool),
            judgeable=column("judgeable", bool),
            allowed_contribution=column("allowed_contribution"),
            model_rounding=column("model_rounding"),
            step=StepResult._from_native(d.get("step")),
        )


@dataclass(frozen=True)
class ClipperResult:
    """One clipper's results over every case of a report."""

    name: str
    verdict: str
    cases: tuple[CaseResult, ...]
    #: Index into `cases` of the case that decided the verdict.
    worst_case: int
    warnings: tuple[str, ...]
    privacy: Privacy | None
    #: Kill matrix only: whether this clipper is a seeded bug, the library behaviour it
    #: reproduces, its most severe verdict per base case, and what the matrix's checks found
    #: wrong with it (empty: caught as expected, or a correct clipper not flagged).
    mutant: bool = False
    reproduces: str | None = None
    cells: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def worst(self) -> CaseResult:
        """The case that decided the verdict."""
        return self.cases[self.worst_case]

    def __repr__(self) -> str:
        return f"ClipperResult({self.name!r}, {self.verdict}, {len(self.cases)} case(s), worst {self.worst.name!r})"

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> ClipperResult:
        return cls(
            name=d["name"],
            verdict=d["verdict"],
            cases=tuple(CaseResult._from_native(c) for c in d["cases"]),
            worst_case=int(d["worst_case"]),
            warnings=tuple(d["warnings"]),
            privacy=Privacy._from_native(d["privacy"]),
        )


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
            cases = list(native["cases"])
            rows = native["rows"]
            clippers = [
                ClipperResult(
                    name=c.name, verdict=c.verdict, cases=c.cases, worst_case=c.worst_case,
                    warnings=c.warnings, privacy=c.privacy, mutant=bool(r["mutant"]),
                    reproduces=r["reproduces"], cells=dict(zip(cases, r["cells"], strict=True)),
                    problems=tuple(r["problems"]),
                )
                for c, r in zip(clippers, rows, strict=True)
            ]
            self.cases: tuple[str, ...] = tuple(cases)
            self.passed: bool = bool(native["ok"])
            self.verdict: str = "pass" if self.passed else "detection-check-failed"
        else:
            self.cases = tuple(dict.fromkeys(k.name for c in clippers for k in c.cases))
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
        return max(self.clippers, key=lambda c: (_SEVERITY[c.verdict], c.worst.max_sensitivity))

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

    @property
    def true_norms(self) -> np.ndarray:
        return self.worst.true_norms

    @property
    def claimed_norms(self) -> np.ndarray:
        return self.worst.claimed_norms

    @property
    def coefficients(self) -> np.ndarray:
        return self.worst.coefficients

    @property
    def true_coefficients(self) -> np.ndarray:
        return self.worst.true_coefficients

    @property
    def sensitivity(self) -> np.ndarray:
        return self.worst.sensitivity

    @property
    def cross_share(self) -> np.ndarray:
        return self.worst.cross_share

    @property
    def judgeable(self) -> np.ndarray:
        return self.worst.judgeable

    @property
    def unjudgeable_examples(self) -> tuple[int, ...]:
        return self.worst.unjudgeable_examples

    @property
    def cannot_judge_reason(self) -> str | None:
        return self.worst.cannot_judge_reason

    @property
    def max_bound(self) -> float:
        return self.worst.max_bound

    @property
    def max_sensitivity(self) -> float:
        return self.worst.max_sensitivity

    @property
    def effective_noise_multiplier(self) -> float:
        return self.worst.effective_noise_multiplier

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
