"""Reading a Hugging Face checkpoint folder (config + sharded safetensors) lazily.

The index file is the truth about which shard holds which tensor. Headers are parsed
by hand (8-byte little-endian length, JSON) so that every inconsistency — a missing
or truncated shard, overlapping tensors, a size that contradicts dtype × shape — is
reported with the file's name before anything is converted. Tensors are read with
`pread` into fresh buffers (never a whole-file mmap) so memory stays bounded, and
decoded to float32 here, FP8 e4m3 with 128×128 block scales included.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from colibri.formats import compressed_tensors, mxfp4
from colibri.formats.compressed_tensors import PackedWeightError, find_packed
from colibri.formats.messages import some
from colibri.formats.safe_json import is_int, loads, read_json_object

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype → bytes per element
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")
# a multimodal checkpoint's text model (Checkpoint._text_model_view): its tensors' prefix → the
# text-only checkpoint's (Kimi-K2.5: "language_model."; Qwen3.5: "model.language_model.", with
# lm_head beside it)
TEXT_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.": ""}
TEXT_MODEL_TOP = ("lm_head.weight",)  # text tensors a Qwen3.5-style wrapper keeps outside its prefix
PACKED_DTYPE = "I4"  # compressed-tensors' packed INT4 weight with its group scales (formats.compressed_tensors)
MXFP4_DTYPE = "MXFP4"  # gpt-oss's `_blocks` and `_scales` of one weight (formats.mxfp4)
CONVERTIBLE_DTYPES = (*FLOAT_DTYPES, PACKED_DTYPE, MXFP4_DTYPE)
INTEGER_DTYPES = {"I32": "<i4", "I64": "<i8"}  # integer tables, read as float32 (`Checkpoint.read`)
EXACT_FLOAT_INTEGERS = 1 << 24  # whole numbers float32 holds exactly
FP8_BLOCK = 128
# DeepSeek-V3's block scales; compressed-tensors' scales; DeepSeek-V4's block scales (powers of two, E8M0)
FP8_SCALES = (".weight_scale_inv", ".weight_scale", ".scale")
E8M0_DTYPE = "F8_E8M0"  # a power of two a byte: 2^(byte - 127), 0xFF NaN
# a release whose tensors transformers renames (model_type → (pattern, replacement) in order): read
# under transformers' names, as its adapter lists them. DeepSeek-V4's own files have no `model.`
# prefix and call the key-value norm `kv_norm`; their MTP block (`mtp.`) keeps its names.
RELEASE_NAMES = {"deepseek_v4": (
    (r"^embed\.weight$", "model.embed_tokens.weight"), (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"), (r"^layers\.(\d+)\.attn\.kv_norm\.", r"layers.\1.attn.norm."),
    (r"^layers\.", "model.layers."),
)}
# a checkpoint transformers saved, whose names differ from the release's (model_type → (pattern,
# replacement)): read under the release's names. Kimi-Linear's dense first layer is `mlp` in the
# release, `block_sparse_moe` as transformers saves it; MiniMax-M3's text model saves its MoE
# under `mlp` and its indexer as a module of its own.
SAVED_NAMES = {
    "kimi_linear": ((r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj."),),
    "minimax_m3_vl_text": ((r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
                           (r"\.mlp\.(gate\.weight|experts\.|shared_experts\.)", r".block_sparse_moe.\1"),
                           (r"\.self_attn\.indexer\.", ".self_attn.index_")),
}
# a checkpoint transformers saved with two projections in one tensor, the first's rows then the
# second's (model_type → (fused leaf, first leaf, second leaf)): read as the two, each half of its
# bytes (float tensors only). MiniMax-M3's text model fuses its dense FFNs' and shared expert's.
SAVED_HALVES = {"minimax_m3_vl_text": ((".gate_up_proj.weight", ".gate_proj.weight", ".up_proj.weight"),)}


def renamed_tensor(name: str, renames) -> str:
    """`name` with each (pattern, replacement) of `renames` applied in order."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name
