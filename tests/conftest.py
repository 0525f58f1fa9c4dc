"""Fixtures shared by the tests that run a tiny model many times; the browser-test switch."""

from __future__ import annotations

import pytest
import torch

from minirt.checks import _common
from minirt.model import tiny_model


@pytest.fixture(autouse=True)
def _fresh_checker_attempts():
    """Every test starts with no failed checker attempts (hints escalate per exercise)."""
    _common.reset_attempts()
    yield
    _common.reset_attempts()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is far faster than two fighting over a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny64():
    """``tiny_model(0)`` in float64: greedy ties that rounding could flip are out of reach,
    so outputs with and without the cache can be required to be exactly equal."""
    return tiny_model(0).to(torch.float64)


def pytest_addoption(parser):
    parser.addoption("--browser", action="store_true", default=False,
                     help="also run tests/browser (needs `make html` and Chromium)")
    parser.addoption("--router", action="store_true", default=False,
                     help="also run tests/router (SGLang's router: `make test-router`)")


def pytest_ignore_collect(collection_path, config):
    """tests/browser drives a real Chromium for minutes: only `make test-browser` runs it."""
    if collection_path.name == "browser" and not config.getoption("--browser"):
        return True
    if collection_path.name == "router" and collection_path.is_dir() \
            and not config.getoption("--router"):
        return True
    return None
