"""Wording shared by the one-line errors of every reader and checker."""

from __future__ import annotations


def some(names, shown: int = 3) -> str:
    """The first `shown` names, and how many more: 'a, b, c (and 4 more)'."""
    names = list(names)
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (or its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__
