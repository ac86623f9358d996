"""The Python package's layout, checked on its source (the twin of `tests/layout.rs`).

An AST scan of every module of `ghost_oracle` (`imports`) reads every import: at module level,
inside functions and classes, and under `if TYPE_CHECKING:`; relative ones resolved against
the importing module, `from pkg import name` taken as an import of the submodule `pkg.name`
where there is one, and `importlib.import_module("a.b")` with a name written out as an import
of `a.b` (a name computed at run time, as the package's lazy `__getattr__` forms it, cannot be
read from the source and is no arrow). The rules, each a function of the scanned graph so that it is
tested on tiny synthetic packages (each rule fails on a planted violation) and run on the real
package:

- `ghost_oracle._trace` is framework-neutral: none of its modules imports torch, jax, flax or
  ml_dtypes, directly or through another module of `ghost_oracle` it imports (any path of
  imports, whatever their place). That its modules import at run time nothing of those, the
  package's `__init__` included, is checked again by importing them in a fresh interpreter.
- `ghost_oracle.tied` (the tied-embedding clipper, a plugin of Opacus) imports nothing of
  `ghost_oracle` outside itself.
- The PyTorch front-end (`ghost_oracle.torch`, `ghost_oracle.opacus` and the parts of
  `ghost_oracle.shadow` that capture Opacus: `SHADOW_TORCH_PARTS`) and the JAX front-end
  (`ghost_oracle.jax`, `ghost_oracle.jax_privacy`) reach neither each other's modules nor each
  other's framework (torch/opacus against jax/flax/jax_privacy) through any path of imports.
- No import cycle among `ghost_oracle`'s modules, `TYPE_CHECKING` and function-level imports
  included. An arrow is an import the module writes. Importing `a.b.c` also runs the
  `__init__` of `a` and `a.b`, but that is no arrow: every package's `__init__` importing its
  own submodules (its facade) would otherwise be a cycle with each of them. A submodule that
  names its package (`from . import X` with X no submodule, `from .. import X`, `import a.b`
  for the package `a.b`) does draw an arrow to that `__init__`, so a package whose `__init__`
  imports a submodule that reads back from the `__init__` is a cycle: that is the circular
  import whose outcome depends on the order the `__init__` runs in.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "ghost_oracle"

TORCH_FRAMEWORK = frozenset({"torch", "opacus"})
JAX_FRAMEWORK = frozenset({"jax", "flax", "ml_dtypes", "jax_privacy", "optax"})
FRAMEWORKS = TORCH_FRAMEWORK | JAX_FRAMEWORK | {"transformers"}

#: The modules of `ghost_oracle.shadow` that capture Opacus (the rest is framework-neutral:
#: `ghost_oracle`'s `__init__` imports it). Held against the shadow modules that import a
#: framework themselves, so the list cannot go stale.
SHADOW_TORCH_PARTS = frozenset({
    "ghost_oracle.shadow.capture_opacus",
    "ghost_oracle.shadow.capture_opacus_optimizer",
    "ghost_oracle.shadow.hf",
    "ghost_oracle.shadow.judge",
    "ghost_oracle.shadow.surrogate",
})


# ---------------------------------------------------------------------------------------------
# The scanner.


@dataclass(frozen=True)
class Import:
    """One module a module imports: absolute, the deepest module of the scanned package it
    names (or, outside the package, the name as written), where it stands (`module`,
    `function`, `type-checking`) and its line."""

    importer: str
    target: str
    place: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target} ({self.place})"


def modules(root: Path) -> dict[str, Path]:
    """The modules of the package at `root` (a folder with an `__init__.py`), by dotted name:
    `pkg/a/__init__.py` is `pkg.a`, `pkg/a/b.py` is `pkg.a.b`; an extension module
    (`_native.abi3.so`) or a stub is a module without imports of its own."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        rel = path.relative_to(root.parent)
        stem = rel.name.split(".", 1)[0]
        if path.suffix not in (".py", ".pyi", ".so", ".pyd"):
            continue
        parts = [*rel.parts[:-1]] + ([] if stem == "__init__" else [stem])
        name = ".".join(parts)
        if path.suffix == ".py" or name not in out:
            out[name] = path
    return out


def _is_package(name: str, known: Mapping[str, Path]) -> bool:
    return known[name].name.startswith("__init__.")


