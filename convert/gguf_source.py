"""Reading a GGUF file, or every part of a split set, without loading tensor data.

`GGUFSource` opens `MODEL.gguf`, or all parts of a `MODEL-0000k-of-0000n.gguf` split set
(any part names the set), with gguf-py's `GGUFReader`: metadata and tensor offsets only,
its memory map is not touched beyond the headers. Everything a conversion could trip on
later is refused here with one line naming the file: not a GGUF (magic), a file shorter
than its header or its last tensor, a missing part, parts that disagree with their names
or with each other (`split.no`, `split.count`, `split.tensors.count`), a tensor in two
parts, tensors not laid end to end as llama.cpp requires or past the end (`tensor_table`),
metadata strings that are not UTF-8. Tensor bytes are read with `pread` into fresh buffers (`ByteReader`), never
through the mmap, so what is read stays in the page cache, not in our RSS.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import gguf
import numpy as np

from colibri.convert.pipeline import ConvertError

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_READ = 1 << 30  # Linux returns at most ~2 GiB from one pread


class GGUFError(ConvertError):
    """A GGUF file or split set that cannot be imported; the message names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    file: Path
    type: str  # GGML type name: "Q4_K", "F32", "IQ2_XS", ...
    shape: tuple[int, ...]  # row-major, innermost last (ggml's ne reversed)
    offset: int  # absolute, in `file`
    nbytes: int


class _Truncated(Exception):
    def __init__(self, needed: int):
        self.needed = needed


class _CheckedReader(gguf.GGUFReader):
    """`GGUFReader` that stops at the first read past the end of the file, and slices a plain
    ndarray view of its memory map (np.memmap's own slicing costs more than the parsing)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if "_plain" not in self.__dict__:
            self._plain = self.data.view(np.ndarray)
        count, dtype = int(count), np.dtype(dtype)
        end = int(offset) + dtype.itemsize * count
        if end > len(self._plain):
            raise _Truncated(end)
        array = self._plain[offset:end].view(dtype)
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_reader(path: Path) -> gguf.GGUFReader:
    """The file's reader, or a one-line GGUFError saying why it is not a readable GGUF."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise GGUFError(f"{path.name}: empty file, not a GGUF")
    try:
        with warnings.catch_warnings():  # gguf-py's numpy offset sums warn on overflow; tensor_table refuses them
            warnings.simplefilter("ignore", RuntimeWarning)
            return _CheckedReader(path)
    except _Truncated as e:
        raise GGUFError(f"{path.name}: truncated ({size} bytes, its header and tensors need at least {e.needed})") from None
    except ValueError as e:
        if "magic" in str(e):
            raise GGUFError(f"{path.name}: not a GGUF file (bad magic {path.read_bytes()[:4]!r})") from None
        raise GGUFError(f"{path.name}: not a readable GGUF file ({e})") from None
    except (KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path.name}: corrupt GGUF header ({type(e).__name__}: {e})") from None


def field_value(reader: gguf.GGUFReader, key: str):
    """A metadata value as Python data (str, int, float, bool, list), or None; strings are
    decoded strictly (a GGUFError names the key when they are not UTF-8)."""
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise GGUFError(f"{Path(reader.data.filename).name}: metadata {key} is unreadable ({type(e).__name__}: {e})") from None


