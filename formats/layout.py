"""Reader and writer of the colibri layout (a directory; see `formats/spec.md`).

Everything that touches the on-disk layout goes through this module: the manifest
(validated against `manifest.schema.json`, with its own checksum), aligned tensor files
written atomically, and a memory-mapped reader that locates every tensor and every expert.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jsonschema
import numpy as np

from colibri.formats.config_check import config_problems, tensor_problems
from colibri.formats.encodings import EncodingError, tensor_bytes
from colibri.formats.model_config import ModelConfig
from colibri.formats.safe_json import MAX_JSON_BYTES, loads

FORMAT_NAME = "colibri"
FORMAT_VERSION = 2
MANIFEST_NAME = "colibri.json"
RESIDENT_FILE = "resident.bin"
JOURNAL_NAME = ".colibri-convert.json"
# Files a conversion writes next to the layout (copied from a checkpoint, or rebuilt from GGUF metadata).
TOKENIZER_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)
SELF_DIGEST = "self_sha256"  # the manifest's own checksum (format 2); see `manifest_bytes`
UNSET_DIGEST = "0" * 64
TENSOR_ALIGN = 64
EXPERT_ALIGN = 4096
EXPERT_MATRICES = ("gate", "up", "down")
VECTOR_ENCODINGS = ("F32", "F16", "BF16")  # norms, biases, sinks: never block-quantized, as llama-quantize keeps them
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")


class FormatError(Exception):
    """A layout that a reader must refuse; the message is one line naming the file."""


def inside(directory: Path, name: str) -> Path:
    """`directory / name`, refused (FormatError) when the name or a symlink on the way leads
    outside the folder: every file a model holds is its own, never /etc/passwd."""
    directory = Path(directory)
    path = directory / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise FormatError(f"{path}: file names must stay inside the model folder")
    if os.path.lexists(path) and not path.resolve().is_relative_to(directory.resolve()):
        raise FormatError(f"{path}: a link to {path.resolve()}, outside the model folder; refused")
    return path


def align_up(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def expert_file_name(layer: int) -> str:
    return f"experts/blk.{layer:03d}.bin"


def reserved_name(name: str) -> bool:
    """A path the layout gives a meaning to: a reader or the runtime may open it by this name."""
    return name in (MANIFEST_NAME, RESIDENT_FILE, JOURNAL_NAME, *TOKENIZER_FILES) or name.startswith("experts/")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file, fsync and rename: all or nothing."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class AlignedFileWriter:
    """Writes blobs at aligned offsets to `<path>.partial`; `commit` makes it `path`.

    `start(alignment)` zero-pads to the next aligned offset and returns it; `write`
    appends bytes there. Nothing appears under `path` until `commit`.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        self.size = 0

    def start(self, alignment: int) -> int:
        self.pad_to(alignment)
        return self.size

    def write(self, data) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        self.file.write(view)
        self.size += view.nbytes

    def pad_to(self, alignment: int) -> None:
        end = align_up(self.size, alignment)
        if end > self.size:
            self.file.write(b"\0" * (end - self.size))
            self.size = end

    def commit(self) -> int:
        """fsync, rename into place; returns the file size."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.size

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


@cache
def manifest_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@cache
def _schema_validator() -> jsonschema.protocols.Validator:
    schema = manifest_schema()
    return jsonschema.validators.validator_for(schema)(schema)


@cache
def _expert_checksum() -> re.Pattern:
    """The schema's own pattern for an expert record's checksum."""
    layer = manifest_schema()["properties"]["expert_layers"]["items"]
    return re.compile(layer["properties"]["sha256"]["items"]["pattern"])


def _one_checksum_per_layer(manifest: dict) -> tuple[dict, bool]:
    """(a shallow copy whose expert layers list only their first checksum, for the schema;
    whether all their checksums are as the schema asks: a string of its pattern per expert).
    Tens of thousands of such items are most of a wide manifest: one loop checks them."""
    layers = manifest.get("expert_layers")
    if not isinstance(layers, list):
        return manifest, True
    pattern, sampled, valid = _expert_checksum(), [], True
    for layer in layers:
        if isinstance(layer, dict) and isinstance(layer.get("sha256"), list):
            valid = valid and all(isinstance(digest, str) and pattern.search(digest) for digest in layer["sha256"])
            layer = {**layer, "sha256": layer["sha256"][:1]}
        sampled.append(layer)
    return {**manifest, "expert_layers": sampled}, valid


def validate_manifest(manifest: dict, where: str = MANIFEST_NAME) -> None:
    """Refuse a manifest that breaks the schema, the format version, or its own sizes."""
    validator = _schema_validator()
    # the fast path; the best error is looked for, in the whole manifest, only on failure
    sampled, checksums_valid = _one_checksum_per_layer(manifest)
    if not (checksums_valid and validator.is_valid(sampled)):
        e = jsonschema.exceptions.best_match(validator.iter_errors(manifest))
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise FormatError(f"{where}: invalid manifest at {path}: {e.message}") from None
    if manifest["format_version"] > FORMAT_VERSION:
        raise FormatError(
            f"{where}: format version {manifest['format_version']} is newer than this reader's "
            f"({FORMAT_VERSION}); upgrade colibri"
        )
    for name, t in manifest["tensors"].items():
        expected = tensor_bytes(t["encoding"], t["shape"])
        if t["nbytes"] != expected:
            raise FormatError(f"{where}: tensor {name} has {t['nbytes']} bytes, {t['encoding']} {t['shape']} needs {expected}")
    for layer in manifest["expert_layers"]:
        offset = 0
        for m in EXPERT_MATRICES:
            mat = layer["matrices"][m]
            if mat["offset"] != offset or mat["nbytes"] != tensor_bytes(mat["encoding"], mat["shape"]):
                raise FormatError(f"{where}: layer {layer['layer']} expert matrix {m} has an inconsistent offset or size")
            offset += mat["nbytes"]
        if layer["expert_bytes"] != offset or layer["stride"] < offset or layer["stride"] % EXPERT_ALIGN:
            raise FormatError(f"{where}: layer {layer['layer']} expert stride/size is inconsistent")
        if len(layer["sha256"]) != layer["count"]:
            raise FormatError(f"{where}: layer {layer['layer']} lists {len(layer['sha256'])} checksums for {layer['count']} experts")
    if manifest["format_version"] >= 2:
        unhashed = unhashed_files(manifest)
        if unhashed:
            raise FormatError(f"{where}: files/{unhashed[0]} has no sha256 (format 2 records one for every file that holds no tensors or experts)")


def data_files(manifest: dict) -> set[str]:
    """The files whose bytes the tensor and expert tables cover (their checksums, zeros elsewhere)."""
    return {t["file"] for t in manifest["tensors"].values()} | {e["file"] for e in manifest["expert_layers"]}


def unhashed_files(manifest: dict) -> list[str]:
    """Files of `files` that no checksum covers (none in format 2; the tokenizer files in format 1)."""
    covered = data_files(manifest)
    return [name for name, info in manifest["files"].items() if name not in covered and "sha256" not in info]


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest file: sorted-key JSON whose `self_sha256` is the sha256 of these very bytes
    with that value's 64 hex digits replaced by 64 `0`s."""
    text = json.dumps({**manifest, SELF_DIGEST: UNSET_DIGEST}, indent=1, sort_keys=True).encode()
    slot = f'"{SELF_DIGEST}": "{UNSET_DIGEST}"'.encode()
    digest = hashlib.sha256(text).hexdigest()
    return text.replace(slot, f'"{SELF_DIGEST}": "{digest}"'.encode(), 1)


