"""colibri-convert: a Hugging Face checkpoint (or a GGUF file) → the colibri layout.

A checkpoint folder or hub repo id is planned here — every tensor checked against
config.json, each tensor's encoding chosen by the quant recipe — into units of work
(the resident file, one file per MoE layer) that `convert.pipeline` carries out:
resumably, in `workers` processes, the manifest last. A `.gguf` source goes to
`convert.gguf_to_colibri`, which copies its blocks instead of quantizing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from colibri.convert.imatrix import Imatrix, imatrix_record
from colibri.convert.expert_layout import expert_file_bytes, write_expert_layer
from colibri.convert.pipeline import TOKENIZER_FILES, ConvertError, ConvertOptions, Job, format_summary, run_job
from colibri.convert.plan import ConversionPlan, ExpertLayerSource, ResidentTensor, make_plan
from colibri.convert.quantize_q4k import quantize
from colibri.convert.resident_layout import ResidentTensorData, resident_file_bytes, write_resident_file
from colibri.convert.target_size import fit_to_size, measure_all, refine, sample_rows
from colibri.formats.checkpoint import HUB_REPO_ID, MXFP4_DTYPE, Checkpoint, cache_blob_sha256
from colibri.formats.layout import EXPERT_MATRICES
from colibri.formats.messages import some
from colibri.formats.recipe import Recipe

__all__ = ["ConvertError", "ConvertOptions", "convert", "format_summary"]

DEFAULT_QUANT = "Q4_K_M"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.*"]
CHUNK_BYTES = 32 << 20  # float32 bytes of one resident read; bounds memory for huge embeddings


# --- source ---------------------------------------------------------------------------


def resolve_source(src: str, revision: str | None) -> tuple[Path, dict]:
    """A local folder, or a hub repo id fetched (resumably, only what is needed) into the HF cache."""
    path = Path(src)
    if path.exists():
        return path.resolve(), {"source": str(path.resolve()), "revision": None}
    if not HUB_REPO_ID.match(src):
        raise ConvertError(f"{src}: no such file or folder, and not a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(src, revision=revision, allow_patterns=HUB_PATTERNS)
    except Exception as online_error:  # offline, unreachable, or gated: fall back to the local cache
        try:
            local = snapshot_download(src, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True)
        except Exception:
            raise ConvertError(f"{src}: cannot download ({type(online_error).__name__}) and not in the local Hugging Face cache") from None
    return Path(local), {"source": src, "revision": Path(local).name}


def source_files(checkpoint: Checkpoint) -> dict:
    """Size of every shard, and its sha256 when the HF cache names the blob by it."""
    files = {}
    for shard in checkpoint.shards:
        path = checkpoint.directory / shard
        files[shard] = {"size": path.stat().st_size, "sha256": cache_blob_sha256(path)}
    return files


def tokenizer_files(source_dir: Path) -> dict[str, bytes]:
    """The tokenizer, chat template and config files the checkpoint has, to copy unchanged."""
    return {name: (source_dir / name).read_bytes() for name in TOKENIZER_FILES if (source_dir / name).is_file()}


# --- units of work ----------------------------------------------------------------------


@dataclass(frozen=True)
class ResidentUnit:
    tensors: tuple[tuple[ResidentTensor, str], ...]  # (tensor, encoding)
    name: str = "resident"


@dataclass(frozen=True)
class ExpertUnit:
    source: ExpertLayerSource
    encodings: tuple[tuple[str, str], ...]  # (matrix, encoding)

    @property
    def name(self) -> str:
        return f"experts.{self.source.layer:03d}"


def read_row_chunks(checkpoint: Checkpoint, name: str, shape: tuple[int, ...]):
    """`name` as float32 in chunks of whole rows (multiples of 128 rows, for FP8 block scales)."""
    if len(shape) < 2:
        yield checkpoint.read(name)
        return
    rows, row_floats = shape[0], int(np.prod(shape[1:]))
    step = max(128, CHUNK_BYTES // (4 * row_floats) // 128 * 128)
    for first in range(0, rows, step):
        yield checkpoint.read(name, first, min(step, rows - first))


def write_resident(checkpoint: Checkpoint, out_dir: Path, unit: ResidentUnit, advance, imatrix: Imatrix | None) -> dict:
    def importance(tensor):
        return imatrix.importance(tensor.name, tensor.shape[-1]) if imatrix is not None and len(tensor.shape) == 2 else None

    def encoded(tensor, encoding):
        copy = checkpoint.q4_0_copy(tensor.source) if encoding == "Q4_0" else None
        if copy is not None:
            return iter([copy])
        chunks = [checkpoint.read(tensor.source)] if tensor.rows is not None else \
            read_row_chunks(checkpoint, tensor.source, tensor.shape)
        return (quantize(tensor.select(chunk), encoding, weights) for weights in [importance(tensor)] for chunk in chunks)

    tensors = (
        ResidentTensorData(tensor.name, encoding, tensor.shape, encoded(tensor, encoding), checkpoint.tensors[tensor.source].nbytes)
        for tensor, encoding in unit.tensors
    )
    return write_resident_file(out_dir, tensors, advance)


def write_experts(checkpoint: Checkpoint, out_dir: Path, unit: ExpertUnit, advance, imatrix: Imatrix | None) -> dict:
    src, encodings = unit.source, dict(unit.encodings)

    def quantized(matrix: str, values: np.ndarray, e: int) -> np.ndarray:
        weights = imatrix.importance(src.canonical[matrix], values.shape[-1], e) if imatrix else None
        return quantize(values, encodings[matrix], weights)

    kept_mxfp4 = src.fused and all(checkpoint.tensors[n].dtype == MXFP4_DTYPE for n in src.names.fused_names) \
        and all(encodings[m] == "MXFP4" for m in EXPERT_MATRICES)  # MXFP4 blocks kept as they are

    def encode(e: int):
        if src.fused:
            gate_up_name, down_name = src.names.fused_names
            if kept_mxfp4:
                return list(src.names.split_fused(checkpoint.mxfp4_copy(gate_up_name, e, 1)[0],
                                                  checkpoint.mxfp4_copy(down_name, e, 1)[0]))
            return [quantized(m, v, e) for m, v in zip(EXPERT_MATRICES, expert_values(checkpoint, src, e))]
        encoded = []
        for matrix, name in zip(EXPERT_MATRICES, src.names.per_expert_names(e)):
            copy = checkpoint.q4_0_copy(name) if encodings[matrix] == "Q4_0" else None  # packed INT4 kept as it is
            if encodings[matrix] == "MXFP4" and checkpoint.tensors[name].dtype == MXFP4_DTYPE:
                copy = checkpoint.mxfp4_copy(name)  # DeepSeek-V4's FP4 experts, bits moved
            encoded.append(copy if copy is not None else quantized(matrix, checkpoint.read(name), e))
        return encoded

    source_bytes_per_expert = expert_source_bytes(checkpoint, src) // src.count
    return write_expert_layer(out_dir, src.layer, src.count, encodings, src.shapes, encode, lambda e: advance(source_bytes_per_expert))


def expert_values(checkpoint: Checkpoint, src: ExpertLayerSource, e: int) -> list[np.ndarray]:
    """Expert e's gate, up and down as float32."""
    if src.fused:
        gate_up_name, down_name = src.names.fused_names
        return list(src.names.split_fused(checkpoint.read(gate_up_name, e, 1)[0], checkpoint.read(down_name, e, 1)[0]))
    return [checkpoint.read(name) for name in src.names.per_expert_names(e)]


