"""One drafter registry: names readable without the implementations, every built-in listed."""

import importlib
import pkgutil
import subprocess
import sys

import pytest

from dspark_serve import drafter
from dspark_serve.drafter.config import DrafterConfig, drafter_choices
from dspark_serve.drafter.registry import build_drafter, drafter_names, drafter_spec


def test_builtin_factories_resolve_and_build_the_named_drafter():
    assert {"ngram", "dflash", "dspark", "dspark+ngram"} <= set(drafter_names())
    for name in drafter_names():
        assert callable(drafter_spec(name).load()), name
    assert build_drafter("ngram", block_size=3).name == "ngram"
    with pytest.raises(ValueError, match="magic"):
        build_drafter("magic")
    assert drafter_choices() == ["none", *drafter_names()]
    with pytest.raises(ValueError, match="magic"):
        DrafterConfig(drafter="magic")


def test_importing_every_drafter_module_registers_nothing_unlisted():
    """A drafter registered by decorator inside the package would be invisible to the CLI and
    DrafterConfig until its module happened to be imported: every built-in is in the table."""
    before = drafter_names()
    for mod in pkgutil.walk_packages(drafter.__path__, "dspark_serve.drafter."):
        importlib.import_module(mod.name)
    assert drafter_names() == before


def _modules_after(code: str) -> list[str]:
    code += "; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('dspark_serve.drafter.')))"
    out = subprocess.run(
        [sys.executable, "-c", "import sys; " + code], capture_output=True, text=True, check=True
    )
    return eval(out.stdout)


def test_reading_the_names_imports_no_implementation_and_no_torch():
    assert _modules_after(
        "import dspark_serve.drafter.config, dspark_serve.drafter.registry as r; r.drafter_names()"
    ) == ["dspark_serve.drafter.config", "dspark_serve.drafter.registry"]
    # the interface module does not import its implementations (no cycle through them)
    assert not {
        "dspark_serve.drafter.dspark",
        "dspark_serve.drafter.ngram",
        "dspark_serve.drafter.combined",
    } & set(_modules_after("import dspark_serve.drafter.base"))


def _imports_within_drafter() -> dict[str, set[str]]:
    """module -> the drafter.* modules it imports, anywhere in its source (function-level too)."""
    import ast
    from pathlib import Path

    root = Path(drafter.__path__[0]).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(Path(drafter.__path__[0]).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        mod = "dspark_serve." + ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d.startswith("dspark_serve.drafter.") and d != mod}
    return graph


def test_no_import_cycles_in_the_drafter_package():
    graph = _imports_within_drafter()
    assert "dspark_serve.drafter.dspark" in graph and "dspark_serve.drafter.registry" in graph
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in graph:
        visit(m, [])