def self_digest_problem(raw: bytes, manifest: dict) -> str | None:
    """What is wrong with a parsed manifest's own checksum, or None (format 1 has none)."""
    recorded, version = manifest.get(SELF_DIGEST), manifest.get("format_version")
    if recorded is None:
        return "no self_sha256 (format 2 manifests check themselves)" if isinstance(version, int) and version >= 2 else None
    if not isinstance(recorded, str) or raw.count(recorded.encode()) != 1:
        return "self_sha256 is not a digest found once in the file"
    if hashlib.sha256(raw.replace(recorded.encode(), UNSET_DIGEST.encode())).hexdigest() != recorded:
        return "sha256 mismatch: the manifest changed after it was written"
    return None


def manifest_digest_problem(directory: Path) -> str | None:
    """`self_digest_problem` of `<directory>/colibri.json` (None when it is missing or not a JSON object)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
        manifest = loads(raw, str(path), FormatError)
    except (OSError, FormatError):
        return None
    return self_digest_problem(raw, manifest) if isinstance(manifest, dict) else None


def read_manifest(directory: Path, strict: bool = True) -> tuple[dict, str | None]:
    """Read and validate `<directory>/colibri.json`; returns it without `self_sha256`, and what
    is wrong with that checksum (None when nothing is). `strict` refuses such a manifest."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FormatError(f"{path}: no manifest (not a colibri model, or an unfinished conversion)")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise FormatError(f"{path}: {path.stat().st_size} bytes, more than a manifest may have")
    raw = path.read_bytes()
    manifest = loads(raw, str(path), FormatError)
    if not isinstance(manifest, dict):
        raise FormatError(f"{path}: the manifest is {type(manifest).__name__}, not a JSON object")
    problem = self_digest_problem(raw, manifest)
    if problem and strict:
        raise FormatError(f"{path}: {problem}")
    manifest.pop(SELF_DIGEST, None)
    validate_manifest(manifest, str(path))
    return manifest, problem


