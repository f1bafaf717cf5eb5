"""Wording shared by the one-line errors of every reader and checker."""

from __future__ import annotations


def some(names, shown: int = 3) -> str:
    """The first `shown` names, and how many more: 'a, b, c (and 4 more)'."""
    names = list(names)
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
