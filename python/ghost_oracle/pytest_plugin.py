"""ghost-oracle's pytest plugin (the `pytest11` entry point `ghost_oracle`): session fixtures
with a tiny tied model, its batch, its per-example loss and its exact per-example norms
(`ghost_oracle.testing.TiedCase`), and shadow mode for any test suite:

    pytest --ghost-oracle --pyargs opacus.tests.grad_samples      # a wrong computation fails its test
    pytest --ghost-oracle=report --ghost-oracle-report r.jsonl ...  # record only

It imports torch, transformers and Opacus only when a test asks for a fixture or shadow mode is
on, so that installing the package costs a test run that uses none of them nothing."""
from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ghost_oracle.shadow import Shadow
    from ghost_oracle.testing import TiedCase

_SESSION = pytest.StashKey["Shadow"]()
_STARTED = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ghost-oracle")
    group.addoption("--ghost-oracle", action="store", nargs="?", const="fail", default=None,
                    choices=("fail", "report"), dest="ghost_oracle",
                    help="shadow mode: judge every per-example gradient computation a DP library (Opacus) makes; "
                         "a wrong one fails its test (=report: record only)")
    group.addoption("--ghost-oracle-report", action="store", default=None, metavar="PATH",
                    dest="ghost_oracle_report", help="with --ghost-oracle: one JSON line per computation seen")
    group.addoption("--ghost-oracle-max-params", action="store", type=int, default=None, metavar="N",
                    dest="ghost_oracle_max_params",
                    help="with --ghost-oracle: skip computations on modules with more trainable parameters")


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("ghost_oracle")
    path = config.getoption("ghost_oracle_report")
    if mode is None:
        if path is not None:
            raise pytest.UsageError("--ghost-oracle-report needs --ghost-oracle")
        return
    from ghost_oracle.shadow import DEFAULT_MAX_PARAMS, Shadow

    limit = config.getoption("ghost_oracle_max_params")
    session = Shadow(on_failure="record", report=path, max_params=DEFAULT_MAX_PARAMS if limit is None else limit)
    config.stash[_SESSION] = session.__enter__()
    config.stash[_STARTED] = time.perf_counter()


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None:
        session.__exit__(None, None, None)
        del config.stash[_SESSION]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    __tracebackhide__ = True  # the failure is the test's, not the plugin's
    session = item.config.stash.get(_SESSION, None)
    if session is None:
        return (yield)
    session.set_test(item.nodeid)
    first = len(session.outcomes)
    try:
        result = yield
    finally:
        session.flush()  # the test's last computations (on_failure="record": never raises)
    failed = [o for o in session.outcomes[first:] if o.failed]
    if failed:
        from ghost_oracle.shadow.computation import describe

        text = "\n\n".join(describe(o) + "\n" + (o.explanation or "") for o in failed)
        item.add_report_section("call", "ghost-oracle", text)
        if item.config.getoption("ghost_oracle") == "fail":
            raise AssertionError(f"ghost-oracle: {len(failed)} per-example gradient computation(s) of this test "
                                 f"judged wrong\n\n{text}")
    return result


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    session.flush()
    terminalreporter.section("ghost-oracle shadow mode")
    for line in session.summary.lines(session.seconds):
        terminalreporter.write_line(line)
    path = config.getoption("ghost_oracle_report")
    if path:
        terminalreporter.write_line(f"report: {path}")


@pytest.fixture
def ghost_oracle_shadow() -> Generator[Shadow, None, None]:
    """Shadow mode for one test: a computation judged wrong raises `ShadowCheckFailed` from the
    `backward()` after which it was judged."""
    from ghost_oracle.shadow import Shadow

    with Shadow(on_failure="raise") as session:
        yield session


@pytest.fixture(scope="session")
def tied_gpt2() -> TiedCase:
    """GPT-2 (float32, training mode), its lm_head tied to `transformer.wte.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.gpt2(), t.gpt2_ids(), t.gpt2_loss, "transformer.wte.weight")


@pytest.fixture(scope="session")
def tied_llama() -> TiedCase:
    """Llama (float64, grouped-query attention), its lm_head tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.llama(), t.llama_ids(), t.llama_loss, "model.embed_tokens.weight")


@pytest.fixture(scope="session")
def tied_qwen3() -> TiedCase:
    """Qwen3 (float64, per-head q/k norms), its lm_head tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.qwen3(), t.lm_ids(), t.lm_loss, "model.embed_tokens.weight")


@pytest.fixture(scope="session")
def tied_gemma3() -> TiedCase:
    """Gemma 3 (float64, scaled embedding, (1 + w) norms, sliding and full attention), its lm_head
    tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.gemma3(), t.lm_ids(), t.lm_loss, "model.embed_tokens.weight")