def expert_source_bytes(checkpoint: Checkpoint, src: ExpertLayerSource) -> int:
    if src.fused:
        return sum(checkpoint.tensors[n].nbytes for n in src.names.fused_names)
    return sum(checkpoint.tensors[n].nbytes for e in range(src.count) for n in src.names.per_expert_names(e))


def unit_source_bytes(checkpoint: Checkpoint, unit) -> int:
    if isinstance(unit, ResidentUnit):
        return sum(checkpoint.tensors[t.source].nbytes for t, _ in unit.tensors)
    return expert_source_bytes(checkpoint, unit.source)


def unit_output_bytes(unit) -> int:
    if isinstance(unit, ResidentUnit):
        return resident_file_bytes((enc, t.shape) for t, enc in unit.tensors)
    return expert_file_bytes(dict(unit.encodings), unit.source.shapes, unit.source.count)


def run_unit(source_dir: Path, imatrix_path: Path | None, out_dir: Path, unit, advance) -> dict:
    checkpoint = Checkpoint(source_dir)
    imatrix = Imatrix(imatrix_path) if imatrix_path is not None else None
    try:
        if isinstance(unit, ResidentUnit):
            return write_resident(checkpoint, out_dir, unit, advance, imatrix)
        return write_experts(checkpoint, out_dir, unit, advance, imatrix)
    finally:
        checkpoint.close()


