"""The side-by-side benchmark's agreement logic (benchmarks/radix_vs_sglang.py), on a small trace.

SGLang's radix cache comes from its wheel, cached in ~/.cache/minirt/peers (or
$MINIRT_PEERS) by the benchmark's first run; if it is not cached, the test tries to fetch
it once and skips only if that fails (no network).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from script_loader import forget_script, load_script


@pytest.fixture(scope="module")
def bench():
    yield load_script("benchmarks/radix_vs_sglang.py", "radix_vs_sglang")
    forget_script("radix_vs_sglang")


@pytest.fixture(scope="module")
def sglang(bench):
    wheel = bench.sglang_wheel(fetch=True)
    if wheel is None:
        pytest.skip(f"{bench.SGLANG} is not cached and cannot be fetched")
    before = {k for k in sys.modules if k.startswith("sglang")}
    sgl = bench.load_sglang(wheel)
    assert {k for k in sys.modules if k.startswith("sglang")} == before  # no leftovers
    return sgl


def small_trace(bench):
    """Shared prefixes that end inside nodes and at page boundaries, repeats, and misses."""
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(40)]
    requests = [system + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
                for _ in range(12)]
    requests += [requests[2], requests[5][:20], requests[7][:33], [5, 6, 7], []]
    requests += [r + [1, 2, 3] for r in requests[:4]]
    return bench.Trace("small", requests)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_minirt_and_sglang_agree_on_every_request(bench, sglang, page_size):
    trace = small_trace(bench)
    assert bench.check_agreement(bench.Minirt(), bench.SGLang(sglang), trace, page_size) == len(
        trace.requests)
    times = bench.time_pair([bench.Minirt(), bench.SGLang(sglang)], trace, page_size, repeats=1)
    assert times["minirt"][2] == times["SGLang"][2] > 0  # both drained the same token count


class _OffByOne:
    """A contender that reports one token too many as already cached, from request 5 on."""

    def __init__(self, inner):
        self.inner, self.name = inner, "off-by-one"

    def fresh(self, page_size):
        return self.inner.fresh(page_size)

    def serve(self, cache, trace, record=None):
        self.inner.serve(cache, trace, record)
        if record is not None:
            m, slots, c = record[5]
            record[5] = (m, slots, c + 1)


def test_a_disagreement_is_caught_and_named(bench, sglang):
    trace = small_trace(bench)
    with pytest.raises(bench.Disagreement, match="request 5 .* already-cached length differs"):
        bench.check_agreement(_OffByOne(bench.Minirt()), bench.SGLang(sglang), trace, 1)


def test_memory_costs_times_each_side_s_copies_and_minirt_s_checks(bench):
    trace = small_trace(bench)
    costs = bench.memory_costs(trace, repeats=1)
    assert set(costs) == {"SGLang: ids[:len] + row.to(int64) + clone()",
                          "SGLang: row.to(int64) alone",
                          "minirt: TokenIds (copy + sign check)",
                          "minirt: slots sign check + copy", "minirt: slots sign check alone",
                          "ids and slots copied, unchecked (for scale)"}
    assert all(us > 0 for us in costs.values())


def test_sglang_is_handed_each_request_s_slots_as_its_server_holds_them(bench, sglang):
    """SGLang's request row is int32 (``ReqToTokenPool.req_to_token``), which its serve
    converts to int64 before the insert, as SGLang's ``_insert_cache`` does (the tree
    would keep int32 values otherwise); minirt's slots are its page table's int64. Same
    slots."""
    trace = small_trace(bench)
    assert all(r.dtype is torch.int32 and s.dtype is torch.int64 and torch.equal(r.long(), s)
               for r, s in zip(trace.rows, trace.slots, strict=True))
    contender = bench.SGLang(sglang)
    cache = contender.fresh(1)
    contender.serve(cache, trace)
    m = cache.match_prefix(sglang.MatchPrefixParams(key=sglang.RadixKey(trace.arrays[0])))
    assert m.device_prefix_len == len(trace.arrays[0])
    assert cache.path_device_indices(m.last_device_node).dtype is torch.int64
