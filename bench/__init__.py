"""Benchmarks run from a checkout, installed or not: `dspark_serve.*` resolves to this
checkout's folders (server/ is dspark_serve.server, ...) unless the package is already imported.
The GPU suite relies on this on a machine where nothing of the project is installed."""

import importlib.machinery
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if "dspark_serve" not in sys.modules:
    _spec = importlib.machinery.ModuleSpec("dspark_serve", None, is_package=True)
    _spec.submodule_search_locations = [str(ROOT)]
    _pkg = types.ModuleType("dspark_serve")
    _pkg.__spec__ = _spec
    _pkg.__path__ = [str(ROOT)]
    sys.modules["dspark_serve"] = _pkg
