"""Checkers for chapter 00 (filled in with the chapter's exercises)."""

__all__: list[str] = []
