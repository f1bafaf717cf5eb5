"""JSON from strangers' files: bounded size and nesting, strict constants, one-line errors.

`json.loads` alone turns a file nested a thousand deep into a RecursionError traceback, accepts
`NaN` and `Infinity`, and reads a file of any size; these readers refuse each with one line
naming the file, as `error` (the caller's exception type).
"""

from __future__ import annotations

import json
import pathlib

from colibri.formats.messages import one_line

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "is_int", "loads", "read_json_object"]

MAX_DEPTH = 64  # nesting deeper than any config, index, header or manifest needs
MAX_JSON_BYTES = 256 << 20  # a JSON file larger than this is refused before it is read


def is_int(value) -> bool:
    """A JSON integer: Python's bool is an int too, and `true` is no count."""
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth_within(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def loads(data: bytes | str, where: str, error: type[Exception], what: str = "valid JSON", object_pairs_hook=None):
    """The value in `data`; `error(f"{where}: ...")` when it is not JSON, too deep or not UTF-8."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError, as is a 5,000-digit int
        raise error(f"{where}: not {what} ({one_line(e)})") from None
    if not _depth_within(value, MAX_DEPTH):
        raise error(f"{where}: nested deeper than {MAX_DEPTH} levels")
    return value


def read_json_object(path: pathlib.Path, error: type[Exception], missing_ok: bool = True,
                     max_bytes: int = MAX_JSON_BYTES, object_pairs_hook=None, what: str = "valid JSON") -> dict:
    """The JSON object in `path` ({} when there is no such file and `missing_ok`)."""
    path = pathlib.Path(path)
    if not path.is_file():
        if missing_ok:
            return {}
        raise error(f"{path}: missing")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes, more than the {max_bytes} a JSON file here may have")
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read ({one_line(e)})") from None
    value = loads(data, str(path), error, what, object_pairs_hook)
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value
