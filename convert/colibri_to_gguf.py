"""colibri export-gguf DIR OUT.gguf: a colibri model as a GGUF that llama.cpp runs.

The inverse of `convert.gguf_to_colibri`, blocks copied, never re-quantized: llama.cpp's
metadata keys and tensor names (`convert.gguf_arch`), each layer's routed experts stacked
again as `blk.N.ffn_{gate,up,down}_exps` (the experts' bytes concatenated in expert
order), Q and K rows permuted back into llama.cpp's order for `llama`, and the tokenizer
as `tokenizer.ggml.*` metadata (`convert.gguf_tokenizer`). DeepSeek's `attn_kv_b` is
written unsplit, the form llama.cpp's deepseek2 still loads when `key_length_mla` is absent,
so no block is re-encoded; for glm-dsa, which loads only the split form, it becomes
`attn_v_b` (its value rows copied) and `attn_k_b` (its key rows transposed per head, F32:
their exact values); Qwen3-Next's `ssm_beta` and `ssm_alpha` are joined by whole rows into
its `ssm_ba` (`Adapter.gguf_joined`).

Everything that could fail is checked before a byte is written. Tensor data is streamed
with `pread` in bounded chunks; the files are written under temp names in a
`.OUT.gguf.partial` folder next to OUT, fsynced, and renamed into place at the end. With
`split_max_size`, the parts follow llama.cpp's naming, `OUT-00001-of-0000N.gguf`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from colibri.convert.arch import ADAPTERS
from colibri.convert.gguf_arch import (
    ROPE_FREQS, expert_tensor_name, gguf_arch_name, gguf_tensor_name, layer_of, permuted_heads, rope_freq_factors,
    tensor_chunks, write_arch_metadata,
)
from colibri.convert.gguf_source import ByteReader, read_ahead
from colibri.convert.pipeline import ConvertError, check_free_space
from colibri.convert.quantize_q4k import dequantize
from colibri.formats.config_check import EXPERT_ID_TABLE
from colibri.formats.layout import EXPERT_MATRICES, ModelLayout, fsync_dir

# the llama.cpp file type named by the encoding that holds most of the weights
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K, "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL, "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE, "TQ1_0": gguf.LlamaFileType.MOSTLY_TQ1_0,
    "TQ2_0": gguf.LlamaFileType.MOSTLY_TQ2_0, "IQ3_XXS": gguf.LlamaFileType.MOSTLY_IQ3_XXS,
    "IQ3_S": gguf.LlamaFileType.MOSTLY_IQ3_S, "IQ2_XXS": gguf.LlamaFileType.MOSTLY_IQ2_XXS,
    "IQ2_XS": gguf.LlamaFileType.MOSTLY_IQ2_XS, "IQ2_S": gguf.LlamaFileType.MOSTLY_IQ2_S,
    "IQ1_S": gguf.LlamaFileType.MOSTLY_IQ1_S, "IQ1_M": gguf.LlamaFileType.MOSTLY_IQ1_M,
}


@dataclass(frozen=True)
class ExportTensor:
    """One GGUF tensor and where its bytes come from."""

    name: str
    shape: tuple[int, ...]  # row-major
    encoding: str
    nbytes: int
    pieces: tuple[tuple[str, int, int], ...]  # (file, offset, nbytes), concatenated in order
    heads: int = 0  # > 0: rows permuted into llama.cpp's Q/K order over this many heads

    def chunks(self, reader: ByteReader):
        for file, offset, nbytes in self.pieces:
            yield from tensor_chunks(reader, file, offset, nbytes, self.shape[0], self.heads, to_gguf=True)


@dataclass(frozen=True)
class TransposedKeys:
    """MLA's attn_k_b [heads, rank, nope] as llama.cpp stores it: the key rows of each head of
    attn_kv_b, transposed, in F32 (exactly the stored blocks' values: transposed blocks cannot
    be copied)."""

    name: str
    shape: tuple[int, int, int]
    kv_b: tuple[str, int, int, str]  # attn_kv_b's file, offset, bytes per row and encoding
    rows_per_head: int  # nope + v rows of attn_kv_b per head
    encoding: str = "F32"

    @property
    def nbytes(self) -> int:
        return 4 * self.shape[0] * self.shape[1] * self.shape[2]

    def chunks(self, reader: ByteReader):
        file, offset, row, encoding = self.kv_b
        heads, rank, nope = self.shape
        for h in range(heads):
            data = reader.read(file, offset + h * self.rows_per_head * row, nope * row).reshape(nope, row)
            yield np.ascontiguousarray(dequantize(data, encoding, rank).T, dtype=np.float32).view(np.uint8).reshape(-1)


@dataclass(frozen=True)
class IntegerTable:
    """DeepSeek-V4's token → experts table as llama.cpp loads it: I32 (stored as whole float32s)."""

    name: str
    shape: tuple[int, ...]
    source: tuple[str, int, int]  # file, offset, bytes of the float32 values
    encoding: str = "I32"

    @property
    def nbytes(self) -> int:
        return self.source[2]

    def chunks(self, reader: ByteReader):
        yield reader.read(*self.source).view(np.float32).astype(np.int32).view(np.uint8)


