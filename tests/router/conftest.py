"""What the live KV-event routing tests share: the benchmark they run, loaded as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live():
    """``benchmarks/kv_routing_live.py`` as a module, registered in ``sys.modules`` (its
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("kv_routing_live",
                                                  ROOT / "benchmarks" / "kv_routing_live.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_routing_live"] = module
    spec.loader.exec_module(module)
    return module