HUB_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # what a Hugging Face repo id looks like: owner/name


def _halves_apart(entry: TensorEntry) -> bool:
    """Whether a tensor's first and second halves of rows are each a float tensor of their own bytes."""
    return entry.dtype in ("F32", "F16", "BF16") and len(entry.shape) == 2 and entry.shape[0] % 2 == 0


class CheckpointError(Exception):
    """A checkpoint that cannot be read as it is; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1 + mantissa / 8) * np.exp2(exponent.astype(np.float64) - 7)
    subnormal = mantissa / 8 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_TO_F32 = _e4m3_table()


def cache_blob_sha256(path: Path) -> str | None:
    """The sha256 of a file in the Hugging Face cache, where snapshot files link to
    `blobs/<sha256>`; None elsewhere."""
    blob = Path(path).resolve().name
    return blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None


def _entry(path: Path, name: str, info, base: int) -> TensorEntry:
    """One header entry, every field checked for type and range."""
    if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{path.name}: malformed header entry for tensor {name}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(is_int(d) and 0 <= d < 1 << 40 for d in shape):
        raise CheckpointError(f"{path.name}: tensor {name} has a malformed shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) and o >= 0 for o in offsets):
        raise CheckpointError(f"{path.name}: tensor {name} has malformed data_offsets {offsets!r}")
    start, end = offsets
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if start > end or end - start != nbytes:
        raise CheckpointError(
            f"{path.name}: tensor {name} spans bytes {start}..{end}, but {dtype} {shape} needs {nbytes}"
        )
    return TensorEntry(name, path, dtype, tuple(shape), base + start, nbytes)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and check one safetensors file's header: every entry well-typed, and the tensors
    covering the data area exactly (no gap, no overlap, nothing after), as the format requires."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: truncated (only {size} bytes, no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(f"{path.name}: header declares {header_len} bytes but the file has {size} bytes")
        header = loads(f.read(header_len), path.name, CheckpointError, "a valid safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    if not isinstance(header.get("__metadata__", {}), dict):
        raise CheckpointError(f"{path.name}: header __metadata__ is not a JSON object")
    base = 8 + header_len
    entries = {name: _entry(path, name, info, base) for name, info in header.items() if name != "__metadata__"}
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values())
    position, previous = base, None
    for start, end, name in spans:
        if start < position:
            raise CheckpointError(f"{path.name}: tensors {previous} and {name} overlap")
        if start > position:
            raise CheckpointError(f"{path.name}: {start - position} bytes before tensor {name} belong to no tensor")
        position, previous = end, name
    if size < position:
        raise CheckpointError(f"{path.name}: truncated: header declares {position} bytes, file has {size}")
    if size > position:
        raise CheckpointError(f"{path.name}: {size - position} bytes after the last tensor belong to no tensor "
                              f"(a header length that does not match the header?)")
    return entries


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor → shard map: no tensor listed twice, every shard a plain file name in
    the checkpoint folder."""
    repeated = []

    def pairs_hook(pairs):
        repeated.extend(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        return dict(pairs)

    index = read_json_object(index_path, CheckpointError, missing_ok=False, object_pairs_hook=pairs_hook,
                             what="a valid safetensors index")
    if repeated:
        raise CheckpointError(f"{index_path.name}: lists {some(repeated)} more than once")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path.name}: not a valid safetensors index (no weight_map object)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard != Path(shard).name or shard in (".", ".."):
            raise CheckpointError(f"{index_path.name}: tensor {name} is placed in {shard!r}, not a file name in the folder")
    return weight_map


