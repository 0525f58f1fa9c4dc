"""A script of the repository (a benchmark, a tool, the site's configuration) as a module.

The scripts in ``benchmarks/``, ``tools/`` and ``site/`` are not a package: a test loads
one by its path. The module is registered in ``sys.modules`` under ``name`` while it runs
and after, since ``dataclasses`` (and pickling) look a class's module up there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """Execute ``ROOT / relative`` as the module ``name``; it stays in ``sys.modules``
    (``forget_script`` removes it). A script that fails to load is not left there."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    if spec is None or spec.loader is None:
        raise ImportError(f"{relative} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def forget_script(name: str) -> None:
    """Take a module ``load_script`` registered out of ``sys.modules``."""
    sys.modules.pop(name, None)