# --- the whole conversion ---------------------------------------------------------------


def make_units(plan: ConversionPlan, recipe: Recipe, checkpoint: Checkpoint) -> list:
    resident = ResidentUnit(tuple((t, recipe.encoding(t.name, t.shape, kept_encoding(checkpoint, t.source)))
                                  for t in plan.resident))
    experts = [
        ExpertUnit(src, tuple((m, recipe.encoding(name, src.shapes[m], kept_encoding(checkpoint, expert_source_name(src, m))))
                              for m, name in src.canonical.items()))
        for src in plan.expert_layers
    ]
    return [resident, *experts]


def refuse_missing_importance(units: list, recipe: Recipe, imatrix: Imatrix | None, quant: str) -> None:
    """Refuse, before anything is written, a tensor whose type llama-quantize quantizes only with
    an importance matrix (the grid types) when there is none for it."""
    chosen = [(t.name, encoding) for t, encoding in units[0].tensors]
    chosen += [(name, dict(unit.encodings)[m]) for unit in units[1:] for m, name in unit.source.canonical.items()]
    needing = [(name, encoding) for name, encoding in chosen if recipe.needs_imatrix(name, encoding)]
    if needing and imatrix is None:
        name, encoding = needing[0]
        raise ConvertError(f"--quant {quant} needs --imatrix FILE: {name} and {len(needing) - 1} more tensors are {encoding} or "
                           "another type that llama-quantize quantizes only with an importance matrix "
                           "(`colibri imatrix` makes one)")
    lacking = [name for name, _ in needing if name not in imatrix]
    if lacking:
        raise ConvertError(f"--imatrix {imatrix.path.name} has no entry for {some(lacking)}, which --quant {quant} makes a "
                           "type llama-quantize quantizes only with one")


# --- --target-size --------------------------------------------------------------------

EXPERT_SAMPLES = 4  # experts of a layer whose rows are measured


