"""Every public argument and attribute renamed keeps its old spelling for one minor version
(`ghost_oracle._deprecated`): the old spelling warns with a `DeprecationWarning` naming the new
one and does what the new one does, both spellings at once are a `TypeError` naming both, and
the aliases go when the package reaches `REMOVED_IN`.

The renames (from the history of python/ghost_oracle; the report's own field renames are
held in test_report_mirror.py):
- `ghost_oracle.torch.assert_update(stabilizer=)` → `clip_stabilizer=`
- `ghost_oracle.audit(dtype=)` and `ghost_oracle.mutants(dtype=)` → `precision=`
- `Report.dtype` → `Report.precision`
"""
import re
import warnings

import pytest
from conftest import REPO

import ghost_oracle
from ghost_oracle._deprecated import REMOVED_IN, RenamedAttribute, renamed_keywords

torch = pytest.importorskip("torch")

CASE = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"


def test_the_aliases_go_in_the_version_they_name():
    version = tuple(int(p) for p in ghost_oracle.__version__.split(".")[:2])
    assert version < tuple(int(p) for p in REMOVED_IN.split(".")), (
        f"ghost_oracle {ghost_oracle.__version__} has reached {REMOVED_IN}: remove the deprecated spellings")


# ---------------------------------------------------------------------------------------------
# assert_update(stabilizer=): a step whose coefficients only a large γ explains.


def linear_step(gamma):
    """A linear model, its batch, C, and the unnoised DP-SGD step with stabilizer γ, from an
    autograd loop over the examples (each example's gradient alone): c_i = min(1, C / (n_i + γ))."""
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))

    def loss(m, xs):
        return torch.nn.functional.cross_entropy(m(xs), y[: xs.shape[0]], reduction="none")

    grads = []
    for i in range(6):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gi.values())) for gi in grads])
    c = float(norms.median())
    coef = torch.clamp(c / (norms + gamma), max=1.0)
    clipped = {n: sum(coef[i] * grads[i][n] for i in range(6)) for n, _ in model.named_parameters()}
    update = {n: v / 6 for n, v in clipped.items()}
    model.zero_grad()
    return model, loss, x, c, clipped, update


def assert_update(model, loss, x, c, clipped, update, **kw):
    return ghost_oracle.torch.assert_update(model, loss, x, update, clipped_sum=clipped, max_grad_norm=c,
                                            noise_multiplier=0.0, batch_divisor=6, **kw)


def test_assert_update_takes_stabilizer_as_clip_stabilizer():
    step = linear_step(gamma=0.5)
    with pytest.warns(DeprecationWarning, match=r"ghost_oracle\.torch\.assert_update\(stabilizer=\) is deprecated "
                                                r"and goes in 0\.2: use clip_stabilizer="):
        report = assert_update(*step, stabilizer=0.5)
    assert report.passed
    # the value reached the judge: the same step without γ is wrong
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(AssertionError):
            assert_update(*step)


def test_assert_update_refuses_both_spellings():
    step = linear_step(gamma=0.5)
    with pytest.raises(TypeError, match=r"assert_update\(\) got both clip_stabilizer= and its deprecated spelling "
                                        r"stabilizer=: pass clip_stabilizer= only"):
        assert_update(*step, stabilizer=0.5, clip_stabilizer=0.5)


# ---------------------------------------------------------------------------------------------
# audit(dtype=), mutants(dtype=), Report.dtype.


