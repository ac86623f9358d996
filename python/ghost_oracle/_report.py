"""The `Report` that `check`, `audit` and `mutants` return."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Verdicts from the least to the most severe.
VERDICTS = ("pass", "utility-distortion", "cannot-judge", "privacy-violation", "invalid-norm")
_SEVERITY = {v: k for k, v in enumerate(VERDICTS)}


def _f(x: Any) -> float:
    """A float; None (an undefined metric, or a NaN or infinite one: JSON has neither) as NaN."""
    return math.nan if x is None else float(x)


def _epsilon(x: Any) -> float:
    """An ε; None (no ε holds, written null in JSON) as +∞."""
    return math.inf if x is None else float(x)


def _array(xs: list, dtype: Any = np.float64) -> np.ndarray:
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
    def _from_native(cls, d: dict | None) -> Privacy | None:
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
    def _from_native(cls, d: dict | None) -> SumCheck | None:
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
    def _from_native(cls, d: dict) -> NoiseCheck:
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
    def _from_native(cls, d: dict | None) -> NoisyUpdateCheck | None:
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
    def _from_native(cls, d: dict | None) -> StepResult | None:
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
    #: Examples whose rounding bound is too loose to judge their norm (over a tenth of it): any
    #: makes the verdict "cannot-judge" (unless a worse one holds).
    unjudgeable_examples: tuple[int, ...]
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
    #: The judged step (`StepResult`), None when the trace carries no step.
    step: StepResult | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def __repr__(self) -> str:
        return (f"CaseResult({self.name!r}, {self.verdict}, B={len(self.true_norms)}, worst example "
                f"{self.worst_example}, max sensitivity {self.max_sensitivity:.4f})")

    @classmethod
    def _from_native(cls, d: dict) -> CaseResult:
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
    def _from_native(cls, d: dict) -> ClipperResult:
        return cls(
            name=d["name"],
            verdict=d["verdict"],
            cases=tuple(CaseResult._from_native(c) for c in d["cases"]),
            worst_case=int(d["worst_case"]),
            warnings=tuple(d["warnings"]),
            privacy=Privacy._from_native(d["privacy"]),
        )


def _pct(x: float) -> str:
    return f"{100 * x:.3g} %"


def _sci(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.3g}"


def _divisor_of(k: CaseResult) -> float | None:
    return None if k.step is None else k.step.batch_divisor


def _close(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-300)


def _uniformly_scaled(x: SumCheck, true_coefficients: np.ndarray) -> bool:
    """Whether X is S* scaled by its `scale`: the scale differs from 1, little of X is
    unexplained, and every implied coefficient is the true one times the scale (to a quarter of
    |scale − 1|)."""
    s = x.scale
    if not math.isfinite(s) or abs(s - 1) <= 2 * (x.bound if math.isfinite(x.bound) else 0.0):
        return False
    if not math.isfinite(x.unexplained) or x.unexplained > 0.25 * abs(s - 1):
        return False
    c = np.asarray(x.implied_coefficients)
    t = np.asarray(true_coefficients)
    return bool(np.all(np.abs(c - s * t) <= 0.25 * abs(s - 1) * np.abs(t)))


def _trace_metadata(path: str) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (its header is 8 bytes of length, then JSON);
    empty when it cannot be read."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100_000_000:
                return {}
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


class Report:
    """What ghost-oracle found: one entry per audited clipper.

    - `passed`: every clipper passed (for `mutants()`: every seeded bug was caught with the
      verdict it must get and no correct clipper was flagged);
    - `verdict`: the most severe verdict, one of `VERDICTS` (for `mutants()`: "pass" or
      "detection-check-failed");
    - `clippers`: a `ClipperResult` per clipper, each with its `CaseResult`s;
    - `true_norms`, `claimed_norms`, `coefficients`, `true_coefficients`, `sensitivity`,
      `cross_share`, `judgeable`: per-example NumPy arrays of the deciding case (the only case
      of a `check`), with its `unjudgeable_examples` and `max_bound`;
    - `privacy`: stated and actual ε of the deciding clipper;
    - `tied_parameters`: for a `check`, each parameter the trace's sites share, with its sites;
    - `step`: for a `check` of a trace with a step, the deciding case's `StepResult` (None
      without a step; every `CaseResult` has its own);
    - `to_json()`: the document the CLI writes with `--json`; `repr()`: the CLI's table;
      `explain()`: the deciding case in words (what `assert_norms` raises with).
    """

    def __init__(self, native: dict):
        self.kind: str = native["kind"]
        #: The precision the bound assumed (a check) or the clippers computed in.
        self.dtype: str = native["dtype"]
        self.device: str = native["device"]
        self.trace: str | None = native.get("trace")
        self.tied_parameters: dict[str, tuple[tuple[str, str], ...]] = {
            t["param"]: tuple((str(n), str(k)) for n, k in t["sites"]) for t in native.get("tied", [])
        }
        self._json: str = native["json"]
        self._table: str = native["table"]
        clippers = [ClipperResult._from_native(c) for c in native["clippers"]]
        if self.kind == "mutants":
            cases = list(native["cases"])
            rows = native["rows"]
            clippers = [
                ClipperResult(
                    name=c.name, verdict=c.verdict, cases=c.cases, worst_case=c.worst_case,
                    warnings=c.warnings, privacy=c.privacy, mutant=bool(r["mutant"]),
                    reproduces=r["reproduces"], cells=dict(zip(cases, r["cells"])),
                    problems=tuple(r["problems"]),
                )
                for c, r in zip(clippers, rows)
            ]
            self.cases: tuple[str, ...] = tuple(cases)
            self.passed: bool = bool(native["ok"])
            self.verdict: str = "pass" if self.passed else "detection-check-failed"
        else:
            self.cases = tuple(dict.fromkeys(k.name for c in clippers for k in c.cases))
            self.passed = all(c.passed for c in clippers)
            self.verdict = max((c.verdict for c in clippers), key=_SEVERITY.__getitem__, default="pass")
        if self.kind == "check" and self.trace and any(k.step is not None for c in clippers for k in c.cases):
            d = _trace_metadata(self.trace).get("batch_divisor")
            try:
                divisor = None if d is None else float(d)
            except ValueError:
                divisor = None
            clippers = [dataclasses.replace(c, cases=tuple(
                k if k.step is None else dataclasses.replace(k, step=dataclasses.replace(k.step, batch_divisor=divisor))
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
        """The deciding case in words: the verdict, the worst example with its true and claimed
        norm, the sensitivity, σ_eff, stated and actual ε, and the tied parameter involved. When
        the step decided the verdict: each failing check of the step, the parameter and the
        figure that decided it, σ_eff and ε, and the true and implied coefficients per example."""
        if self.kind == "mutants":
            return self._explain_matrix()
        c = self.deciding
        k = c.worst
        if k.step is not None and not k.step.passed and k.step.verdict == k.verdict:
            return self._explain_step(c, k)
        i = k.worst_example
        lines = [f"ghost-oracle: clipper `{c.name}`: {c.verdict}" + {
            "pass": " (every claimed norm is within the rounding bound of the truth)",
            "utility-distortion": " (norms off beyond rounding, but no example's clipped contribution exceeds C: "
                                  "privacy holds, training signal is lost)",
            "cannot-judge": " (the rounding bound at this precision is over a tenth of some norm: a claim that far "
                            "off would pass too, so no norm of those examples can be judged right or wrong)",
            "privacy-violation": " (an example's clipped contribution exceeds C: the DP guarantee does not hold "
                                 "at the stated noise)",
            "invalid-norm": " (a NaN, infinite or negative norm or coefficient: the claim cannot be used)",
        }[c.verdict]]
        if len(self.clippers) > 1 or len(c.cases) > 1:
            lines.append(f"  deciding case: {k.name}")
        b = len(k.true_norms)
        t, n = k.true_norms[i], k.claimed_norms[i]
        if math.isfinite(n) and t > 0:
            direction = "low" if n < t else "high"
            diff = f"{_pct(abs(n - t) / t)} {direction}"
        else:
            diff = "not a valid norm"
        lines.append(f"  worst example {i} of {b}: claimed norm {n:.6g}, true norm {t:.6g} ({diff}; "
                     f"rounding allows {k.bound[i]:.2g} relative)")
        lines.append(f"  sensitivity: its clipped contribution is {k.sensitivity[i]:.4f}·C at C = {k.max_grad_norm:.6g}"
                     f" (the largest over the batch: {k.max_sensitivity:.4f}·C; above 1·C the stated σ does not "
                     "buy the stated ε)")
        lines.append(f"  σ_eff = {k.effective_noise_multiplier:.4f} (stated σ = {k.noise_multiplier:g})")
        if k.unjudgeable_examples:
            lines.append(f"  cannot judge {len(k.unjudgeable_examples)} of {b} example(s) "
                         f"({', '.join(map(str, k.unjudgeable_examples))}) at {self.dtype}: the loosest bound is "
                         f"{_pct(k.max_bound)} of the norm (T = {k.seq_len}, widest factor {k.widest_factor})")
        lines.extend(self._epsilon_line(c.privacy))
        lines.extend(self._explain_tied(k, i))
        if k.step is not None:
            lines.append(f"  the step: {k.step.verdict}" + ("" if k.step.passed else " (see below)"))
            if not k.step.passed:
                lines.extend(self._step_checks(k, k.step))
        for w in c.warnings:
            lines.append(f"  warning: {w}")
        lines.extend(self._example_table(k))
        if len(self.clippers) > 1:
            lines.append("  clippers: " + ", ".join(f"{x.name} {x.verdict}" for x in self.clippers))
        return "\n".join(lines)

    @staticmethod
    def _epsilon_line(p: Privacy | None) -> list[str]:
        if p is None:
            return []
        where = (f"δ = {p.delta:g}, q = {p.sampling_rate:g}, {p.steps} steps"
                 + (": a typical fine-tuning run; pass sampling_rate=, steps=, delta= for yours"
                    if p.default_setting else ""))
        stated = "∞ (σ = 0: no noise, no privacy)" if not math.isfinite(p.stated_epsilon) else f"{p.stated_epsilon:.2f}"
        actual = "∞" if not math.isfinite(p.actual_epsilon) else f"{p.actual_epsilon:.2f}"
        line = f"  ε: stated {stated}, actual {actual} ({where})"
        if p.worst_contribution > 1 and math.isfinite(p.sigma_needed):
            line += f"; σ = {p.sigma_needed:.4f} would keep ε = {p.stated_epsilon:.2f}"
        return [line]

    # -- the step --------------------------------------------------------------------------------

    def _explain_step(self, c: ClipperResult, k: CaseResult) -> str:
        """The message when the step decided the verdict: each failing check of the step, the
        parameter and the figure that decided it, σ_eff and ε, the norms, and per example the
        true and implied coefficients."""
        s = k.step
        assert s is not None
        lines = [f"ghost-oracle: clipper `{c.name}`: {c.verdict} in the step" + {
            "utility-distortion": " (the clipped sum or the update is off beyond rounding, or its noise is larger than "
                                  "stated; no example's contribution exceeds C and the noise is not below the stated: "
                                  "privacy holds, training signal is lost)",
            "privacy-violation": " (the update gives some example more weight than C, or some tensor less noise than "
                                 "σC: the DP guarantee does not hold at the stated noise)",
            "invalid-norm": " (a NaN or infinite value in the step's clipped sum or update)",
            "cannot-judge": " (the step cannot be judged at this precision)",
        }.get(c.verdict, "")]
        if len(self.clippers) > 1 or len(c.cases) > 1:
            lines.append(f"  deciding case: {k.name}")
        lines.extend(self._step_checks(k, s))
        p = c.privacy
        sigma_eff = p.effective_noise_multiplier if p is not None else k.effective_noise_multiplier
        worst = max((float(x) for x in s.contributions), default=1.0)
        why = []
        if s.noise_fraction < 1:
            why.append(f"some tensor got as little as {s.noise_fraction:.4f}·σ (the low end its χ² allows)")
        if worst > 1:
            why.append(f"σ / {worst:.4f}: the largest contribution, each example weighed by the noise its "
                       f"tensors got, is {worst:.4f}·C")
        lines.append(f"  σ_eff = {sigma_eff:.4f} (stated σ = {k.noise_multiplier:g}"
                     + (f"; {'; '.join(why)}" if why else "") + ")")
        if s.implied_divisor is not None and s.data_dependent_divisor:
            lines.append(f"  divisor: the update divides by the batch's drawn size ({s.implied_divisor:.4g}), not "
                         f"the stated {s.batch_divisor}: its normalization depends on the data")
        lines.extend(self._epsilon_line(p))
        b = len(k.true_norms)
        if k.max_err_units <= 1 and not k.invalid_examples:
            lines.append(f"  norms: the {b} claimed norms are within rounding of the true ones (largest error "
                         f"{k.max_err_units:.3g}× the bound): the step went wrong after the norms")
        else:
            i = k.worst_example
            lines.append(f"  norms: also off: worst example {i} of {b}, claimed {k.claimed_norms[i]:.6g}, true "
                         f"{k.true_norms[i]:.6g} ({k.err_units[i]:.3g}× the bound)")
        touched = {x.worst_param for x in s.sums if not x.passed} | {n.param for n in s.noise if not n.passed}
        for param, sites in self.tied_parameters.items():
            if param in touched:
                uses = " and ".join(f"`{name}` ({kind})" for name, kind in sites)
                lines.append(f"  `{param}` is a tied parameter (sites {uses}): one tensor of the step, whose noise is one draw of N(0, σ²C²) per entry whatever its uses")
        for w in c.warnings:
            lines.append(f"  warning: {w}")
        lines.extend(self._step_table(k, s))
        if len(self.clippers) > 1:
            lines.append("  clippers: " + ", ".join(f"{x.name} {x.verdict}" for x in self.clippers))
        return "\n".join(lines)

    @staticmethod
    def _step_checks(k: CaseResult, s: StepResult) -> list[str]:
        lines = []
        clipped_ok = s.clipped_sum is None or s.clipped_sum.passed
        for x in s.sums:
            k_ = s.clipped_sum
            if (x is s.update and k_ is not None and not k_.passed and not x.passed
                    and _close(x.rel_err, k_.rel_err) and _close(x.scale, k_.scale)):
                lines.append(f"  step: {x.what} {x.verdict}: off by {_sci(x.rel_err)} of S* (rounding allows "
                             f"{_sci(x.bound)}), as the clipped sum is: the update carries the clipped sum's error")
                continue
            lines.append(f"  step: {x.what} {x.verdict}: off by {_sci(x.rel_err)} of the exact clipped sum "
                         f"S* = Σ c*_i g*_i (rounding allows {_sci(x.bound)}); worst parameter `{x.worst_param}` "
                         f"(off by {_sci(x.worst_param_rel_err)} of its own)")
            if x.passed:
                continue
            if x.invalid:
                lines.append("    it holds NaN or infinite values")
            dropped = [i for i, (ci, ti) in enumerate(zip(x.implied_coefficients, s.true_coefficients))
                       if abs(ci) < 0.5 * ti]
            lines.append(f"    implied coefficients ĉ = G⁺⟨g*_i, X⟩: contributions ĉ_i·n*_i/C up to "
                         f"{x.implied_sensitivity:.4f}·C" + (" (above C: that example's privacy is spent faster than "
                                                            "σ buys)" if x.verdict == "privacy-violation" else ""))
            if dropped:
                lost = math.isfinite(x.unexplained) and x.unexplained <= 0.1
                lines.append(f"    {'examples' if len(dropped) > 1 else 'example'} {', '.join(map(str, dropped))} of "
                             f"{len(k.true_norms)} {'are' if len(dropped) > 1 else 'is'} missing from it (implied "
                             f"coefficient under half the true one){': a lost micro-batch?' if lost else ''}")
            scaled = _uniformly_scaled(x, s.true_coefficients)
            line = f"    scale ⟨X, S*⟩/‖S*‖² = {x.scale:.4f}"
            if scaled and x.what.startswith("update") and clipped_ok and x.scale > 0:
                d = _divisor_of(k)
                line += ": the update is the exact sum scaled by it"
                if d is not None:
                    line += (f"; implied divisor D/scale = {d / x.scale:.6g} against the stated D = {d:.6g}"
                             if math.isfinite(d) else "")
                if s.clipped_sum is not None:
                    line += " (the clipped sum is right: the divisor is wrong)"
                else:
                    line += " (a wrong divisor, or a clipped sum scaled by it)"
            elif scaled:
                line += ": every example's implied coefficient is the true one times it"
            lines.append(line)
            if math.isfinite(x.unexplained) and x.unexplained > 1e-3:
                lines.append(f"    unexplained: {_sci(x.unexplained)} of it is no combination of this batch's gradients"
                             + (" (another batch's update?)" if x.unexplained > 0.1 else ""))
            if x.singular:
                lines.append("    the batch's Gram is singular: ĉ is the minimum-norm solution")
        failing = [n for n in s.noise if not n.passed]
        for n in failing or [n for n in s.noise if n.whole]:
            what = {"privacy-violation": ": less noise than stated (missing, or divided twice)",
                    "utility-distortion": ": more noise than stated (added once per use of a tied weight? a larger C?)",
                    "invalid-norm": ": not finite"}.get(n.verdict, "")
            scope = "the whole update" if n.whole else f"`{n.param}`"
            lines.append(f"  step: noise on {scope} ({n.entries} entries) {n.verdict}: χ² = {n.chi2:.1f} "
                         f"{'outside' if not n.passed else 'within'} [{n.low:.1f}, {n.high:.1f}] (false alarms ≤ "
                         f"1e-6 a step), σ̂/σ = {n.sigma_ratio:.4f}{what}")
        u = s.noisy_update
        if u is not None:
            r = u.residual
            lines.append(f"  step: update under noise (no clipped sum) {u.verdict}: implied coefficients χ² = "
                         f"{u.chi2:.2f} on {u.dof} degrees of freedom (at most {u.high:.2f})"
                         + (f"; residual noise χ² = {r.chi2:.1f} against [{r.low:.1f}, {r.high:.1f}], "
                            f"σ̂/σ = {r.sigma_ratio:.4f} ({r.verdict})" if r is not None else ""))
            lines.append(f"    from one noisy update this test sees signal errors of {_sci(u.smallest_visible)} of "
                         "‖S*‖ or more, not less: pass clipped_sum= to judge the signal exactly")
        if s.update_not_judged:
            lines.append("  step: the update is under noise and nothing separates its signal from its noise: "
                         "not judged")
        return lines

    @staticmethod
    def _step_table(k: CaseResult, s: StepResult, limit: int = 16) -> list[str]:
        b = len(k.true_norms)
        cols = [(x.what, x.implied_coefficients) for x in s.sums if not x.passed]
        if s.noisy_update is not None and s.noisy_update.chi2 > s.noisy_update.high:
            cols.append(("noisy update", s.noisy_update.implied_coefficients))
        if not cols:
            return []
        head = "".join(f"  {'ĉ (' + w + ')':>24}  {'ĉ·n*/C':>8}" for w, _ in cols)
        lines = [f"  per example{f' (the first {limit} of {b})' if b > limit else ''}:",
                 f"        i      true norm        c*{head}"]
        c = k.max_grad_norm
        for i in range(min(b, limit)):
            row = f"    {i:>5}  {k.true_norms[i]:>13.6e}  {s.true_coefficients[i]:>8.5f}"
            for _, ci in cols:
                row += f"  {ci[i]:>24.5f}  {ci[i] * k.true_norms[i] / c:>8.4f}"
            lines.append(row)
        return lines

    def _explain_tied(self, k: CaseResult, i: int) -> list[str]:
        share = k.cross_share[i]
        if self.kind == "check" and not self.tied_parameters:
            return ["  tied parameters: none (no parameter has two sites), so the error is not a missing "
                    "cross term"]
        if self.tied_parameters:
            names = []
            for param, sites in self.tied_parameters.items():
                uses = " and ".join(f"`{s}` ({kind})" for s, kind in sites)
                names.append(f"`{param}` (sites {uses})")
            head = "  tied parameter: " + "; ".join(names)
        elif math.isfinite(share) and share != 0:
            head = "  tied parameters: the model shares a parameter between sites"
        else:
            return []
        lines = [head]
        t, n = k.true_norms[i], k.claimed_norms[i]
        if math.isfinite(share) and t > 0 and math.isfinite(n):
            short = 1 - (n / t) ** 2
            lines.append(f"    example {i}: the tied cross term is {share:+.3%} of the true squared norm n*²; "
                         f"the claimed n² = n*² {-short:+.3%}")
            if share != 0 and abs(short - share) <= 0.1 * abs(share) + 4 * k.bound[i]:
                lines.append("    the claim is the truth without the cross term: the clipper summed the tied uses "
                             "as if they were separate parameters (standard ghost clipping, or a copy of the model "
                             "with the parameter untied)")
        return lines

    @staticmethod
    def _example_table(k: CaseResult, limit: int = 16) -> list[str]:
        b = len(k.true_norms)
        order = list(range(b))
        note = ""
        if b > limit:
            order = sorted(np.argsort(-np.nan_to_num(k.err_units, nan=np.inf))[:limit].tolist())
            note = f" ({limit} of {b}: the largest errors)"
        lines = [f"  per example{note}:",
                 "        i        claimed           true    rel err   err/bound  coef claimed/true  contribution  cross/n²"]
        for j in order:
            cs = k.cross_share[j]
            lines.append(
                f"    {j:>5}  {k.claimed_norms[j]:>13.6e}  {k.true_norms[j]:>13.6e}  {k.norm_rel_err[j]:>9.2e}"
                f"  {k.err_units[j]:>10.3g}  {k.coefficients[j]:>8.5f}/{k.true_coefficients[j]:<8.5f}"
                f"  {k.sensitivity[j]:>12.5f}  {'n/a' if not math.isfinite(cs) else f'{cs:+.2%}':>8}"
                + ("  <- worst" if j == k.worst_example else ""))
        return lines

    def _explain_matrix(self) -> str:
        lines = [f"ghost-oracle kill matrix: {self.verdict}"]
        for c in self.clippers:
            if c.problems:
                lines.append(f"  {c.name}: " + "; ".join(c.problems))
        if self.passed:
            lines.append("  every mutant caught with the right verdict; no false alarm")
        return "\n".join(lines)