def load_manifest(directory: Path) -> dict:
    """Read and validate `<directory>/colibri.json`, refusing one whose own checksum fails."""
    return read_manifest(directory)[0]


def write_manifest(directory: Path, manifest: dict) -> None:
    """Validate, then write the manifest atomically (the last step of a conversion)."""
    path = Path(directory) / MANIFEST_NAME
    validate_manifest(manifest, str(path))
    write_atomic(path, manifest_bytes(manifest))


def _bytes_of(encoding: str, shape) -> int | None:
    try:
        return tensor_bytes(encoding, shape)
    except (EncodingError, ValueError):
        return None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    offset: int
    nbytes: int
    encoding: str
    shape: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class ExpertMatrix:
    encoding: str
    shape: tuple[int, int]
    offset: int  # within the expert record
    nbytes: int


@dataclass(frozen=True)
class ExpertLayer:
    layer: int
    file: str
    offset: int  # of expert 0
    stride: int  # bytes from one expert to the next (a multiple of 4096)
    count: int
    expert_bytes: int  # gate + up + down, without the padding
    matrices: dict[str, ExpertMatrix]
    sha256: tuple[str, ...]

    def expert_offset(self, expert: int) -> int:
        if not 0 <= expert < self.count:
            raise IndexError(f"layer {self.layer} has experts 0..{self.count - 1}, not {expert}")
        return self.offset + expert * self.stride