@dataclass(frozen=True)
class ComputedVector:
    """An F32 vector the config implies and no stored tensor holds (llama.cpp's `rope_freqs`)."""

    name: str
    values: tuple[float, ...]
    encoding: str = "F32"

    @property
    def shape(self) -> tuple[int]:
        return (len(self.values),)

    @property
    def nbytes(self) -> int:
        return 4 * len(self.values)

    def chunks(self, reader: ByteReader):
        yield np.asarray(self.values, "<f4").view(np.uint8)


def split_kv_b(layout: ModelLayout, name: str) -> list:
    """attn_kv_b as llama.cpp's glm-dsa loads it: attn_k_b (`TransposedKeys`) and attn_v_b
    [heads, v, rank], each head's value rows copied."""
    c, t = layout.config, layout.tensors[name]
    per_head, row, file = c.qk_nope_head_dim + c.v_head_dim, t.nbytes // t.shape[0], str(layout.path(t.file))
    keys = TransposedKeys(name.replace("attn_kv_b", "attn_k_b"), (c.n_heads, c.kv_lora_rank, c.qk_nope_head_dim),
                          (file, t.offset, row, t.encoding), per_head)
    spans = tuple((file, t.offset + (h * per_head + c.qk_nope_head_dim) * row, c.v_head_dim * row) for h in range(c.n_heads))
    values = ExportTensor(name.replace("attn_kv_b", "attn_v_b"), (c.n_heads, c.v_head_dim, c.kv_lora_rank), t.encoding,
                          c.n_heads * c.v_head_dim * row, spans)
    return [keys, values]


def export_tensors(layout: ModelLayout) -> list[ExportTensor]:
    """The GGUF's tensors in llama.cpp's order: embeddings, each layer (its experts last), output."""
    c, path = layout.config, lambda file: str(layout.path(file))
    by_layer: dict[int | None, list[ExportTensor]] = defaultdict(list)
    adapter = ADAPTERS[c.architecture]
    joined = adapter.gguf_joined(c)
    parts = {name for pieces in joined.values() for name, _, _ in pieces}
    for t in layout.tensors.values():
        if adapter.gguf_split_kv_b and t.name.endswith(".attn_kv_b.weight"):
            by_layer[layer_of(t.name)] += split_kv_b(layout, t.name)
        elif t.name.endswith(EXPERT_ID_TABLE):
            by_layer[layer_of(t.name)].append(IntegerTable(t.name, t.shape, (path(t.file), t.offset, t.nbytes)))
        elif t.name not in parts:
            name = gguf_tensor_name(c, t.name)
            by_layer[layer_of(t.name)].append(
                ExportTensor(name, adapter.gguf_shape(name, t.shape), t.encoding, t.nbytes,
                             ((path(t.file), t.offset, t.nbytes),), permuted_heads(c, t.name)))
    for name, pieces in joined.items():
        by_layer[layer_of(name)].append(joined_tensor(layout, name, pieces))
    for table in layout.expert_layers.values():
        for m in EXPERT_MATRICES:
            matrix = table.matrices[m]
            pieces = tuple((path(table.file), table.expert_offset(e) + matrix.offset, matrix.nbytes) for e in range(table.count))
            by_layer[table.layer].append(ExportTensor(expert_tensor_name(table.layer, m), (table.count, *matrix.shape),
                                                      matrix.encoding, table.count * matrix.nbytes, pieces))
    outside = by_layer.pop(None, [])
    factors = rope_freq_factors(c)
    if factors is not None:
        outside.insert(0, ComputedVector(ROPE_FREQS, tuple(float(f) for f in factors)))
    embeddings = [t for t in outside if t.name == "token_embd.weight"]
    layers = [t for layer in sorted(by_layer) for t in by_layer[layer]]
    return embeddings + layers + [t for t in outside if t.name != "token_embd.weight"]


