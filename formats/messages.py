"""Wording shared by the one-line errors of every reader and checker, and the JSON reader they share."""

from __future__ import annotations

import json
import pathlib


def some(names, shown: int = 3) -> str:
    """The first `shown` names, and how many more: 'a, b, c (and 4 more)'."""
    names = list(names)
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (or its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_json_object(path: pathlib.Path, error: type[Exception]) -> dict:
    """The JSON object in `path` ({} when there is no such file); `error` names the file otherwise."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read JSON ({one_line(e)})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data