def test_audit_takes_dtype_as_precision_and_the_report_reads_dtype_as_precision():
    f32 = ghost_oracle.audit(CASE, CASE / "batch.safetensors", clippers=["ghost-tied"])
    with pytest.warns(DeprecationWarning, match=r"ghost_oracle\.audit\(dtype=\) is deprecated and goes in 0\.2: "
                                                r"use precision="):
        old = ghost_oracle.audit(CASE, CASE / "batch.safetensors", clippers=["ghost-tied"], dtype="f16")
    new = ghost_oracle.audit(CASE, CASE / "batch.safetensors", clippers=["ghost-tied"], precision="f16")
    assert old.precision == "f16" and old.to_json() == new.to_json()
    assert old.max_bound > 10 * f32.max_bound  # the bound of a coarser arithmetic: f16 reached the audit
    with pytest.warns(DeprecationWarning, match=r"ghost_oracle\.Report\.dtype is deprecated and goes in 0\.2: use "
                                                r"ghost_oracle\.Report\.precision"):
        assert old.dtype == "f16"
    with pytest.raises(TypeError, match=r"audit\(\) got both precision= and its deprecated spelling dtype="):
        ghost_oracle.audit(CASE, CASE / "batch.safetensors", clippers=["ghost-tied"], dtype="f16", precision="f16")


def test_mutants_takes_dtype_as_precision():
    with pytest.warns(DeprecationWarning, match=r"ghost_oracle\.mutants\(dtype=\) is deprecated"):
        old = ghost_oracle.mutants(dtype="f64")
    assert old.precision == "f64" and old.passed
    assert old.to_json() == ghost_oracle.mutants(precision="f64").to_json()
    with pytest.raises(TypeError, match=r"mutants\(\) got both precision= and its deprecated spelling dtype="):
        ghost_oracle.mutants(dtype="f64", precision="f64")


# ---------------------------------------------------------------------------------------------
# The helpers themselves, on functions and classes of their own.


def test_a_rename_to_an_argument_the_function_lacks_is_refused_at_once():
    with pytest.raises(TypeError, match=r"has no argument clip_stabiliser to rename to"):
        @renamed_keywords(stabilizer="clip_stabiliser")
        def f(*, clip_stabilizer=0.0):
            return clip_stabilizer


def test_the_new_spelling_and_positional_arguments_pass_through_without_a_warning():
    @renamed_keywords(old="new")
    def f(a, *, new=1):
        return a, new

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(2) == (2, 1) and f(2, new=3) == (2, 3)
    with pytest.warns(DeprecationWarning) as seen:
        assert f(2, old=4) == (2, 4)
    # the warning points at the caller's line, not the helper's
    assert seen[0].filename == __file__


def test_a_renamed_attribute_reads_and_sets_the_new_one():
    class Thing:
        old = RenamedAttribute("new")

        def __init__(self):
            self.new = 1

    t = Thing()
    with pytest.warns(DeprecationWarning, match=re.escape("Thing.old is deprecated and goes in 0.2: use ")):
        assert t.old == 1
    with pytest.warns(DeprecationWarning):
        t.old = 5
    assert t.new == 5 and isinstance(Thing.old, RenamedAttribute)


def test_a_renamed_attribute_follows_a_path_and_reads_missing_where_a_step_is_none():
    class Inner:
        value = 3

    class Outer:
        old = RenamedAttribute("inner.value", missing=False)

        def __init__(self, inner):
            self.inner = inner

    with pytest.warns(DeprecationWarning, match=re.escape("Outer.old is deprecated and goes in 0.2: use ")) as seen:
        assert Outer(Inner()).old == 3
    assert seen[0].filename == __file__  # the caller's line
    with pytest.warns(DeprecationWarning):
        assert Outer(None).old is False
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError, match=r"Outer\.old cannot be set"):
        Outer(None).old = 1


def test_the_moved_exporter_module_keeps_its_names_with_a_warning():
    import ghost_oracle.export as moved
    import ghost_oracle.torch

    for name in moved.__all__:
        with pytest.warns(DeprecationWarning, match=re.escape(
                f"ghost_oracle.export.{name} is deprecated and goes in 0.2: use ghost_oracle.torch.{name}")) as seen:
            assert getattr(moved, name) is getattr(ghost_oracle.torch, name)
        assert seen[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'made_up'"):
        moved.made_up  # noqa: B018