def joined_tensor(layout: ModelLayout, name: str, pieces: list[tuple[str, int, int]]) -> ExportTensor:
    """GGUF tensor `name` of rows of colibri tensors, whole rows moved (one encoding for all)."""
    sources = [layout.tensors[part] for part, _, _ in pieces]
    if len({t.encoding for t in sources}) != 1 or len({t.shape[1:] for t in sources}) != 1:
        raise ConvertError(f"{name}: joins {', '.join(sorted({t.name for t in sources}))}, which differ in encoding or width")
    row = sources[0].nbytes // sources[0].shape[0]
    spans = tuple((str(layout.path(t.file)), t.offset + first * row, count * row) for t, (_, first, count) in zip(sources, pieces))
    rows = sum(count for _, _, count in pieces)
    return ExportTensor(name, (rows, *sources[0].shape[1:]), sources[0].encoding, rows * row, spans)


def file_type(tensors: list[ExportTensor]) -> gguf.LlamaFileType:
    weight_bytes: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2 and t.encoding in FILE_TYPES:
            weight_bytes[t.encoding] = weight_bytes.get(t.encoding, 0) + t.nbytes
    return FILE_TYPES[max(weight_bytes, key=weight_bytes.get)]


def gguf_writer(model_dir: Path, layout: ModelLayout, tensors: list[ExportTensor], split_max_size: int) -> gguf.GGUFWriter:
    """A GGUFWriter holding all metadata and tensor infos (nothing written yet)."""
    from colibri.convert.gguf_tokenizer import GGUFTokenizerError, add_tokenizer_metadata

    c = layout.config
    writer = gguf.GGUFWriter(None, gguf_arch_name(c), split_max_size=split_max_size)
    writer.add_name(model_dir.resolve().name)
    write_arch_metadata(writer, c)
    writer.add_file_type(file_type(tensors))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    try:
        add_tokenizer_metadata(writer, model_dir)
    except GGUFTokenizerError as e:
        raise ConvertError(str(e)) from None
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=gguf.GGMLQuantizationType[t.encoding])
    return writer


def export_gguf(model_dir, out, split_max_size: int = 0, progress: bool = True) -> dict:
    """Write the colibri model in `model_dir` as GGUF `out` (split when `split_max_size`); returns a summary."""
    started = time.monotonic()
    model_dir, out = Path(model_dir), Path(out)
    if out.suffix != ".gguf":
        raise ConvertError(f"{out}: the output must be a .gguf file name")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: no such folder")
    layout = ModelLayout(model_dir)
    for file in layout.manifest["files"]:
        layout.check_size(file)
    tensors = export_tensors(layout)
    writer = gguf_writer(model_dir, layout, tensors, split_max_size)
    names = [p.name for p in writer.format_shard_names(out)]
    total = sum(t.nbytes for t in tensors)
    check_free_space(out.parent, total)

    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    sources = {t.name: t for t in tensors}
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="exporting", disable=not progress, dynamic_ncols=True)
    try:
        writer.write_header_to_file(staging / out.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with ByteReader() as reader:
            for fout, infos in zip(writer.fout, writer.tensors):
                writer.write_padding(fout, fout.tell())
                for name, info in infos.items():
                    for chunk in read_ahead(sources[name].chunks(reader)):
                        fout.write(chunk)
                        bar.update(len(chunk))
                    writer.write_padding(fout, info.nbytes)
                fout.flush()
                os.fsync(fout.fileno())
        writer.close()
        for name in names:
            os.replace(staging / name, out.with_name(name))
        fsync_dir(out.parent)
    finally:
        bar.close()
        writer.close()
        shutil.rmtree(staging, ignore_errors=True)
    files = {name: out.with_name(name).stat().st_size for name in names}
    return {"model": str(model_dir), "files": files, "tensors": len(tensors), "architecture": gguf_arch_name(layout.config),
            "file_type": file_type(tensors).name, "seconds": time.monotonic() - started}


def format_export_summary(s: dict) -> str:
    size = sum(s["files"].values())
    lines = [f"exported {s['model']} as GGUF {s['architecture']} ({s['file_type']}, {s['tensors']} tensors, "
             f"{size / 1e9:.3f} GB) in {s['seconds']:.1f} s"]
    lines += [f"  {name}  {nbytes / 1e9:.3f} GB" for name, nbytes in s["files"].items()]
    return "\n".join(lines)

