"""colibri-convert MODEL.gguf OUT: import a GGUF model without re-quantizing.

The colibri layout stores GGML blocks unchanged, so importing is a re-layout: every
resident tensor's bytes are copied as they are, and each stacked
`blk.N.ffn_{gate,up,down}_exps` tensor is cut into per-expert records (expert e is one
contiguous slice). Two tensors change form, losslessly: for `llama` the Q/K rows are put
back in transformers' order (whole rows move, blocks are untouched), and a DeepSeek
`attn_kv_b` stored as `attn_k_b`/`attn_v_b` is rebuilt exactly, as F32 (k_b is stored
transposed per head, so its blocks cannot be reused); Qwen3-Next's `ssm_ba` is cut by whole
rows into `ssm_beta` and `ssm_alpha` (`Adapter.gguf_joined`). Multi-token-prediction layers are
dropped. The tokenizer is rebuilt from the GGUF's tokenizer metadata.

Everything is checked before anything is written — metadata, tensor names, shapes and
types (only those colibri's kernels compute: formats.encodings.ENCODINGS) — and then
`convert.pipeline` runs the units (resumable, `--workers`, manifest last) with `pread`
in bounded chunks, so memory stays small whatever the file size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.convert.arch import ADAPTERS
from colibri.convert.expert_layout import expert_file_bytes, write_expert_layer
from colibri.convert.gguf_arch import (
    ROPE_FREQS, GGUFMetadata, config_from_gguf, expert_shapes, expert_tensor_name, gguf_tensor_name, kv_b_from_split,
    layer_of, permuted_heads, resident_shapes, tensor_chunks,
)
from colibri.convert.gguf_source import ByteReader, GGUFError, GGUFSource, GGUFTensor, read_ahead
from colibri.convert.pipeline import ConvertOptions, Job
from colibri.convert.quantize_q4k import dequantize
from colibri.convert.resident_layout import ResidentTensorData, resident_file_bytes, write_resident_file
from colibri.formats.config_check import EXPERT_ID_TABLE
from colibri.formats.encodings import ENCODINGS, row_bytes
from colibri.formats.layout import EXPERT_MATRICES, VECTOR_ENCODINGS
from colibri.formats.messages import some
from colibri.formats.model_config import ModelConfig

MAX_LISTED = 8  # offending tensors named in one error line


@dataclass(frozen=True)
class CopiedTensor:
    """A resident tensor whose bytes are copied (rows un-permuted for llama's Q/K when `heads`)."""

    name: str
    encoding: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    heads: int = 0

    @property
    def source_bytes(self) -> int:
        return self.nbytes

    def chunks(self, reader: ByteReader):
        return tensor_chunks(reader, self.file, self.offset, self.nbytes, self.shape[0], self.heads, to_gguf=False)


@dataclass(frozen=True)
class GatheredRows:
    """A resident tensor whose rows are spans of whole rows of other tensors (byte copies)."""

    name: str
    encoding: str
    shape: tuple[int, ...]
    spans: tuple[tuple[str, int, int], ...]  # (file, offset, nbytes), in order

    @property
    def source_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.spans)

    def chunks(self, reader: ByteReader):
        for file, offset, nbytes in self.spans:
            yield from tensor_chunks(reader, file, offset, nbytes, 1)


@dataclass(frozen=True)
class FloatTable:
    """DeepSeek-V4's token → experts table: llama.cpp's I32 values as the layout's float32."""

    name: str
    shape: tuple[int, ...]
    source: GGUFTensor
    encoding: str = "F32"

    @property
    def source_bytes(self) -> int:
        return self.source.nbytes

    def chunks(self, reader: ByteReader):
        yield reader.read(self.source.file, self.source.offset, self.source.nbytes).view("<i4").astype(np.float32).view(np.uint8)