def _deepest(name: str, known: Mapping[str, Path]) -> str:
    """The longest prefix of `name` that is a scanned module (`name` itself outside)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in known:
            return ".".join(parts[:k])
    return name


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_import(func: ast.expr) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    return (isinstance(func, ast.Name) and func.id in ("import_module", "__import__")) or (
        isinstance(func, ast.Attribute) and func.attr == "import_module")


def imports(name: str, source: str, known: Mapping[str, Path]) -> list[Import]:
    """Every import module `name` (of the scanned `known`) writes in `source`."""
    found: list[Import] = []
    package = name if name in known and _is_package(name, known) else name.rpartition(".")[0]

    def resolved(module: str | None, level: int, line: int) -> str:
        if level == 0:
            assert module is not None
            return module
        base = package.split(".")
        if level - 1 >= len(base) or not base[0]:
            raise ValueError(f"{name}:{line}: a relative import above the top-level package")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(node: ast.AST, place: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = place
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and place == "module":
                here = "function"
            if isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, "type-checking")
                for stmt in child.orelse:
                    visit_one(stmt, place)
                continue
            visit_one(child, here)

    def visit_one(node: ast.AST, place: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, _deepest(alias.name, known), place, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            module = resolved(node.module, node.level, node.lineno)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                target = sub if sub in known else _deepest(module, known)
                found.append(Import(name, target, place, node.lineno))
        elif isinstance(node, ast.Call) and _dynamic_import(node.func) and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append(Import(name, _deepest(node.args[0].value, known), place, node.lineno))
        visit(node, place)

    visit(ast.parse(source), "module")
    return found


def scan(root: Path) -> dict[str, list[Import]]:
    """Every module of the package at `root` and the imports it writes."""
    known = modules(root)
    return {name: (imports(name, path.read_text(), known) if path.suffix == ".py" else [])
            for name, path in known.items()}


# ---------------------------------------------------------------------------------------------
# The rules, on a scanned graph: each returns the violations, one line each.


def _inside(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def paths_to(graph: Mapping[str, list[Import]], start: str, bad: object) -> list[list[Import]]:
    """The shortest path of imports from module `start` to each import satisfying `bad`
    (called with the Import), following imports between scanned modules only."""
    out: list[list[Import]] = []
    seen = {start}
    frontier: list[tuple[str, list[Import]]] = [(start, [])]
    while frontier:
        nxt: list[tuple[str, list[Import]]] = []
        for module, path in frontier:
            for imp in graph.get(module, []):
                if bad(imp):  # type: ignore[operator]
                    out.append(path + [imp])
                elif imp.target in graph and imp.target not in seen:
                    seen.add(imp.target)
                    nxt.append((imp.target, path + [imp]))
        frontier = nxt
    return out


def _chain(path: list[Import]) -> str:
    return " → ".join([path[0].importer] + [f"{i.target} ({i.importer}:{i.line}, {i.place})" for i in path])


def framework_free(graph: Mapping[str, list[Import]], inside: str, frameworks: frozenset[str]) -> list[str]:
    """`inside` (a package) reaches none of `frameworks`, through any path of imports."""
    bad = [_chain(p) for m in graph if _inside(m, [inside])
           for p in paths_to(graph, m, lambda i: _top(i.target) in frameworks)]
    return sorted(set(bad))


def self_contained(graph: Mapping[str, list[Import]], inside: str, top: str) -> list[str]:
    """The modules of package `inside` import nothing of package `top` outside `inside`."""
    return [str(i) for m, imps in graph.items() if _inside(m, [inside]) for i in imps
            if _inside(i.target, [top]) and not _inside(i.target, [inside])]


def apart(graph: Mapping[str, list[Import]], one: Iterable[str], other: Iterable[str],
          one_framework: frozenset[str], other_framework: frozenset[str]) -> list[str]:
    """Modules under `one` reach no module under `other` nor `other_framework`, and the other
    way around, through any path of imports."""
    one, other = list(one), list(other)
    bad: list[str] = []
    for a, b, fw in ((one, other, other_framework), (other, one, one_framework)):
        for m in graph:
            if _inside(m, a):
                bad += [_chain(p) for p in paths_to(
                    graph, m, lambda i, b=b, fw=fw: _inside(i.target, b) or _top(i.target) in fw)]
    return sorted(set(bad))


def cycles(graph: Mapping[str, list[Import]]) -> list[str]:
    """Every cycle of imports among the scanned modules (Tarjan's strongly connected
    components of more than one module), each named by one of its loops."""
    arrows = {m: sorted({i.target for i in imps if i.target in graph and i.target != m}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in arrows[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    out = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        back = [p for p in paths_to({m: [i for i in graph[m] if i.target in members] for m in members}, start,
                                    lambda i, s=start: i.target == s)]
        out.append(f"cycle among {', '.join(component)}: {_chain(min(back, key=len))}")
    return out


# ---------------------------------------------------------------------------------------------
# The rules on the real package.

GRAPH = scan(PACKAGE_ROOT)
TORCH_SIDE = ["ghost_oracle.torch", "ghost_oracle.opacus", *sorted(SHADOW_TORCH_PARTS)]
JAX_SIDE = ["ghost_oracle.jax", "ghost_oracle.jax_privacy"]


def test_the_scan_reads_the_whole_package():
    # every module file is read, and the ones this file's rules name are there
    files = {p for p in PACKAGE_ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    assert len([m for m, p in modules(PACKAGE_ROOT).items() if p.suffix == ".py"]) == len(files)
    for name in ("ghost_oracle", "ghost_oracle._trace", "ghost_oracle._trace.site", "ghost_oracle.tied",
                 "ghost_oracle.torch", "ghost_oracle.torch.trace", "ghost_oracle.jax", "ghost_oracle.jax.trace",
                 "ghost_oracle.opacus", "ghost_oracle.jax_privacy", "ghost_oracle._native", *SHADOW_TORCH_PARTS):
        assert name in GRAPH, name
    # and it sees imports of every place: the front-ends import their frameworks at module
    # level, the shadow judge inside functions, and the package reads its native module
    places = {i.place for imps in GRAPH.values() for i in imps}
    assert {"module", "function"} <= places
    assert any(i.target == "ghost_oracle._native" for i in GRAPH["ghost_oracle"])
    assert any(i.target == "ghost_oracle.torch" and i.place == "function" for i in GRAPH["ghost_oracle.shadow.judge"])


def test_the_shadow_torch_parts_are_the_shadow_modules_that_import_a_framework():
    direct = {m for m, imps in GRAPH.items() if _inside(m, ["ghost_oracle.shadow"])
              and any(_top(i.target) in FRAMEWORKS | {"ghost_oracle"} and (
                  _top(i.target) in FRAMEWORKS or _inside(i.target, ["ghost_oracle.torch"])) for i in imps)}
    assert direct == SHADOW_TORCH_PARTS


def test_trace_core_imports_no_framework():
    assert framework_free(GRAPH, "ghost_oracle._trace", frozenset({"torch", "jax", "flax", "ml_dtypes"})) == []


def test_trace_core_loads_no_framework_at_run_time():
    # the same rule by another route: a fresh interpreter imports every module of `_trace`
    # (and so the package's own `__init__`) and no framework is loaded
    names = sorted(m for m in GRAPH if _inside(m, ["ghost_oracle._trace"]))
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {names!r}:
            importlib.import_module(name)
        print(sorted(m for m in ("torch", "jax", "flax", "ml_dtypes", "opacus") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tied_imports_nothing_of_ghost_oracle():
    assert self_contained(GRAPH, "ghost_oracle.tied", "ghost_oracle") == []


def test_the_torch_and_jax_front_ends_do_not_import_each_other():
    assert apart(GRAPH, TORCH_SIDE, JAX_SIDE, TORCH_FRAMEWORK, JAX_FRAMEWORK) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


# ---------------------------------------------------------------------------------------------
# The scanner and the rules on tiny synthetic packages: each rule fails on a planted violation.


def package(tmp_path: Path, files: Mapping[str, str]) -> dict[str, list[Import]]:
    """A package `pkg` of `files` (path under pkg/ → source), scanned."""
    root = tmp_path / "pkg"
    for rel, src in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    for folder in [p for p in root.rglob("*") if p.is_dir()]:
        (folder / "__init__.py").touch()
    return scan(root)


def test_the_scanner_reads_every_place_and_resolves_relative_imports(tmp_path):
    g = package(tmp_path, {
        "core/__init__.py": "from .a import f\n",
        "core/a.py": """
            from typing import TYPE_CHECKING
            import os.path
            from . import b
            from .. import util
            from ..util import helper
            from pkg.core.b import g
            if TYPE_CHECKING:
                import torch
            else:
                import numpy
            class K:
                import json
            def f():
                from ..front import x
                def inner():
                    import jax.numpy as jnp
            def lazy(name):
                importlib.import_module("pkg.front.x.attr")
                return importlib.import_module(f"pkg.{name}")
            """,
        "core/b.py": "from . import name_in_init\n",
        "util.py": "",
        "front/x.py": "",
    })
    got = {(i.target, i.place) for i in g["pkg.core.a"]}
    assert got == {
        ("typing", "module"), ("os.path", "module"), ("pkg.core.b", "module"), ("pkg.util", "module"),
        ("torch", "type-checking"), ("numpy", "module"), ("json", "module"),
        ("pkg.front.x", "function"), ("jax.numpy", "function"),
    }
    assert [i.line for i in g["pkg.core.a"] if i.target == "pkg.front.x"] == [15, 19]
    assert [i.target for i in g["pkg.core"]] == ["pkg.core.a"]
    # `from . import name` where `name` is no submodule is an import of the package's __init__
    assert [i.target for i in g["pkg.core.b"]] == ["pkg.core"]
    assert [i.line for i in g["pkg.core.a"] if i.target == "torch"] == [9]


def test_a_relative_import_above_the_package_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"pkg.a:1: a relative import above the top-level package"):
        package(tmp_path, {"a.py": "from ... import x\n"})


@pytest.mark.parametrize("where", ["direct", "type-checking", "function", "through", "through-function"])
def test_a_framework_reached_from_the_core_is_a_violation(tmp_path, where):
    files = {"_trace/__init__.py": "", "_trace/check.py": "import numpy\n", "front/helper.py": "import numpy\n"}
    if where == "direct":
        files["_trace/check.py"] = "import torch.nn\n"
    elif where == "type-checking":
        files["_trace/check.py"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jax\n"
    elif where == "function":
        files["_trace/check.py"] = "def f():\n    from flax import linen\n"
    else:
        files["_trace/check.py"] = "def f():\n    from ..front import helper\n" if where == "through-function" else (
            "from ..front.helper import g\n")
        files["front/helper.py"] = "import ml_dtypes\n"
    g = package(tmp_path, files)
    bad = framework_free(g, "pkg._trace", frozenset({"torch", "jax", "flax", "ml_dtypes"}))
    assert len(bad) == 1 and bad[0].startswith("pkg._trace.check → "), bad
    if where.startswith("through"):
        assert "pkg.front.helper" in bad[0] and bad[0].endswith("ml_dtypes (pkg.front.helper:1, module)")
    # the same package without the framework import passes
    clean = {k: ("import numpy\n" if k in ("_trace/check.py", "front/helper.py") else v) for k, v in files.items()}
    assert framework_free(package(tmp_path / "clean", clean), "pkg._trace",
                          frozenset({"torch", "jax", "flax", "ml_dtypes"})) == []


@pytest.mark.parametrize("src", ["from .. import util\n", "import pkg.util\n", "from ..util import f\n",
                                 "def f():\n    from pkg import x\n"])
def test_a_self_contained_package_importing_its_parent_is_a_violation(tmp_path, src):
    g = package(tmp_path, {"tied/a.py": src, "tied/b.py": "from . import a\nimport torch\n", "util.py": ""})
    bad = self_contained(g, "pkg.tied", "pkg")
    assert len(bad) == 1 and bad[0].startswith("pkg.tied.a:"), bad
    assert self_contained(package(tmp_path / "ok", {"tied/a.py": "from .b import c\n", "tied/b.py": ""}),
                          "pkg.tied", "pkg") == []


@pytest.mark.parametrize("case", ["module", "framework", "through-shared", "jax-to-torch", "type-checking"])
def test_front_ends_reaching_each_other_are_a_violation(tmp_path, case):
    files = {"torch/__init__.py": "import torch\nfrom ..shared import s\n", "jax/__init__.py": "import jax\n",
             "shared.py": "import numpy\n"}
    if case == "module":
        files["torch/trace.py"] = "from ..jax import export\n"
    elif case == "framework":
        files["torch/trace.py"] = "def f():\n    import flax\n"
    elif case == "through-shared":
        files["shared.py"] = "def f():\n    from . import jax\n"
    elif case == "jax-to-torch":
        files["jax/trace.py"] = "from ..torch.trace import x\n"
    else:
        files["jax/trace.py"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    g = package(tmp_path, files)
    bad = apart(g, ["pkg.torch"], ["pkg.jax"], frozenset({"torch"}), frozenset({"jax", "flax"}))
    assert bad, case
    want = "pkg.jax" if case.startswith("jax") or case == "type-checking" else "pkg.torch"
    assert all(line.startswith(want) for line in bad), bad
    files.pop("torch/trace.py", None)
    files.pop("jax/trace.py", None)
    files["shared.py"] = "import numpy\n"
    assert apart(package(tmp_path / "ok", files), ["pkg.torch"], ["pkg.jax"], frozenset({"torch"}),
                 frozenset({"jax", "flax"})) == []


@pytest.mark.parametrize("case", ["two", "three", "type-checking", "function", "init-reads-back"])
def test_an_import_cycle_is_a_violation(tmp_path, case):
    files = {"a.py": "from . import b\n", "b.py": "import os\n", "c.py": ""}
    members = {"pkg.a", "pkg.b"}
    if case == "two":
        files["b.py"] = "from .a import f\n"
    elif case == "three":
        files["b.py"] = "from . import c\n"
        files["c.py"] = "import pkg.a\n"
        members.add("pkg.c")
    elif case == "type-checking":
        files["b.py"] = "import typing\nif typing.TYPE_CHECKING:\n    from .a import T\n"
    elif case == "function":
        files["b.py"] = "def f():\n    from pkg import a\n"
    else:  # the package's __init__ imports a submodule that reads a name back from the __init__
        files = {"__init__.py": "from .a import f\nVERSION = 1\n", "a.py": "from . import VERSION\n"}
        members = {"pkg", "pkg.a"}
    bad = cycles(package(tmp_path, files))
    assert len(bad) == 1 and bad[0].startswith(f"cycle among {', '.join(sorted(members))}:"), bad


def test_a_package_init_importing_its_submodules_is_no_cycle(tmp_path):
    # the facade: the __init__ imports its submodules, which import each other one way, and
    # each reaches the package's siblings through absolute and relative imports
    g = package(tmp_path, {
        "__init__.py": "from .front import run\nfrom . import core\n",
        "front/__init__.py": "from .run import run\nfrom .util import u\n",
        "front/run.py": "from .util import u\nfrom ..core import c\nimport pkg.core.c\n",
        "front/util.py": "from pkg.core import c\n",
        "core/__init__.py": "from .c import c\n",
        "core/c.py": "import numpy\n",
    })
    assert cycles(g) == []


PLANTED = {  # a violation of each rule, appended to a copy of the real package: (file, source, rule)
    "core-reaches-torch": ("_trace/site.py", "\ndef _late():\n    from ..torch.precision import unit_roundoff\n",
                           "framework"),
    "core-type-checks-jax": ("_trace/site.py", "\nif TYPE_CHECKING:\n    import jax\n", "framework"),
    "tied-imports-the-core": ("tied/pairs.py", "\nfrom .._trace.site import Site\n", "tied"),
    "jax-reaches-torch": ("jax/trace.py", "\nfrom ..torch.errors import TraceExportError as _E\n", "apart"),
    "opacus-imports-flax": ("opacus.py", "\ndef _f():\n    import flax\n", "apart"),
    "init-reads-back": ("_trace/site.py", "\nfrom . import SITE_KINDS as _K\n", "cycle"),
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_each_rule_fails_on_a_violation_planted_in_a_copy_of_the_package(tmp_path, plant):
    rel, added, rule = PLANTED[plant]
    root = tmp_path / "ghost_oracle"
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    if plant == "init-reads-back":  # the core's __init__ imports the module that reads back from it
        (root / "_trace/__init__.py").write_text((root / "_trace/__init__.py").read_text()
                                                 + "\nfrom .site import SITE_KINDS\n")
    (root / rel).write_text((root / rel).read_text() + added)
    g = scan(root)
    found = {
        "framework": framework_free(g, "ghost_oracle._trace", frozenset({"torch", "jax", "flax", "ml_dtypes"})),
        "tied": self_contained(g, "ghost_oracle.tied", "ghost_oracle"),
        "apart": apart(g, TORCH_SIDE, JAX_SIDE, TORCH_FRAMEWORK, JAX_FRAMEWORK),
        "cycle": cycles(g),
    }
    assert found[rule], plant
    module = "ghost_oracle." + rel.removesuffix(".py").replace("/", ".")
    assert any(module in line for line in found[rule]), found[rule]