def resident_sample(checkpoint: Checkpoint, tensor: ResidentTensor, imatrix: Imatrix | None, uses: float) -> list:
    """Evenly spaced rows of a resident matrix, its column importance, and its uses a token."""
    index = sample_rows(*tensor.shape)
    if tensor.rows is not None:
        values = tensor.select(checkpoint.read(tensor.source))[index]
    else:  # read in blocks of 128 rows (FP8's block scales), each holding some of the sampled rows
        parts = []
        for first in np.unique(index // 128) * 128:
            block = tensor.select(checkpoint.read(tensor.source, first, min(128, tensor.shape[0] - first)))
            parts.append(block[index[(index >= first) & (index < first + 128)] - first])
        values = np.concatenate(parts)
    importance = imatrix.importance(tensor.name, tensor.shape[-1]) if imatrix is not None else None
    return [(np.ascontiguousarray(values, np.float32), importance, uses)]


def expert_samples(values_of, src: ExpertLayerSource, matrix: str, imatrix: Imatrix | None, top_k: int) -> list:
    """Rows of a few of a layer's experts for one matrix, each with its importance and its share of
    the layer's routed tokens (scaled up for the experts not sampled); `values_of(layer, e)` gives
    expert e's three matrices."""
    name, (rows, cols) = src.canonical[matrix], src.shapes[matrix]
    picked = np.unique(np.linspace(0, src.count - 1, min(EXPERT_SAMPLES, src.count)).astype(np.int64))
    if imatrix is not None and name in imatrix:
        counts = np.array([imatrix.count(name, e) for e in range(src.count)])
        shares = top_k * counts / max(counts.sum(), 1.0)
    else:
        shares = np.full(src.count, top_k / src.count)
    index, samples = sample_rows(rows, cols), []
    for e in picked:
        values = values_of(src.layer, int(e))[EXPERT_MATRICES.index(matrix)][index]
        importance = imatrix.importance(name, cols, int(e)) if imatrix is not None else None
        samples.append((np.ascontiguousarray(values, np.float32), importance, shares[e] * src.count / len(picked)))
    return samples


def sized_types(plan: ConversionPlan, checkpoint: Checkpoint, recipe_for, imatrix: Imatrix | None,
                options: ConvertOptions) -> tuple[dict[str, str], list | None]:
    """--target-size: the type of every matrix whose type is chosen by measured damage
    (convert.target_size), and the tables `options.scorer` scored (None without it);
    `recipe_for(overrides)` is the recipe with those overrides. Matrices a user override names,
    kept encodings, and rows that are not whole 256-weight super-blocks keep the recipe's type."""
    config, base = plan.config, recipe_for(options.overrides)

    def chosen_here(name, shape, kept) -> bool:
        return kept is None and len(shape) == 2 and shape[-1] % 256 == 0 \
            and base.encoding(name, shape) not in ("F32", "F16", "BF16") \
            and not any(re.search(pattern, name) for pattern, _ in options.overrides)

    layers = {src.layer: src for src in plan.expert_layers}

    @lru_cache(maxsize=EXPERT_SAMPLES)  # a layer's sampled experts, read once for its three matrices
    def values_of(layer: int, e: int) -> list[np.ndarray]:
        return expert_values(checkpoint, layers[layer], e)

    tensors = []
    for t in plan.resident:
        if chosen_here(t.name, t.shape, kept_encoding(checkpoint, t.source)):
            uses = 1 / t.shape[0] if t.name == "token_embd.weight" and not config.tie_word_embeddings else 1.0
            tensors.append((t.name, t.shape[0], 1, False, partial(resident_sample, checkpoint, t, imatrix, uses)))
    for src in plan.expert_layers:
        for m, name in src.canonical.items():
            if chosen_here(name, src.shapes[m], kept_encoding(checkpoint, expert_source_name(src, m))):
                tensors.append((name, src.shapes[m][0], src.count, True,
                                partial(expert_samples, values_of, src, m, imatrix, config.n_experts_used)))
    choices = measure_all(tensors, options.progress)

    def sizes_of(table: dict) -> tuple[int, int]:
        """(weight-file bytes, expert bytes a token reads) of the conversion `table` makes."""
        units = make_units(plan, recipe_for([*options.overrides, *exact_overrides(table)]), checkpoint)
        read = sum(config.n_experts_used * unit_output_bytes(u) // u.source.count for u in units[1:])
        return sum(unit_output_bytes(u) for u in units), read

    def fit(weighed) -> dict[str, str]:
        try:
            return fit_to_size(weighed, options.target_size, sizes_of, options.max_read_per_token,
                               config.n_experts_used, config.n_experts)
        except ValueError:
            size, read = sizes_of({c.name: c.hull[0][0] for c in choices})  # the smallest types
            raise ConvertError(f"--target-size {binary_size(options.target_size)}"
                               + (f" with --max-read-per-token {binary_size(options.max_read_per_token)}"
                                  if options.max_read_per_token else "")
                               + f": the smallest types make {binary_size(size)} of files and read "
                               f"{binary_size(read)} of experts a token; allow more") from None

    if options.scorer is None:
        return fit(choices), None
    table, trials = refine(choices, fit, lambda t: options.scorer([*options.overrides, *exact_overrides(t)]),
                           options.max_tables)
    return table, [vars(t) for t in trials]


def binary_size(nbytes: int) -> str:
    """Bytes as --target-size takes them: 96.00G, 4.0M."""
    return f"{nbytes / 2**30:.2f}G" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f}M"


def exact_overrides(table: dict[str, str]) -> list[tuple[str, str]]:
    """A table of types as overrides, each matching its one name."""
    return [(f"^{re.escape(name)}$", encoding) for name, encoding in table.items()]


def kept_encoding(checkpoint: Checkpoint, name: str) -> str | None:
    """The encoding that holds source tensor `name` exactly, if one does: packed INT4 in groups
    of 32 is Q4_0 (formats/compressed_tensors.py), gpt-oss's MXFP4 is MXFP4 (formats/mxfp4.py)."""
    if checkpoint.holds_q4_0(name):
        return "Q4_0"
    return "MXFP4" if checkpoint.tensors[name].dtype == MXFP4_DTYPE else None


def expert_source_name(src: ExpertLayerSource, matrix: str) -> str:
    """The checkpoint tensor expert 0's `matrix` is read from."""
    if src.fused:
        return src.names.fused_names[matrix == "down"]
    return src.names.per_expert_names(0)[EXPERT_MATRICES.index(matrix)]


def checkpoint_job(src: str, options: ConvertOptions) -> Job:
    """Plan the conversion of a checkpoint folder or hub repo: everything checked, nothing written."""
    source_dir, provenance = resolve_source(src, options.revision)
    checkpoint = Checkpoint(source_dir)
    try:
        plan = make_plan(checkpoint)
        config, quant = plan.config, options.quant or DEFAULT_QUANT
        if options.max_read_per_token is not None and options.target_size is None:
            raise ConvertError("--max-read-per-token bounds what --target-size chooses; give --target-size too")
        imatrix = Imatrix(options.imatrix) if options.imatrix is not None else None
        if options.scorer is not None and options.target_size is not None:
            options.scorer.check(config)
        names = [t.name for t in plan.resident] + [n for layer in plan.expert_layers for n in layer.canonical.values()]

        def recipe_for(overrides) -> Recipe:
            return Recipe.for_model(quant, config, names, overrides, has_imatrix=imatrix is not None)

        chosen, ranking = sized_types(plan, checkpoint, recipe_for, imatrix, options) \
            if options.target_size is not None else (None, None)
        overrides = [*options.overrides, *exact_overrides(chosen or {})]
        recipe = recipe_for(overrides)
        units = make_units(plan, recipe, checkpoint)
        refuse_missing_importance(units, recipe, imatrix, quant)
        return Job(
            config=config,
            units=units,
            run_unit=partial(run_unit, source_dir, imatrix.path if imatrix else None),
            source_bytes={u.name: unit_source_bytes(checkpoint, u) for u in units},
            output_bytes={u.name: unit_output_bytes(u) for u in units},
            quant={"recipe": quant, "overrides": [list(o) for o in overrides],
                   "imatrix": imatrix_record(imatrix) if imatrix else None},
            provenance={**provenance, "source_files": source_files(checkpoint), "skipped_tensors": plan.skipped},
            tokenizer_files=tokenizer_files(source_dir),
            total_source_bytes=checkpoint.source_bytes(),
            action=f"converted {config.architecture} to {quant}" if chosen is None else
            f"converted {config.architecture} to types chosen for {binary_size(options.target_size)}",
            types_chosen=chosen,
            ranking=ranking,
        )
    finally:
        checkpoint.close()


def convert(src: str, out, options: ConvertOptions | None = None) -> dict:
    """Convert `src` (checkpoint folder, hub repo id, or `.gguf` file) into the colibri layout at `out`; returns the summary."""
    options = options or ConvertOptions()
    started = time.monotonic()
    if Path(src).suffix == ".gguf":
        from colibri.convert.gguf_to_colibri import gguf_job

        job = gguf_job(src, options)
    else:
        job = checkpoint_job(src, options)
    return run_job(job, out, options, started)