def tensor_table(path: Path, reader: gguf.GGUFReader) -> list[GGUFTensor]:
    """The file's tensors, each checked as llama.cpp's loader checks them: a shape of 1 to 4
    positive dimensions whose innermost is whole blocks of its type, and the tensors laid end to
    end in the order of their infos, each padded to `general.alignment`, inside the file. (A
    shifted offset or a type id swapped for another breaks that chain.) Offsets and sizes are
    computed from the raw fields with Python integers, which cannot wrap past 2**64."""
    size, alignment, base = path.stat().st_size, int(reader.alignment), int(reader.data_offset)
    tensors, expected = [], 0
    for t in reader.tensors:
        dims, relative = [int(d) for d in t.field.parts[3]], int(t.field.parts[5][0])
        weights, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if not 1 <= len(dims) <= 4 or min(dims) <= 0 or dims[0] % weights:
            raise GGUFError(f"{path.name}: tensor {t.name} has shape {dims[::-1]}, not whole {t.tensor_type.name} "
                            f"blocks of {weights} along its rows")
        nbytes = math.prod(dims) // weights * type_bytes
        if relative != expected:
            raise GGUFError(f"{path.name}: tensor {t.name} ({t.tensor_type.name} {dims[::-1]}) starts at data offset "
                            f"{relative}; the tensors before it end at {expected}")
        if base + relative + nbytes > size:
            raise GGUFError(f"{path.name}: tensor {t.name} ({t.tensor_type.name} {dims[::-1]}, {nbytes} bytes at "
                            f"{base + relative}) ends past the end of the file ({size} bytes)")
        tensors.append(GGUFTensor(t.name, path, t.tensor_type.name, tuple(reversed(dims)), base + relative, nbytes))
        expected = relative + -(-nbytes // alignment) * alignment
    return tensors


def split_parts(path: Path) -> list[Path]:
    """Every part of the split set `path` belongs to (just `path` when it is not split)."""
    match = SPLIT_NAME.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, part in enumerate(parts, 1):
        if not part.is_file():
            raise GGUFError(f"{part}: missing (part {i} of the {count}-part split set of {path.name})")
    return parts


class GGUFSource:
    """The metadata and tensor table of a GGUF model (one file or a split set)."""

    def __init__(self, path):
        path = Path(path)
        self.parts = split_parts(path)
        readers = [open_reader(p) for p in self.parts]
        self.reader = readers[0]  # holds the metadata (later parts only say which split they are)
        self._check_split(readers)
        self.tensors: dict[str, GGUFTensor] = {}
        for part, reader in zip(self.parts, readers):
            for t in tensor_table(part, reader):
                if t.name in self.tensors:
                    raise GGUFError(f"{part.name}: tensor {t.name} is also in {self.tensors[t.name].file.name}")
                self.tensors[t.name] = t

    def _check_split(self, readers: list) -> None:
        count = len(self.parts)
        declared_total = field_value(readers[0], gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        for i, (part, reader) in enumerate(zip(self.parts, readers)):
            declared = field_value(reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
            number = field_value(reader, gguf.Keys.Split.LLM_KV_SPLIT_NO)
            if (declared or 1) != count:
                named = f"part of a {count}-part set by its name" if count > 1 else "not named as a split part"
                raise GGUFError(f"{part.name}: split.count is {declared}, but the file is {named}"
                                + ("" if count > 1 else f" (expected {part.stem}-00001-of-{declared:05d}.gguf and its siblings)"))
            if count > 1 and number != i:
                raise GGUFError(f"{part.name}: split.no is {number}, its name says part {i + 1} (split.no {i})")
        total = sum(len(r.tensors) for r in readers)
        if declared_total is not None and declared_total != total:
            raise GGUFError(f"{self.parts[0].name}: split.tensors.count is {declared_total}, the {count} parts hold {total} tensors")

    def get(self, key: str, default=None):
        value = field_value(self.reader, key)
        return default if value is None else value

    @property
    def name(self) -> str:
        return self.parts[0].name

    def file_sizes(self) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in self.parts}


def read_ahead(items: Iterable) -> Iterator:
    """`items` in order, each produced on a background thread while the previous one is used
    (so reads overlap the hashing and writing of what was read)."""
    items, end = iter(items), object()
    with ThreadPoolExecutor(1) as thread:
        ahead = thread.submit(next, items, end)
        while (item := ahead.result()) is not end:
            ahead = thread.submit(next, items, end)
            yield item


class ByteReader:
    """`pread` into fresh buffers, one open descriptor per file."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def read(self, file, offset: int, nbytes: int) -> np.ndarray:
        file = str(file)
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        buffer = np.empty(nbytes, dtype=np.uint8)
        done = 0
        while done < nbytes:
            got = os.preadv(self._fds[file], [buffer[done : done + MAX_READ]], offset + done)
            if got <= 0:
                raise GGUFError(f"{Path(file).name}: short read at byte {offset + done} (the file changed while reading?)")
            done += got
        return buffer

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
