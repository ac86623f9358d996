"""The Python report mirrors the compiled judge's documents key by key, both ways.

The judge's keys are read at run time from real reports of the compiled module (never from a
list kept here): the built-in audit (a step under noise: clipped sum, divisor, noise checks),
`check` on committed step traces (the update at σ = 0) and on one with its clipped sum removed
(an update under noise: the noisy-update check), and the kill matrix (its rows). Every key of
every document must be a field of its dataclass under the same name, and every field a key,
except the departures `_report.py` declares (`EXAMPLE_COLUMNS`, `KILL_MATRIX_ROW`,
`StepResult.batch_divisor`). Each field's value is held to the document's value too, so that a
field fed from another key is caught as well as a missing one."""
import dataclasses
import json
import math
import warnings
from collections import defaultdict

import numpy as np
import pytest
from conftest import TRACES
from safetensors import safe_open
from safetensors.numpy import save_file

from ghost_oracle import _native, _report
from ghost_oracle._report import EXAMPLE_COLUMNS, KILL_MATRIX_ROW, Report

# The mirror classes, by the judge's document each holds.
CaseResult, ClipperResult, Privacy = _report.CaseResult, _report.ClipperResult, _report.Privacy
StepResult, SumCheck, DivisorCheck = _report.StepResult, _report.SumCheck, _report.DivisorCheck
NoiseCheck, NoisyUpdateCheck = _report.NoiseCheck, _report.NoisyUpdateCheck

STEP_TRACES = TRACES / "step"
#: Every mirror class; each must be met in the reports below with a value, not only as None.
MIRRORS = (ClipperResult, Privacy, CaseResult, StepResult, SumCheck, DivisorCheck, NoiseCheck,
           NoisyUpdateCheck)


