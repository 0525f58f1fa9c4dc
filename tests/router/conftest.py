"""What the live KV-event routing tests share: the benchmark they run, loaded as a module."""

from __future__ import annotations

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def live():
    """``benchmarks/kv_routing_live.py`` as a module."""
    return load_script("benchmarks/kv_routing_live.py", "kv_routing_live")
