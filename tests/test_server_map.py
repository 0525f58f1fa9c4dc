"""The map to SGLang and vLLM (chapter 09a): its check accepts the book's rows and rejects
rows that name nothing, cite nothing, or leave a module out."""

from __future__ import annotations

import dataclasses

import pytest

from minirt.server_map import MAP, MapRow, check_map, markdown_table


def test_the_books_map_checks_and_renders():
    covered = check_map(MAP)
    assert {"cache", "hashcache", "router", "tiers"} <= covered
    table = markdown_table(MAP)
    assert table.count("\n") == len(MAP) + 1
    assert "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`" in table


def test_rows_can_be_appended_by_later_chapters():
    extra = MapRow("cache.RadixCache", "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixCache`",
                   "none", "-", "-", chapter=11)
    assert check_map([*MAP, extra]) == check_map(MAP)


@pytest.mark.parametrize("broken", [
    dataclasses.replace(MAP[0], minirt="model.no_such_function"),
    dataclasses.replace(MAP[0], sglang="srt/model_loader/loader.py (no package, no version)"),
    dataclasses.replace(MAP[0], adds=""),
])
def test_a_broken_row_fails(broken):
    with pytest.raises((AssertionError, AttributeError)):
        check_map([broken, *MAP[1:]])


def test_a_module_without_a_row_fails():
    with pytest.raises(AssertionError, match="hashcache"):
        check_map([r for r in MAP if not r.minirt.startswith("hashcache.")])
