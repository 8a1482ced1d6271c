"""Comma-separated option values (modes, strategies), read one way everywhere."""

from __future__ import annotations

from gmtool.errors import GmtoolError


def comma_items(text, option: str) -> list[str]:
    """The stripped items of a comma-separated value, [] when it is blank. An empty item between commas is refused,
    as the bucket and composition lists refuse one: a stray comma may stand for an item the user lost."""
    if text is None or not str(text).strip():
        return []
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise GmtoolError(f"{option} {str(text)!r} has an empty item: a stray comma, or an item left out?")
    return items