def without_clipped_sum(src, dst):
    """`src` with its claimed clipped sum dropped: an update under noise judged alone."""
    with safe_open(str(src), "np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("claimed.clipped_sum.")}
    assert len(tensors) < len(safe_open(str(src), "np").keys())
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    """The compiled module's own report documents, each beside the `Report` read from it."""
    noisy = without_clipped_sum(STEP_TRACES / "hooks_tied_gpt2_sigma1.safetensors",
                                tmp_path_factory.mktemp("mirror") / "update_only_sigma1.safetensors")
    docs = [
        _native.audit(clippers=["ghost-tied"]),
        _native.check(str(STEP_TRACES / "ghost_llama_sigma0.safetensors")),
        _native.check(str(STEP_TRACES / "hooks_tied_gpt2_sigma1.safetensors")),
        _native.check(str(noisy)),
        _native.mutants(),
    ]
    return [(d, Report(d)) for d in docs]


def documents(native, report):
    """(judge document, its mirror) for every document of a report, nested ones included."""
    for c, clipper in zip(native["clippers"], report.clippers, strict=True):
        yield c, clipper
        yield c["privacy"], clipper.privacy
        for k, case in zip(c["cases"], clipper.cases, strict=True):
            yield k, case
            s = k.get("step")
            if s is None:
                assert case.step is None
                continue
            yield s, case.step
            for key, mirror in (("clipped_sum", case.step.clipped_sum), ("update", case.step.update),
                                ("divisor", case.step.divisor), ("noisy_update", case.step.noisy_update)):
                if s[key] is None:
                    assert mirror is None, key
                else:
                    yield s[key], mirror
            yield from zip(s["noise"], case.step.noise, strict=True)
            if s["noisy_update"] is not None:
                yield s["noisy_update"]["residual"], case.step.noisy_update.residual


def fields_for(cls, keys):
    """The fields `cls` must have for a judge document with `keys`: the same names, with the
    departures `_report.py` declares."""
    expected = set(keys)
    if cls is CaseResult:
        expected = expected - {"examples"} | set(EXAMPLE_COLUMNS.values())
    if cls is StepResult:
        expected |= {"batch_divisor"}  # the trace header's, handed over by `check`
    if cls is ClipperResult:
        expected |= set(KILL_MATRIX_ROW.values())
    return expected


def same(value, judged):
    """A mirrored value equals the judge's: None as None, NaN (an undefined figure) or +∞ (an ε
    that no setting holds), lists as tuples or read-only arrays."""
    if judged is None:
        return value is None or isinstance(value, float) and (math.isnan(value) or value == math.inf)
    if isinstance(judged, list):
        if isinstance(value, np.ndarray):
            expected = np.array([math.nan if x is None else x for x in judged], dtype=value.dtype)
            return not value.flags.writeable and np.array_equal(value, expected, equal_nan=value.dtype.kind == "f")
        return list(value) == judged
    return value == judged


def nested(judged):
    """A document of its own (checked as its own pair), not a figure."""
    return isinstance(judged, dict) or isinstance(judged, list) and any(isinstance(x, dict) for x in judged)


def test_every_judge_key_is_a_field_under_its_name_and_every_field_a_key(natives):
    keys = defaultdict(set)
    example_keys = set()
    for native, report in natives:
        for doc, mirror in documents(native, report):
            assert type(mirror) in MIRRORS, type(mirror)
            keys[type(mirror)] |= set(doc)
        for c in native["clippers"]:
            for k in c["cases"]:
                for e in k["examples"]:
                    example_keys |= set(e)
    assert set(keys) == set(MIRRORS), f"not met in the reports: {set(MIRRORS) - set(keys)}"
    problems = []
    for cls, judged in keys.items():
        have = {f.name for f in dataclasses.fields(cls)}
        want = fields_for(cls, judged)
        if have != want:
            problems.append(f"{cls.__name__}: the judge's {sorted(want - have)} missing, "
                            f"{sorted(have - want)} not the judge's")
    if example_keys != set(EXAMPLE_COLUMNS):
        problems.append(f"EXAMPLE_COLUMNS: the judge's {sorted(example_keys - set(EXAMPLE_COLUMNS))} missing, "
                        f"{sorted(set(EXAMPLE_COLUMNS) - example_keys)} not the judge's")
    assert not problems, "\n".join(problems)


def test_every_field_holds_the_judge_figure_of_its_name(natives):
    compared = defaultdict(set)
    for native, report in natives:
        for doc, mirror in documents(native, report):
            for key, judged in doc.items():
                if nested(judged) or (type(mirror) is NoiseCheck and key == "scope"):
                    continue
                assert same(getattr(mirror, key), judged), (type(mirror).__name__, key, getattr(mirror, key), judged)
                compared[type(mirror)].add(key)
            if isinstance(mirror, NoiseCheck):
                scope = doc["scope"]
                assert mirror.scope == (None if scope == "whole" else scope["tensor"])
                assert mirror.whole == (scope == "whole")
            if isinstance(mirror, CaseResult):
                for key, column in EXAMPLE_COLUMNS.items():
                    assert same(getattr(mirror, column), [e[key] for e in doc["examples"]]), column
    # The figures the issue found missing are among those compared, with values.
    assert {"base_case", "c_multiplier", "clipped_sum_bound", "clipped_sum_rel_err",
            "max_sensitivity_ratio"} <= compared[CaseResult]
    assert {"coefficient_high"} <= compared[SumCheck] and {"stated", "drawn", "spread"} <= compared[DivisorCheck]


def test_kill_matrix_rows_are_the_judge_rows_under_the_declared_names(natives):
    (native, report), = [(n, r) for n, r in natives if n["kind"] == "mutants"]
    doc = json.loads(report.to_json())
    assert len(native["rows"]) == len(report.clippers) == len(doc["rows"])
    for row, written, clipper in zip(native["rows"], doc["rows"], report.clippers, strict=True):
        # The rows Python reads are the rows of the document the CLI writes.
        assert row == written
        assert set(row) == set(KILL_MATRIX_ROW)
        for key, name in KILL_MATRIX_ROW.items():
            value = getattr(clipper, name)
            # A row's `cases` (verdict per base case) is a mapping; every other figure a value.
            assert value == row[key] if isinstance(row[key], dict) else same(value, row[key]), (key, value)
    assert report.passed == native["ok"] == all(c.ok for c in report.clippers)


def test_case_documents_are_those_of_the_written_json(natives):
    for native, report in natives:
        if native["kind"] == "mutants":
            continue
        written = json.loads(report.to_json())
        for c, w in zip(native["clippers"], written["clippers"], strict=True):
            assert [set(k) for k in c["cases"]] == [set(k) for k in w["cases"]]
            assert [k["case"] for k in c["cases"]] == [k["case"] for k in w["cases"]]


class Reading(dict):
    """A native report that records which of its keys are read."""

    def __init__(self, d):
        super().__init__(d)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def test_report_reads_every_key_the_compiled_module_hands_over(natives):
    for native, _ in natives:
        reading = Reading(native)
        Report(reading)
        assert reading.read >= set(native), (native["kind"], sorted(set(native) - reading.read))


def test_judge_names_and_their_deprecated_spellings(natives):
    def report_of(trace):
        (found,) = [(n, r) for n, r in natives if str(n.get("trace", "")).endswith(trace)]
        return found

    native, report = report_of("hooks_tied_gpt2_sigma1.safetensors")
    _, update_report = report_of("ghost_llama_sigma0.safetensors")
    case = report.worst
    judged = native["clippers"][0]["cases"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the judge's names never warn
        assert case.case == judged["case"] and case.base_case == judged["base_case"]
        assert case.max_sensitivity_ratio == judged["max_sensitivity_ratio"] == report.max_sensitivity_ratio
        noise = case.step.noise
        divisor = update_report.step.divisor
        assert divisor is not None and divisor.implied > 0
    # max c·n*/C, from the per-example figures: the ratio is their maximum.
    assert case.max_sensitivity_ratio == pytest.approx(max(e["sensitivity"] for e in judged["examples"]))
    aliases = [
        (lambda: case.name, judged["case"]),
        (lambda: case.max_sensitivity, judged["max_sensitivity_ratio"]),
        (lambda: report.max_sensitivity, judged["max_sensitivity_ratio"]),
        (lambda: [n.param for n in noise], [None if n["scope"] == "whole" else n["scope"]["tensor"]
                                            for n in judged["step"]["noise"]]),
        (lambda: update_report.step.implied_divisor, divisor.implied),
        (lambda: update_report.step.data_dependent_divisor, divisor.data_dependent),
    ]
    for read, expected in aliases:
        with pytest.warns(DeprecationWarning, match="is deprecated and goes in 0.2: use"):
            assert read() == expected
