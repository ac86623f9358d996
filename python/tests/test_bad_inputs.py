"""Bad input, a table (docs/python.md, "Bad input"): each row calls `export_trace`,
`assert_norms`, `assert_update`, `check` or a Flax twin with one bad input, and asserts the
exception's type, that its message names the argument, module, parameter or path, that it is
raised by the package (the traceback's last frame is in ghost_oracle, never in torch, numpy,
safetensors or the native module), and that nothing was written. The rows that work (B = 1,
some parameters frozen, non-contiguous inputs) are checked against brute-force per-example
gradients instead.

    python python/tests/test_bad_inputs.py     # prints the table's rows as docs/python.md has them

Rows covered by python/tests/test_errors.py are not repeated here; the docs' table names them."""
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ghost_oracle
from ghost_oracle.torch import TraceExportError, assert_norms, assert_update, export_trace

PACKAGE = Path(ghost_oracle.__file__).resolve().parent
B, F, H = 4, 3, 2


def mlp(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(F, H), torch.nn.Tanh()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(H, 2))
    return torch.nn.Sequential(*layers).double().eval()


def batch(b: int = B) -> torch.Tensor:
    return torch.randn(b, F, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum(1)


def brute_norms(model: torch.nn.Module, x: torch.Tensor) -> list[float]:
    """Each example's gradient norm over the trainable parameters, one backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model, x[i:i + 1]).sum(), params)
        out.append(math.sqrt(sum(float((g ** 2).sum()) for g in grads)))
    return out


def export(tmp: Path, model: Any = None, x: Any = None, claims: Any = None, fn: Any = loss, path: Any = None,
           **kw: Any) -> Any:
    model = mlp() if model is None else model
    x = batch() if x is None else x
    claims = [1.0] * (x.shape[0] if torch.is_tensor(x) else B) if claims is None else claims
    kw.setdefault("max_grad_norm", 1.0)
    return export_trace(model, fn, x, tmp / "t.safetensors" if path is None else path, claimed_norms=claims, **kw)


def _with(model: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    fn(model)
    return model


def _nan_weight(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m[0].weight[0, 0] = math.nan


def _inf_weight(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m[2].bias[1] = math.inf


def _freeze_all(m: torch.nn.Module) -> None:
    m.requires_grad_(False)


def _x_with(value: float) -> torch.Tensor:
    x = batch()
    x[2, 1] = value
    return x


def _update(model: torch.nn.Module, leave_out: str | None = None, alias: bool = False) -> dict[str, torch.Tensor]:
    u = {n: torch.zeros_like(p) for n, p in model.named_parameters() if n != leave_out}
    return u


def _tied() -> torch.nn.Module:
    m = mlp()
    m.add_module("head", torch.nn.Linear(2, 2).double())
    m[2].weight = m.head.weight = torch.nn.Parameter(torch.eye(2, dtype=torch.float64))
    return m


def _raise_user_error(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    raise UserError("the loss of my own")


class UserError(Exception):
    pass


def _read_only_dir() -> Path:
    """A directory no file can be created in, whoever runs the test (root included): sysfs
    refuses every new file."""
    return Path("/sys")


# ---------------------------------------------------------------------------------------------
# Flax twins.


def _flax() -> Any:
    jax = pytest.importorskip("jax")
    nn = pytest.importorskip("flax.linen")
    from ghost_oracle import jax as gj

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(2)(nn.tanh(nn.Dense(H)(x)))

    model = Mlp()
    x = np.asarray(batch(), dtype=np.float32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def jloss(apply: Any, xx: Any) -> Any:
        return (apply(xx) ** 2).sum(1)

    return gj, model, params, jloss, x


def jexport(tmp: Path, x: Any = None, claims: Any = None, path: Any = None, fn: Any = None, **kw: Any) -> Any:
    gj, model, params, jloss, x0 = _flax()
    x = x0 if x is None else x
    claims = [1.0] * len(x) if claims is None else claims
    kw.setdefault("max_grad_norm", 1.0)
    return gj.export_trace(model, params, jloss if fn is None else fn, x, tmp / "t.safetensors" if path is None
                           else path, claimed_norms=claims, **kw)


def _jx_with(value: float) -> np.ndarray:
    x = np.asarray(batch(), dtype=np.float32)
    x[1, 0] = value
    return x


def _jassert_update_missing(tmp: Path) -> Any:
    gj, model, params, jloss, x = _flax()
    update = {"Dense_1.kernel": np.zeros((F, H), np.float32)}  # the first layer (flax names Dense(2) first)
    return gj.assert_update(model, params, jloss, x, update, max_grad_norm=1.0, noise_multiplier=0.0,
                            batch_divisor=float(B))


# ---------------------------------------------------------------------------------------------
# The table.


@dataclass
class Row:
    input: str
    call: Callable[[Path], Any]
    exc: type[BaseException] | None  # None: it works
    names: tuple[str, ...] = ()  # what the message must name
    api: str = "export_trace"


ROWS = [
    Row("empty batch (B = 0)", lambda t: export(t, x=batch(0), claims=[]), ValueError,
        ("inputs", "the batch is empty")),
    Row("B = 1", lambda t: export(t, x=batch(1)), None),
    Row("NaN in the inputs", lambda t: export(t, x=_x_with(math.nan)), ValueError, ("inputs", "NaN", "[2, 1]")),
    Row("+inf in the inputs", lambda t: export(t, x=_x_with(math.inf)), ValueError, ("inputs", "inf")),
    Row("NaN in a weight", lambda t: export(t, model=_with(mlp(), _nan_weight)), ValueError,
        ("parameter `0.weight`", "NaN")),
    Row("+inf in a bias", lambda t: export(t, model=_with(mlp(), _inf_weight)), ValueError,
        ("parameter `2.bias`", "inf")),
    Row("every parameter frozen", lambda t: export(t, model=_with(mlp(), _freeze_all)), TraceExportError,
        ("frozen", "requires_grad=False")),
    Row("some parameters frozen (the first layer)", lambda t: export(t, model=_with(mlp(), lambda m:
        m[0].requires_grad_(False))), None),
    Row("train mode with dropout p > 0", lambda t: export(t, model=mlp(0.5).train()), TraceExportError,
        ("module `2`", "Dropout", "training mode", "model.eval()")),
    Row("integer inputs to a Linear", lambda t: export(t, x=batch().long()), TraceExportError,
        ("module `0`", "Linear", "int64")),
    Row("non-contiguous inputs (a transposed view)",
        lambda t: export(t, x=batch().t().contiguous().t()), None),
    Row("claimed_norms of the wrong length", lambda t: export(t, claims=[1.0] * (B + 1)), ValueError,
        ("claimed_norms", f"{B + 1} values", f"{B} examples")),
    Row("claimed_norms complex", lambda t: export(t, claims=torch.ones(B, dtype=torch.complex64)), TypeError,
        ("claimed_norms", "complex")),
    Row("claimed_norms boolean", lambda t: export(t, claims=[True] * B), TypeError, ("claimed_norms", "boolean")),
    Row("claimed_norms on the meta device", lambda t: export(t, claims=torch.ones(B, device="meta")), ValueError,
        ("claimed_norms", "meta")),
    Row("claimed_coefficients of strings", lambda t: export(t, claimed_coefficients=["a"] * B), TypeError,
        ("claimed_coefficients",)),
    Row("a model on the meta device", lambda t: export(t, model=mlp().to("meta")), TraceExportError,
        ("parameter `0.weight`", "meta device")),
    Row("model not an nn.Module", lambda t: export(t, model=lambda x: x), TypeError, ("model", "function")),
    Row("update missing a parameter", lambda t: export(t, update=_update(mlp(), leave_out="2.bias"),
                                                       batch_divisor=B, noise_multiplier=0.0), ValueError,
        ("update", "`2.bias`")),
    Row("a tied parameter given twice in update (two names, one tensor)",
        lambda t: export(t, model=_tied(), update={**_update(_tied()), "head.weight": torch.zeros(2, 2,
                                                                                         dtype=torch.float64)},
                         batch_divisor=B, noise_multiplier=0.0), ValueError, ("update", "given twice")),
    Row("update with a name the model lacks", lambda t: export(t, update={"nope": torch.zeros(1)}, batch_divisor=B),
        ValueError, ("update", "`nope`")),
    Row("update of dtype int64", lambda t: export(t, update={n: torch.zeros(p.shape, dtype=torch.long)
                                                             for n, p in mlp().named_parameters()},
                                                  batch_divisor=B), ValueError, ("update", "int64")),
    Row("update without batch_divisor", lambda t: export(t, update=_update(mlp())), ValueError,
        ("update needs batch_divisor",)),
    Row("trace path in a missing directory", lambda t: export(t, path=t / "no" / "such" / "t.safetensors"),
        FileNotFoundError, ("path", "no/such/t.safetensors", "does not exist")),
    Row("trace path in a read-only directory", lambda t: export(t, path=_read_only_dir() / "t.safetensors"),
        PermissionError, ("path", "/sys/t.safetensors", "cannot write in /sys")),
    Row("trace path that is a directory", lambda t: export(t, path=t), IsADirectoryError, ("path", "is a directory")),
    Row("trace path not a path (an int)", lambda t: export(t, path=3), TypeError, ("path", "int")),
    Row("trace_path of assert_norms in a missing directory",
        lambda t: assert_norms(mlp(), loss, batch(), [1.0] * B, max_grad_norm=1.0,
                               trace_path=t / "no" / "t.safetensors"), FileNotFoundError,
        ("trace_path", "does not exist"), api="assert_norms"),
    Row("a loss of shape B×T (not reduced per example)", lambda t: export(t, fn=lambda m, x: m(x)),
        ValueError, ("per_example_loss returned (4, 2)", "shape (4,)")),
    Row("max_grad_norm NaN", lambda t: export(t, max_grad_norm=math.nan), ValueError, ("max_grad_norm",)),
    Row("max_grad_norm negative", lambda t: export(t, max_grad_norm=-1.0), ValueError, ("max_grad_norm",)),
    Row("noise_multiplier negative (assert_update)",
        lambda t: assert_update(mlp(), loss, batch(), _update(mlp()), max_grad_norm=1.0, noise_multiplier=-0.5,
                                batch_divisor=B), ValueError, ("noise_multiplier",), api="assert_update"),
    Row("batch_divisor 0 (assert_update)",
        lambda t: assert_update(mlp(), loss, batch(), _update(mlp()), max_grad_norm=1.0, noise_multiplier=0.0,
                                batch_divisor=0), ValueError, ("batch_divisor",), api="assert_update"),
    Row("batch_axis 2", lambda t: export(t, batch_axis=2), ValueError, ("batch_axis",)),
    Row("a per_example_loss that raises", lambda t: export(t, fn=_raise_user_error), UserError,
        ("the loss of my own",)),
    # The Flax twins (ghost_oracle.jax).
    Row("empty batch (B = 0)", lambda t: jexport(t, x=np.zeros((0, F), np.float32), claims=[]), ValueError,
        ("inputs", "the batch is empty"), api="jax.export_trace"),
    Row("B = 1", lambda t: jexport(t, x=np.asarray(batch(1), dtype=np.float32)), None, api="jax.export_trace"),
    Row("NaN in the inputs", lambda t: jexport(t, x=_jx_with(math.nan)), ValueError, ("inputs", "NaN"),
        api="jax.export_trace"),
    Row("claimed_norms of the wrong length", lambda t: jexport(t, claims=[1.0] * 3), ValueError,
        ("claimed_norms", "3 entries"), api="jax.export_trace"),
    Row("claimed_norms complex", lambda t: jexport(t, claims=np.ones(B, np.complex64)), TypeError,
        ("claimed_norms", "complex"), api="jax.export_trace"),
    Row("claimed_norms strings", lambda t: jexport(t, claims=["a"] * B), TypeError, ("claimed_norms",),
        api="jax.export_trace"),
    Row("max_grad_norm 0", lambda t: jexport(t, max_grad_norm=0), ValueError, ("max_grad_norm",),
        api="jax.export_trace"),
    Row("noise_multiplier negative", lambda t: jexport(t, noise_multiplier=-1), ValueError, ("noise_multiplier",),
        api="jax.export_trace"),
    Row("dtype not a precision", lambda t: jexport(t, dtype="f8"), ValueError, ("dtype", "'f8'"),
        api="jax.export_trace"),
    Row("is_padding_example of the wrong shape", lambda t: jexport(t, is_padding_example=np.zeros(3, bool)),
        ValueError, ("is_padding_example", f"({B},)"), api="jax.export_trace"),
    Row("trace path in a missing directory", lambda t: jexport(t, path=t / "no" / "t.safetensors"),
        FileNotFoundError, ("path", "does not exist"), api="jax.export_trace"),
    Row("a loss of shape B×2", lambda t: jexport(t, fn=lambda apply, x: apply(x)), ValueError,
        ("per_example_loss returned shape (4, 2)",), api="jax.export_trace"),
    Row("update missing a parameter", _jassert_update_missing, ValueError, ("update", "`Dense_0.kernel`"),
        api="jax.assert_update"),
]

IDS = [f"{r.api}: {r.input}" for r in ROWS]


def _last_frame_file(exc: BaseException) -> str:
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_bad_input(tmp_path: Path, row: Row) -> None:
    before = sorted(os.listdir(tmp_path))
    if row.exc is None:
        specs = row.call(tmp_path)
        assert specs, "a trace with sites"
        return
    with pytest.raises(row.exc) as e:
        row.call(tmp_path)
    message = str(e.value)
    for name in row.names:
        assert name in message, f"the message lacks {name!r}: {message}"
    where = Path(_last_frame_file(e.value)).resolve()
    if row.exc is UserError:
        assert where == Path(__file__).resolve(), where  # the user's own, unchanged
    else:
        assert PACKAGE in where.parents, f"raised from {where}, not from the package"
    assert sorted(os.listdir(tmp_path)) == before, "something was written"


def test_b1_some_frozen_and_non_contiguous_are_judged_against_brute_force(tmp_path: Path) -> None:
    """The rows that work: each trace, checked with the brute-force norms as the claim, passes
    (the truth the judge computes from the trace is those norms); 1 % off on one example, it
    fails."""
    frozen = mlp()
    frozen[0].requires_grad_(False)
    view = batch().t().contiguous().t()
    assert not view.is_contiguous()
    for what, model, x in [("B = 1", mlp(), batch(1)), ("some frozen", frozen, batch()),
                           ("non-contiguous", mlp(), view)]:
        truth = brute_norms(model, x)
        path = tmp_path / f"{what}.safetensors"
        export_trace(model, loss, x, path, claimed_norms=truth, max_grad_norm=1.0)
        report = ghost_oracle.check(path)
        assert report.passed, (what, report)
        np.testing.assert_allclose(report.true_norms, truth, rtol=1e-12)
        off = [n * (1.01 if i == 0 else 1.0) for i, n in enumerate(truth)]
        export_trace(model, loss, x, path, claimed_norms=off, max_grad_norm=1.0)
        assert not ghost_oracle.check(path).passed, what


def print_table() -> None:
    """The table's rows as docs/python.md has them: | API | input | exception | message |."""
    import tempfile
    for row in ROWS:
        with tempfile.TemporaryDirectory() as d:
            try:
                row.call(Path(d))
                outcome, message = "works", "a trace; judged against brute force (test below the table)"
            except BaseException as e:  # noqa: B036 - the table shows whatever comes out
                outcome, message = type(e).__name__, str(e).replace(d, "…").replace("|", "\\|")
        print(f"| `{row.api}` | {row.input} | {outcome} | {message} |")


if __name__ == "__main__":
    print_table()