@dataclass(frozen=True)
class RebuiltKvB:
    """DeepSeek's attn_kv_b, rebuilt in F32 from attn_k_b and attn_v_b, one head at a time."""

    name: str
    shape: tuple[int, int]
    k_b: GGUFTensor  # [heads, rank, nope]
    v_b: GGUFTensor  # [heads, v, rank]
    encoding: str = "F32"

    @property
    def source_bytes(self) -> int:
        return self.k_b.nbytes + self.v_b.nbytes

    def chunks(self, reader: ByteReader):
        heads = self.k_b.shape[0]
        for h in range(heads):
            k_b = self._head(reader, self.k_b, h)
            v_b = self._head(reader, self.v_b, h)
            yield kv_b_from_split(k_b[None], v_b[None]).astype(np.float32).view(np.uint8).reshape(-1)

    @staticmethod
    def _head(reader: ByteReader, t: GGUFTensor, h: int) -> np.ndarray:
        rows, n = t.shape[1:]
        size = t.nbytes // t.shape[0]
        data = reader.read(t.file, t.offset + h * size, size).reshape(rows, row_bytes(t.type, n))
        return dequantize(data, t.type, n)


@dataclass(frozen=True)
class ResidentImport:
    tensors: tuple  # CopiedTensor | RebuiltKvB, in the resident file's order
    name: str = "resident"


@dataclass(frozen=True)
class ExpertSlice:
    """Where one matrix of expert e lies: `file`, `offset + e * stride`, `nbytes` bytes."""

    file: str
    offset: int
    stride: int
    nbytes: int


@dataclass(frozen=True)
class ExpertImport:
    layer: int
    count: int
    encodings: tuple[tuple[str, str], ...]  # (matrix, encoding)
    shapes: tuple[tuple[str, tuple[int, int]], ...]
    slices: tuple[ExpertSlice, ...]  # gate, up, down

    @property
    def name(self) -> str:
        return f"experts.{self.layer:03d}"


def run_unit(out_dir: Path, unit, advance) -> dict:
    """Write one unit of an import into `out_dir`; returns its manifest fragment."""
    with ByteReader() as reader:
        if isinstance(unit, ResidentImport):
            tensors = (ResidentTensorData(t.name, t.encoding, t.shape, read_ahead(t.chunks(reader)), t.source_bytes) for t in unit.tensors)
            return write_resident_file(out_dir, tensors, advance)
        records = read_ahead([reader.read(s.file, s.offset + e * s.stride, s.nbytes) for s in unit.slices] for e in range(unit.count))
        per_expert = sum(s.nbytes for s in unit.slices)
        return write_expert_layer(out_dir, unit.layer, unit.count, dict(unit.encodings), dict(unit.shapes),
                                  lambda e: next(records), lambda e: advance(per_expert))  # asked for in expert order


def unit_source_bytes(unit) -> int:
    if isinstance(unit, ResidentImport):
        return sum(t.source_bytes for t in unit.tensors)
    return unit.count * sum(s.nbytes for s in unit.slices)


def unit_output_bytes(unit) -> int:
    if isinstance(unit, ResidentImport):
        return resident_file_bytes((t.encoding, t.shape) for t in unit.tensors)
    return expert_file_bytes(dict(unit.encodings), dict(unit.shapes), unit.count)


# --- planning -----------------------------------------------------------------------


def same_shape(a: tuple, b: tuple) -> bool:
    """Equal up to unit dimensions, which do not move a value (a [1, n] gate may be stored as
    [n], Kimi-Linear's convolution [channels, kernel] as [1, channels, 1, kernel])."""
    return tuple(d for d in a if d != 1) == tuple(d for d in b if d != 1)


