"""The house's shape, checked: imports only go down the layers and never in a circle, and the
rooms stay short (functions, classes, the engine step)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each package's floor: a module may import its own floor and those below, never above.
# training drives the engine (above the scheduler); server is the HTTP edge; configs is data.
FLOORS = {"ops": 0, "verifier": 1, "drafter": 2, "scheduler": 3, "training": 4, "server": 4, "configs": 0}
# What no serving package may import (the offline pipeline and the benchmarks).
NOT_SERVING = {"training"}
MAX_FUNCTION_LINES = 80
LONG_FUNCTION_LINES = 50
MAX_LONG_FUNCTIONS = 10
MAX_CLASS_LINES = 300
MAX_STEP_LINES = 25


def _modules() -> dict[str, Path]:
    mods = {}
    for top in FLOORS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods["dspark_serve." + ".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every project module `name` imports, at any depth of its code (a function-level or
    TYPE_CHECKING import couples the modules as much as a top-level one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in mods and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _package(module: str) -> str:
    return module.split(".")[1]


def test_the_walk_sees_the_whole_house():
    graph = _graph()
    assert {_package(m) for m in graph} == set(FLOORS)
    assert "dspark_serve.verifier.model_runner" in graph["dspark_serve.scheduler.engine"]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(_graph()) is None, "import cycle: " + " -> ".join(_cycle(_graph()) or [])


def test_a_cycle_is_found_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_only_go_down_the_floors():
    up = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if FLOORS[_package(d)] > FLOORS[_package(m)]
        or (_package(d) in NOT_SERVING and _package(m) != _package(d))
    ]
    assert not up, "upward imports:\n" + "\n".join(sorted(up))


def _defs() -> list[tuple[str, ast.AST, int]]:
    out = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert node.end_lineno is not None
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                out.append((where, node, node.end_lineno - node.lineno + 1))
    return out


def test_rooms_stay_short():
    defs = _defs()
    funcs = [(w, n) for w, node, n in defs if not isinstance(node, ast.ClassDef)]
    too_long = [f"{w} ({n} lines)" for w, n in funcs if n > MAX_FUNCTION_LINES]
    assert not too_long, "functions over 80 lines:\n" + "\n".join(too_long)
    long_ = sorted(f"{w} ({n} lines)" for w, n in funcs if n > LONG_FUNCTION_LINES)
    assert len(long_) <= MAX_LONG_FUNCTIONS, "functions over 50 lines:\n" + "\n".join(long_)
    classes = [
        f"{w} ({n} lines)" for w, node, n in defs if isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES
    ]
    assert not classes, "classes over 300 lines:\n" + "\n".join(classes)


def test_the_engine_step_reads_as_the_method():
    (step,) = [
        (n, node)
        for w, node, n in _defs()
        if w.startswith("scheduler/engine.py") and isinstance(node, ast.FunctionDef) and node.name == "step"
    ]
    assert step[0] < MAX_STEP_LINES
    calls = [ast.unparse(c.func) for c in ast.walk(step[1]) if isinstance(c, ast.Call)]
    order = [
        "self._schedule",
        "self.speculation.draft",
        "self._choose_lengths",
        "self.verify",
        "self._commit",
    ]
    assert [c for c in calls if c in order] == order