def shard_names(directory: Path) -> list[str]:
    """The shard files the checkpoint consists of, according to its index."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        return sorted(set(read_weight_map(index_path).values()))
    if (directory / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern))
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle weights ({', '.join(pickles[:3])}); refused, pickles are never loaded — "
            "use a safetensors copy of the model"
        )
    raise CheckpointError(f"{directory}: no {INDEX_NAME} or {SINGLE_NAME}")


class Checkpoint:
    """A local Hugging Face checkpoint folder, opened lazily."""

    def __init__(self, directory):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such folder")
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing (every Hugging Face checkpoint has one)")
        self.config = read_json_object(config_path, CheckpointError)
        self.shards = shard_names(self.directory)
        missing = [s for s in self.shards if not (self.directory / s).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.directory}: shard {missing[0]} named in {INDEX_NAME} is missing{more}")
        self.tensors: dict[str, TensorEntry] = {}
        for shard in self.shards:
            for name, entry in read_header(self.directory / shard).items():
                if name in self.tensors:
                    raise CheckpointError(f"{shard}: tensor {name} also appears in {self.tensors[name].file.name}")
                self.tensors[name] = entry
        self._check_index()
        self._fds: dict[Path, int] = {}
        self.other_model_tensors = self._text_model_view()
        self._release_view()
        # compressed-tensors' packed INT4 weights, each listed as one tensor of dtype I4
        try:
            self.packed = find_packed(self.tensors, lambda entry: self.read_raw(entry.name).view(
                "<i4" if entry.dtype == "I32" else "<i8"))
        except PackedWeightError as e:
            raise CheckpointError(str(e)) from None
        problem = compressed_tensors.scheme_problem(self.config)  # INT4 and FP8 schemes alike
        if problem:
            raise CheckpointError(f"{config_path}: {problem}")
        self.parts: dict[str, TensorEntry] = {}  # the tensors a packed weight consists of
        for name, weight in self.packed.items():
            parts = [self.tensors.pop(n) for n in weight.component_names]
            self.parts.update((p.name, p) for p in parts)
            self.tensors[name] = TensorEntry(name, weight.packed.file, PACKED_DTYPE, (weight.rows, weight.cols),
                                             weight.packed.offset, sum(p.nbytes for p in parts))
        try:  # gpt-oss's and DeepSeek-V4's MXFP4 weights, each listed as one tensor of dtype MXFP4
            self.mxfp4 = mxfp4.find_mxfp4(self.tensors)
        except mxfp4.Mxfp4Error as e:
            raise CheckpointError(str(e)) from None
        for name, weight in self.mxfp4.items():
            for part in (weight.blocks, weight.scales):
                self.parts[part.name] = self.tensors.pop(part.name)
            self.tensors[name] = TensorEntry(name, weight.blocks.file, MXFP4_DTYPE, weight.shape, weight.blocks.offset,
                                             weight.blocks.nbytes + weight.scales.nbytes)

    def _text_model_view(self) -> list[str]:
        """A multimodal checkpoint (Kimi-K2.5 and K2.6, Qwen3.5: `text_config`, the text model's
        tensors under a prefix of TEXT_MODEL_PREFIXES) is read as its text model: that config,
        those tensors named as a text-only checkpoint names them. Returns the names of the others
        (a vision tower, a projector), which no conversion reads."""
        text = self.config.get("text_config")
        prefix = next((p for p in TEXT_MODEL_PREFIXES if any(n.startswith(p) for n in self.tensors)), None)
        if not isinstance(text, dict) or prefix is None:
            return []
        quantization = self.config.get("quantization_config")
        self.config = dict(text)
        if quantization is not None:  # the wrapper's, unless the text model has its own
            self.config.setdefault("quantization_config", quantization)
        renamed = {n: TEXT_MODEL_PREFIXES[prefix] + n[len(prefix):] for n in self.tensors if n.startswith(prefix)}
        if prefix == "model.language_model.":
            renamed.update((n, n) for n in TEXT_MODEL_TOP if n in self.tensors)
        others = sorted(n for n in self.tensors if n not in renamed)
        self.tensors = {new: replace(self.tensors[old], name=new) for old, new in renamed.items()}
        return others

    def _release_view(self) -> None:
        """A release named otherwise than transformers writes it (RELEASE_NAMES: recognized by
        its unprefixed embedding) is read under transformers' names; a checkpoint transformers
        saved otherwise than the release (SAVED_NAMES), under the release's."""
        model_type = self.config.get("model_type")
        renames = RELEASE_NAMES.get(model_type) if isinstance(model_type, str) else None
        if renames is None or "embed.weight" not in self.tensors:
            renames = SAVED_NAMES.get(model_type) if isinstance(model_type, str) else None
        if renames is None:
            return
        renamed = {}
        for name, entry in self.tensors.items():
            new = renamed_tensor(name, renames)
            renamed[new] = replace(entry, name=new)
        for fused, first, second in SAVED_HALVES.get(model_type, ()):
            for name in [n for n, e in renamed.items() if n.endswith(fused) and _halves_apart(e)]:
                entry, base = renamed.pop(name), name[:-len(fused)]
                half = replace(entry, shape=(entry.shape[0] // 2, *entry.shape[1:]), nbytes=entry.nbytes // 2)
                renamed[base + first] = replace(half, name=base + first)
                renamed[base + second] = replace(half, name=base + second, offset=entry.offset + half.nbytes)
        self.tensors = renamed

    def _check_index(self) -> None:
        index_path = self.directory / INDEX_NAME
        if not index_path.is_file():
            return
        for name, shard in read_weight_map(index_path).items():
            entry = self.tensors.get(name)
            if entry is None or entry.file.name != shard:
                raise CheckpointError(f"{shard}: does not contain tensor {name}, which {INDEX_NAME} places there")

    def source_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_raw(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """Bytes of `name[first:first+count]` (slicing the first axis), as a uint8 array."""
        return self._read_entry(self._entry(name), first, count)

    def _read_entry(self, entry: TensorEntry, first: int = 0, count: int | None = None) -> np.ndarray:
        """`read_raw` of a tensor's entry (a packed weight's part, whatever name it is listed by)."""
        rows = entry.shape[0] if entry.shape else 1
        count = rows - first if count is None else count
        row_bytes = entry.nbytes // rows if rows else 0
        nbytes = count * row_bytes
        buffer = np.empty(nbytes, dtype=np.uint8)
        got = os.preadv(self._fd(entry.file), [buffer], entry.offset + first * row_bytes)
        if got != nbytes:
            raise CheckpointError(f"{entry.file.name}: short read of tensor {entry.name} ({got} of {nbytes} bytes)")
        return buffer

    def read(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """`name[first:first+count]` decoded to float32 (FP8 weights scaled by their `_scale_inv`,
        packed INT4 by their group scales)."""
        entry = self._entry(name)
        if entry.dtype == PACKED_DTYPE:
            weight = self.packed[name]
            return compressed_tensors.dequantize(self.read_raw(weight.packed.name, first, count),
                                                 self.read(weight.scale.name, first, count), weight.cols)
        if entry.dtype == MXFP4_DTYPE:
            return mxfp4.dequantize(*self._mxfp4_parts(name, first, count))
        if entry.dtype not in FLOAT_DTYPES and entry.dtype not in INTEGER_DTYPES and entry.dtype != E8M0_DTYPE:
            raise CheckpointError(f"{entry.file.name}: tensor {name} has dtype {entry.dtype}, not a float type")
        count = (entry.shape[0] if entry.shape else 1) - first if count is None else count
        raw = self.read_raw(name, first, count)
        shape = (count, *entry.shape[1:]) if entry.shape else ()
        if entry.dtype == E8M0_DTYPE:
            return np.where(raw == 0xFF, np.float32(np.nan), np.ldexp(np.float32(1), raw.astype(np.int32) - 127)).reshape(shape)
        if entry.dtype in INTEGER_DTYPES:
            values = raw.view(INTEGER_DTYPES[entry.dtype]).reshape(shape)
            if values.size and np.abs(values).max() >= EXACT_FLOAT_INTEGERS:
                raise CheckpointError(f"{entry.file.name}: tensor {name} holds integers beyond {EXACT_FLOAT_INTEGERS}")
            return values.astype(np.float32)
        if entry.dtype == "F32":
            return raw.view("<f4").reshape(shape)
        if entry.dtype == "F16":
            return raw.view("<f2").astype(np.float32).reshape(shape)
        if entry.dtype == "BF16":
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return self._dequantize_fp8(name, E4M3_TO_F32[raw].reshape(shape), first)

    def _entry(self, name: str) -> TensorEntry:
        """A listed tensor, or one of the tensors a packed weight consists of."""
        return self.tensors[name] if name in self.tensors else self.parts[name]

    def holds_q4_0(self, name: str) -> bool:
        """Whether tensor `name` is packed INT4 in groups of 32, which Q4_0 holds exactly."""
        weight = self.packed.get(name)
        return weight is not None and weight.group == compressed_tensors.Q4_0_GROUP

    def q4_0_copy(self, name: str) -> np.ndarray | None:
        """A tensor that `holds_q4_0` as Q4_0 bytes [rows, row bytes] (the same values, no float
        in between), or None for any other tensor."""
        if not self.holds_q4_0(name):
            return None
        weight = self.packed[name]
        return compressed_tensors.q4_0_blocks(self.read_raw(weight.packed.name), self.read(weight.scale.name), weight.cols)

    def mxfp4_copy(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """MXFP4 weight `name[first:first+count]` as GGML MXFP4 bytes [..., row bytes] (the same
        values, no float in between)."""
        return mxfp4.ggml_blocks(*self._mxfp4_parts(name, first, count))

    def _mxfp4_parts(self, name: str, first: int, count: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, scales) of MXFP4 weight `name[first:first+count]`, in their shapes."""
        weight = self.mxfp4[name]
        count = weight.blocks.shape[0] - first if count is None else count
        blocks = self._read_entry(weight.blocks, first, count).reshape(count, *weight.blocks.shape[1:])
        return blocks, self._read_entry(weight.scales, first, count).reshape(count, *weight.scales.shape[1:])

    def _dequantize_fp8(self, name: str, values: np.ndarray, first: int) -> np.ndarray:
        """FP8 values times their scales: DeepSeek's `.weight_scale_inv`, one per FP8_BLOCK²
        block, or compressed-tensors' `.weight_scale`, one per block, per row or per tensor."""
        base, where = name.removesuffix(".weight"), self.tensors[name].file.name
        scale_name = next((base + s for s in FP8_SCALES if base + s in self.tensors), None)
        if values.ndim != 2 or scale_name is None:
            raise CheckpointError(f"{where}: FP8 tensor {name} has no scale ({' or '.join(base + s for s in FP8_SCALES)})")
        rows, cols = values.shape
        total = self.tensors[name].shape[0]
        scales = self.read(scale_name)
        blocks = (-(-total // FP8_BLOCK), -(-cols // FP8_BLOCK))
        if scales.shape == blocks:
            if first % FP8_BLOCK:
                raise ValueError(f"FP8 tensors are read in whole {FP8_BLOCK}-row blocks, not from row {first}")
            block_rows = scales[first // FP8_BLOCK : first // FP8_BLOCK + -(-rows // FP8_BLOCK)]
            return values * np.repeat(np.repeat(block_rows, FP8_BLOCK, axis=0)[:rows], FP8_BLOCK, axis=1)[:, :cols]
        if scales.shape == (total, 1):
            return values * scales[first:first + rows]
        if scales.size == 1 and scales.ndim <= 2:
            return values * scales.reshape(())
        raise CheckpointError(f"{self.tensors[scale_name].file.name}: {scale_name} has shape {list(scales.shape)}, "
                              f"expected {list(blocks)} (blocks of {FP8_BLOCK}), [{total}, 1] (rows) or [1] (the tensor)")