class ImportPlan:
    """The units of an import, after checking every tensor against the metadata."""

    def __init__(self, source: GGUFSource, config: ModelConfig):
        self.source, self.config = source, config
        present = dict(source.tensors)
        self.skipped = sorted(n for n in present if (layer_of(n) or 0) >= config.n_layers)  # multi-token prediction
        for name in self.skipped:
            present.pop(name)
        self.present, self.used, self.missing, self.misshapen = present, set(), [], []
        self.rebuilt: list[str] = []
        if ROPE_FREQS in present and (config.rope_scaling or {}).get("rope_type") == "factors":
            self.used.add(ROPE_FREQS)  # read into the config's rope scaling
        # colibri's tensors that are rows of one of llama.cpp's: name → [(GGUF name, first row, rows)]
        self.parts: dict[str, list[tuple[str, int, int]]] = {}
        self.joined_rows: dict[str, int] = {}  # each such GGUF tensor's rows
        for joined, pieces in ADAPTERS[config.architecture].gguf_joined(config).items():
            at = 0
            for part, first, count in pieces:
                self.parts.setdefault(part, []).append((joined, at, count))
                at += count
            self.joined_rows[joined] = at
        resident = [t for name, shape in resident_shapes(config).items() if (t := self._resident(name, shape))]
        experts = [self._experts(layer) for layer in config.moe_layers]
        self._refuse_inconsistent()
        self.units = [ResidentImport(tuple(resident)), *[e for e in experts if e]]

    def _tensor(self, name: str, shape: tuple) -> GGUFTensor | None:
        t = self.present.get(name)
        if t is None:
            self.missing.append(name)
        elif not same_shape(t.shape, shape):
            self.misshapen.append(f"{name} has shape {list(t.shape)}, the metadata implies {list(shape)}")
        else:
            self.used.add(name)
            return t
        return None

    def _resident(self, name: str, shape: tuple):
        if name in self.parts:
            return self._gathered(name, shape)
        split = name.replace("attn_kv_b", "attn_k_b"), name.replace("attn_kv_b", "attn_v_b")
        if name.endswith(".attn_kv_b.weight") and name not in self.present and all(n in self.present for n in split):
            c = self.config
            k_b = self._tensor(split[0], (c.n_heads, c.kv_lora_rank, c.qk_nope_head_dim))
            v_b = self._tensor(split[1], (c.n_heads, c.v_head_dim, c.kv_lora_rank))
            self.rebuilt.append(name)
            return RebuiltKvB(name, shape, k_b, v_b) if k_b and v_b else None
        if name.endswith(".attn_kv_b.weight"):  # a GGUF holding both forms: attn_k_b/attn_v_b are redundant
            self.skipped += [n for n in split if self.present.pop(n, None)]
        t = self._tensor(gguf_tensor_name(self.config, name), shape)
        if t and name.endswith(EXPERT_ID_TABLE) and t.type == "I32":
            return FloatTable(name, shape, t)
        return t and CopiedTensor(name, t.type, shape, str(t.file), t.offset, t.nbytes, permuted_heads(self.config, name))

    def _gathered(self, name: str, shape: tuple) -> GatheredRows | None:
        """Tensor `name` from its rows in llama.cpp's joined tensors (`Adapter.gguf_joined`)."""
        joined = self.parts[name][0][0]
        rows = self.joined_rows[joined]
        t = self._tensor(joined, (rows, *shape[1:]))
        if t is None:
            return None
        row = t.nbytes // rows
        return GatheredRows(name, t.type, shape, tuple((str(t.file), t.offset + at * row, count * row)
                                                       for _, at, count in self.parts[name]))

    def _experts(self, layer: int) -> ExpertImport | None:
        c, shapes = self.config, expert_shapes(self.config)
        fused = f"blk.{layer}.ffn_gate_up_exps.weight"
        slices, types = {}, {}
        if fused in self.present:  # gate and up stacked in one tensor: [experts, 2·ffn, hidden]
            rows, cols = shapes["gate"]
            t = self._tensor(fused, (c.n_experts, 2 * rows, cols))
            if t:
                half = t.nbytes // c.n_experts // 2
                slices = {"gate": ExpertSlice(str(t.file), t.offset, 2 * half, half), "up": ExpertSlice(str(t.file), t.offset + half, 2 * half, half)}
                types = {"gate": t.type, "up": t.type}
        for m in EXPERT_MATRICES:
            if m in slices or (m != "down" and fused in self.present):
                continue
            t = self._tensor(expert_tensor_name(layer, m), (c.n_experts, *shapes[m]))
            if t:
                slices[m], types[m] = ExpertSlice(str(t.file), t.offset, t.nbytes // c.n_experts, t.nbytes // c.n_experts), t.type
        if len(slices) < 3:
            return None
        return ExpertImport(layer, c.n_experts, tuple((m, types[m]) for m in EXPERT_MATRICES),
                            tuple((m, tuple(shapes[m])) for m in EXPERT_MATRICES), tuple(slices[m] for m in EXPERT_MATRICES))

    def _refuse_inconsistent(self) -> None:
        file, c = self.source.name, self.config
        if self.missing:
            raise GGUFError(f"{file}: lacks tensor {some(self.missing, MAX_LISTED)}, which its metadata implies for {c.architecture}")
        if self.misshapen:
            raise GGUFError(f"{file}: tensor {some(self.misshapen, 1)}")
        unexpected = sorted(set(self.present) - self.used)
        if unexpected:
            raise GGUFError(f"{file}: unexpected tensor {some(unexpected, MAX_LISTED)} for {c.architecture} as its metadata describes it")
        unsupported = [f"{n} ({t.type})" for n, t in self.present.items()
                       if t.type not in ENCODINGS and not (n.endswith(EXPERT_ID_TABLE) and t.type == "I32")]
        if unsupported:
            raise GGUFError(f"{file}: {len(unsupported)} tensors have types colibri cannot compute "
                            f"(supported: {', '.join(ENCODINGS)}): {some(unsupported, MAX_LISTED)}")
        packed = [f"{n} ({t.type})" for n, t in self.present.items() if len(t.shape) == 1 and t.type not in VECTOR_ENCODINGS]
        if packed:
            raise GGUFError(f"{file}: vectors stored block-quantized (norms and biases are "
                            f"{', '.join(VECTOR_ENCODINGS)}): {some(packed, MAX_LISTED)}")


def tokenizer_files(source: GGUFSource) -> dict[str, bytes]:
    from colibri.convert.gguf_tokenizer import GGUFTokenizerError, tokenizer_files_from_gguf

    try:
        return tokenizer_files_from_gguf(source.reader)
    except GGUFTokenizerError as e:
        raise GGUFError(f"{source.name}: {e}") from None


def gguf_job(src: str, options: ConvertOptions) -> Job:
    """Plan the import of a GGUF file (or split set): everything checked, nothing written."""
    if options.quant or options.overrides or options.imatrix or options.target_size:
        raise GGUFError(f"{Path(src).name}: a GGUF is imported with its own types, never re-quantized; "
                        "drop --quant/--override/--imatrix/--target-size")
    source = GGUFSource(src)
    try:
        config = config_from_gguf(GGUFMetadata(source), {n: t.shape for n, t in source.tensors.items()})
    except (TypeError, ValueError, KeyError, OverflowError, ZeroDivisionError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{source.name}: a metadata value of the wrong type or range ({type(e).__name__}: {e})") from None
    plan = ImportPlan(source, config)
    sizes = source.file_sizes()
    rebuilt = f", attn_kv_b of {len(plan.rebuilt)} layers rebuilt in F32 from attn_k_b/attn_v_b" if plan.rebuilt else ""
    return Job(
        config=config,
        units=plan.units,
        run_unit=run_unit,
        source_bytes={u.name: unit_source_bytes(u) for u in plan.units},
        output_bytes={u.name: unit_output_bytes(u) for u in plan.units},
        quant={"recipe": "GGUF", "overrides": [], "imatrix": None},
        provenance={"source": str(source.parts[0].resolve()), "revision": None,
                    "source_files": {name: {"size": size, "sha256": None} for name, size in sizes.items()},
                    "skipped_tensors": sorted(plan.skipped)},
        tokenizer_files=tokenizer_files(source),
        total_source_bytes=sum(sizes.values()),
        threads=True,
        action=f"imported {config.architecture} from GGUF ({len(sizes)} file{'s' * (len(sizes) > 1)}, blocks copied unchanged{rebuilt})",
    )
