"""The handlers' one registry: module and functional forms registered together, content that does
not depend on the order the kind files are imported in, the list of what is modelled generated
from it; a handler written against the interface before `Site` (yielding (spec, tensors) pairs,
reading `use.entry`) still works, with a DeprecationWarning; and a functional form's handler
that is off by 0.1 % is refused by the self-check against autograd.

    python3 -m pytest python/tests/test_kinds_registry.py
"""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import ghost_oracle.torch as E
from ghost_oracle.torch.kinds import base
from ghost_oracle.torch.kinds.linear import FnLinear, Linear

B, T, D = 3, 4, 5


def loss(model, x):
    return model(x).pow(2).sum((1, 2))


def inputs():
    return torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def export(model, path):
    return E.export_trace(model, loss, inputs(), str(path), claimed_norms=[1.0] * B, max_grad_norm=1.0)


class BareParameters(torch.nn.Module):
    """A linear map through `F.linear` on bare parameters: the functional form's use."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64, generator=g))
        self.b = torch.nn.Parameter(torch.randn(D, dtype=torch.float64, generator=g))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


def test_the_registry_does_not_depend_on_the_order_the_kind_files_are_imported_in():
    # Each order re-runs the kind files' registrations into an emptied registry (in a fresh
    # process: a reload replaces the handler classes), and what it holds, what register_module
    # accepts (KINDS, in order) and what the messages list must be the same.
    script = textwrap.dedent("""
        import importlib, pkgutil, random
        import ghost_oracle.torch.kinds as K
        from ghost_oracle.torch.kinds import base

        def snapshot():
            return (sorted((c.__qualname__, type(h).__qualname__) for c, h in base._BUILTIN.items()),
                    sorted((what, type(h).__qualname__) for what, (_, h) in base._BY_TEST.items()),
                    sorted((name, type(h).__qualname__) for name, h in base._FUNCTIONS.values()),
                    base.kinds(), base.modelled())

        # every kind file of the package, found rather than listed: a new one cannot be left out
        files = [importlib.import_module(f"{K.__name__}.{m.name}") for m in pkgutil.iter_modules(K.__path__)
                 if m.name != "base"]
        assert len(files) >= 10, files
        first = snapshot()
        assert first[3] == ("linear", "conv1d", "embedding", "layernorm"), first[3]
        assert len(first[2]) >= 15 and len(first[0]) >= 15, first
        orders = [files[::-1]] + [random.Random(seed).sample(files, len(files)) for seed in range(4)]
        for order in orders:
            for registry in (base._BUILTIN, base._BY_TEST, base._KINDS, base._FUNCTIONS):
                registry.clear()
            for f in order:
                importlib.reload(f)
            assert snapshot() == first, ([f.__name__ for f in order], snapshot(), first)
        print("same", len(orders))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "same 5"


def test_a_class_or_function_registered_twice_is_an_error():
    with pytest.raises(RuntimeError, match="registered twice"):
        base.builtin(torch.nn.Linear, Linear())
    with pytest.raises(RuntimeError, match="registered twice"):
        base.builtin_function("F.linear", F.linear, FnLinear())
    assert type(base.handler_for(torch.nn.Linear(2, 2))) is Linear  # the first registration stands


def test_a_module_two_name_tests_claim_is_refused(monkeypatch):
    class ToyRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(D)), 1e-6

    assert base.handler_for(ToyRMSNorm()) is not None
    monkeypatch.setitem(base._BY_TEST, "anything with a weight", (lambda m: hasattr(m, "weight"), Linear()))
    with pytest.raises(E.TraceExportError, match="ToyRMSNorm is claimed by several handlers"):
        base.handler_for(ToyRMSNorm())


