"""Book helpers: reproducible set-up, listings with repository-relative paths, the chapter map."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minirt import book
from minirt.model import load_model


def test_setup_seeds_everything_and_prints_versions(capsys):
    book.setup(seed=3)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    book.setup(seed=3)
    b = (random.random(), np.random.rand(), torch.rand(1).item())
    assert a == b
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "device" in out


def test_show_titles_a_listing_with_a_relative_path_and_line_numbers():
    listing = book.show(load_model)
    text = repr(listing)
    assert listing.title.startswith("minirt/model.py:")
    assert "(load_model)" in listing.title
    first_body_line = text.split("\n")[1]
    assert first_body_line.lstrip().startswith(str(listing.first_line))
    assert "def load_model(" in text
    assert "/work/" not in text and "/home/" not in text
    assert "<pre" in listing._repr_html_() or "<div" in listing._repr_html_()


def test_show_methods_and_properties():
    assert "(Listing.__repr__)" in book.show(book.Listing.__repr__).title
    with pytest.raises(TypeError, match="show"):
        book.show(42)


def test_chapter_map_is_consistent():
    seen = [m for mods in book.CHAPTER_MODULES.values() for m in mods]
    assert len(seen) == len(set(seen)), "a module is introduced twice"
    assert book.introduced_in("model") == 0 and book.introduced_in("cache") == 3
    with pytest.raises(KeyError):
        book.introduced_in("nonexistent")