class ModelLayout:
    """A converted model opened for reading: manifest, config and mmapped files.

    `strict=False` (for `colibri verify`) opens a manifest whose own checksum fails and
    keeps the problem in `manifest_problem` instead of refusing it.
    """

    def __init__(self, directory, strict: bool = True):
        self.directory = Path(directory)
        self.manifest, self.manifest_problem = read_manifest(self.directory, strict)
        self.config = ModelConfig.from_dict(self.manifest["config"])
        self.tensors = {
            name: TensorInfo(name, t["file"], t["offset"], t["nbytes"], t["encoding"], tuple(t["shape"]), t["sha256"])
            for name, t in self.manifest["tensors"].items()
        }
        self.expert_layers = {
            e["layer"]: ExpertLayer(
                e["layer"], e["file"], e["offset"], e["stride"], e["count"], e["expert_bytes"],
                {m: ExpertMatrix(v["encoding"], tuple(v["shape"]), v["offset"], v["nbytes"]) for m, v in e["matrices"].items()},
                tuple(e["sha256"]),
            )
            for e in self.manifest["expert_layers"]
        }
        self._maps: dict[str, np.memmap] = {}
        problems = self.problems()
        if problems and strict:
            raise FormatError(f"{self.directory / MANIFEST_NAME}: {problems[0]}"
                              + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))

    def problems(self) -> list[str]:
        """What the manifest says that no reader may trust: a config out of range or
        contradicting its tensors, records whose bytes disagree with their encoding and
        shape, or that reach outside their files."""
        problems = [f"config: {p}" for p in config_problems(self.config)]
        if problems:
            return problems
        shapes = {name: t.shape for name, t in self.tensors.items()}
        expert_shapes = {layer: {m: x.shape for m, x in e.matrices.items()} for layer, e in self.expert_layers.items()}
        problems += [f"config: {p}" for p in tensor_problems(self.config, shapes, expert_shapes)]
        problems += self._record_problems()
        return problems

    def _record_problems(self) -> list[str]:
        files = self.manifest["files"]
        problems = []
        for t in self.tensors.values():
            size = files.get(t.file, {}).get("size")
            if len(t.shape) == 1 and t.encoding not in VECTOR_ENCODINGS:
                problems.append(f"tensor {t.name}: a vector stored as {t.encoding} (vectors are {', '.join(VECTOR_ENCODINGS)})")
            elif _bytes_of(t.encoding, t.shape) != t.nbytes:
                problems.append(f"tensor {t.name}: {t.nbytes} bytes, but {t.encoding} {list(t.shape)} takes "
                                f"{_bytes_of(t.encoding, t.shape)}")
            elif size is None or t.offset + t.nbytes > size:
                problems.append(f"tensor {t.name}: bytes {t.offset}..{t.offset + t.nbytes} lie outside {t.file}")
        for e in self.expert_layers.values():
            size, end = files.get(e.file, {}).get("size"), 0
            for name in EXPERT_MATRICES:
                m = e.matrices.get(name)
                if m is None or _bytes_of(m.encoding, m.shape) != m.nbytes or m.offset < end:
                    problems.append(f"layer {e.layer} experts: matrix {name} is not where its encoding and shape put it")
                    break
                end = m.offset + m.nbytes
            if end > e.expert_bytes or e.expert_bytes > e.stride or e.count != self.config.n_experts:
                problems.append(f"layer {e.layer} experts: {e.count} records of {e.expert_bytes} bytes every {e.stride} "
                                f"do not hold the matrices of {self.config.n_experts} experts")
            elif size is None or e.offset + (e.count - 1) * e.stride + e.expert_bytes > size:
                problems.append(f"layer {e.layer} experts: records reach past the end of {e.file}")
        return problems or self._overlap_problems()

    def _overlap_problems(self) -> list[str]:
        """Two records sharing bytes: a hostile manifest can point one tensor at another's data."""
        spans = sorted([(t.file, t.offset, t.offset + t.nbytes, f"tensor {t.name}") for t in self.tensors.values()]
                       + [(e.file, e.offset, e.offset + (e.count - 1) * e.stride + e.expert_bytes, f"layer {e.layer} experts")
                          for e in self.expert_layers.values()])
        for (file, _, end, first), (next_file, start, _, second) in zip(spans, spans[1:]):
            if file == next_file and start < end:
                return [f"{first} and {second} share bytes of {file}"]
        return []

    def path(self, file: str) -> Path:
        """A file of the model; FormatError when it would lie outside the model folder."""
        return inside(self.directory, file)

    def check_size(self, file: str) -> Path:
        """The file's path, after checking it has the size the manifest records."""
        path = self.path(file)
        expected = self.manifest["files"][file]["size"]
        actual = path.stat().st_size if path.exists() else None
        if actual != expected:
            raise FormatError(f"{path}: expected {expected} bytes, found {'no file' if actual is None else actual}")
        return path

    def mmap(self, file: str) -> np.memmap:
        if file not in self._maps:
            self._maps[file] = np.memmap(self.check_size(file), dtype=np.uint8, mode="r")
        return self._maps[file]

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw encoded bytes of a resident tensor (a read-only view of the mmap)."""
        t = self.tensors[name]
        return self.mmap(t.file)[t.offset : t.offset + t.nbytes]

    def expert_data(self, layer: int, expert: int) -> np.ndarray:
        """The contiguous gate|up|down record of one expert."""
        table = self.expert_layers[layer]
        start = table.expert_offset(expert)
        return self.mmap(table.file)[start : start + table.expert_bytes]

    def expert_matrix_data(self, layer: int, expert: int, matrix: str) -> np.ndarray:
        table = self.expert_layers[layer]
        m = table.matrices[matrix]
        start = table.expert_offset(expert) + m.offset
        return self.mmap(table.file)[start : start + m.nbytes]