def test_what_is_modelled_in_the_message_is_the_registry(tmp_path, monkeypatch):
    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(D, dtype=torch.float64))

        def forward(self, x):
            return x * self.gain

    with pytest.raises(E.TraceExportError) as e:
        export(Gain(), tmp_path / "t.safetensors")
    message = str(e.value)
    assert "parameter `gain`" in message and "has no site" in message
    listed = base.modelled()
    for name in listed["module classes"] + listed["classes known by name"] + listed["functions"]:
        assert name in message, name
    # A function form registered later is in the next message: the list is not hand-kept.
    monkeypatch.setitem(base._FUNCTIONS, object(), ("torch.made_up_form", FnLinear()))
    with pytest.raises(E.TraceExportError, match="torch.made_up_form"):
        export(Gain(), tmp_path / "t.safetensors")
    assert not (tmp_path / "t.safetensors").exists()


def test_a_functional_form_off_by_a_thousandth_is_refused_by_the_self_check(tmp_path, monkeypatch):
    specs = export(BareParameters(), tmp_path / "ok.safetensors")
    assert {(s["name"], s["kind"]) for s in specs} == {("w", "linear"), ("b", "bias")}
    right = FnLinear.sites

    def scaled(self, use):
        for site in right(self, use):
            site.tensors = {k: 1.001 * v if k == "backprops" else v for k, v in site.tensors.items()}
            yield site

    monkeypatch.setattr(FnLinear, "sites", scaled)
    with pytest.raises(E.TraceExportError, match=r"parameter `(w|b)`.*differs from autograd"):
        export(BareParameters(), tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


class Scaled(torch.nn.Module):
    """y = s·(x Wᵀ): a class no kind describes, traced by a handler of its own."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.weight = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64, generator=g))
        self.scale = 3.0

    def forward(self, x):
        return self.scale * (x @ self.weight.T)


class SiteHandler(E.Handler):
    """A user's handler as docs/python.md shows it: `use.site`."""

    def __init__(self, off=1.0):
        self.off = off

    def sites(self, use):
        g = use.per_example(use.grad, "output gradient") * use.module.scale * self.off
        x = use.per_example(use.input, "input")
        yield use.site("weight", "linear", {"activations": x.to(use.store), "backprops": g.to(use.store)})


class PairHandler(E.Handler):
    """A user's handler written before `Site`: (spec, tensors) pairs, the input read from
    `use.entry`."""

    def __init__(self, off=1.0):
        self.off = off

    def sites(self, use):
        g = use.per_example(use.grad, "output gradient") * use.module.scale * self.off
        x = use.per_example(use.entry["input"], "input")
        yield use.spec("weight", "linear"), {"activations": x.to(use.store), "backprops": g.to(use.store)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the pairs' warning is asserted where it counts
@pytest.mark.parametrize("handler", [SiteHandler, PairHandler])
def test_a_users_handler_traces_its_class_and_one_off_by_a_thousandth_is_refused(handler, tmp_path):
    E.register_module(Scaled, handler())
    try:
        if handler is PairHandler:
            with pytest.warns(DeprecationWarning) as caught:
                specs = export(Scaled(), tmp_path / "ok.safetensors")
            said = " ".join(str(w.message) for w in caught)
            assert "use.entry is deprecated" in said.lower() and "yields (spec, tensors) pairs" in said
        else:
            specs = export(Scaled(), tmp_path / "ok.safetensors")
        assert [(s["param"], s["kind"]) for s in specs] == [("weight", "linear")]
        E.register_module(Scaled, handler(off=1.001))
        with pytest.raises(E.TraceExportError, match=r"parameter `weight`.*differs from autograd"):
            export(Scaled(), tmp_path / "bad.safetensors")
        assert not (tmp_path / "bad.safetensors").exists()
    finally:
        E.unregister_module(Scaled)


def test_a_pair_of_an_unknown_site_kind_is_refused_naming_the_handler(tmp_path):
    class Odd(PairHandler):
        def sites(self, use):
            for spec, ts in super().sites(use):
                yield {**spec, "kind": "rmsnorm"}, ts

    E.register_module(Scaled, Odd())
    try:
        with pytest.warns(DeprecationWarning), pytest.raises(E.TraceExportError, match=r"handler Odd yields a site "
                                                                                         r"of kind 'rmsnorm'"):
            export(Scaled(), tmp_path / "t.safetensors")
    finally:
        E.unregister_module(Scaled)
