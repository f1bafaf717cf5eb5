"""colibri-convert: a Hugging Face checkpoint → the colibri layout.

The conversion is a set of independent units — the resident file and one file per MoE
layer — each written to a temp file, fsynced, renamed and then recorded in a journal
(`OUT/.colibri-convert.json`). A killed conversion rerun with the same arguments skips
the journalled units and produces byte-identical output. Units run in `workers`
processes. The manifest is written last: until then OUT is an unfinished conversion.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import re
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from colibri import __version__
from convert.plan import ConversionPlan, ExpertLayerSource, ResidentTensor, make_plan
from convert.quantize_q4k import quantize
from convert.expert_layout import expert_matrix_table, write_expert_layer
from formats.checkpoint import Checkpoint, cache_blob_sha256
from formats.encodings import tensor_bytes
from formats.layout import (
    EXPERT_ALIGN, EXPERT_MATRICES, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, RESIDENT_FILE, TENSOR_ALIGN,
    AlignedFileWriter, align_up, write_atomic, write_manifest,
)
from formats.recipe import Recipe

JOURNAL_NAME = ".colibri-convert.json"
TOKENIZER_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.*"]
HUB_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
CHUNK_BYTES = 32 << 20  # float32 bytes of one resident read; bounds memory for huge embeddings


class ConvertError(Exception):
    """A conversion that cannot proceed; the message is one line."""


@dataclass
class ConvertOptions:
    quant: str = "Q4_K_M"
    overrides: list[tuple[str, str]] = field(default_factory=list)
    workers: int = 1
    force: bool = False
    revision: str | None = None
    progress: bool = True


# --- source ---------------------------------------------------------------------------


def resolve_source(src: str, revision: str | None) -> tuple[Path, dict]:
    """A local folder, or a hub repo id fetched (resumably, only what is needed) into the HF cache."""
    path = Path(src)
    if path.suffix == ".gguf":
        raise ConvertError(f"{src}: GGUF import is not built yet; convert the safetensors checkpoint instead")
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


def write_resident(checkpoint: Checkpoint, out_dir: Path, unit: ResidentUnit, advance) -> dict:
    writer = AlignedFileWriter(out_dir / RESIDENT_FILE)
    tensors = {}
    try:
        for tensor, encoding in unit.tensors:
            offset = writer.start(TENSOR_ALIGN)
            digest = hashlib.sha256()
            for chunk in read_row_chunks(checkpoint, tensor.source, tensor.shape):
                data = quantize(chunk, encoding)
                writer.write(data)
                digest.update(data)
            nbytes = writer.size - offset
            tensors[tensor.name] = {
                "file": RESIDENT_FILE, "offset": offset, "nbytes": nbytes, "encoding": encoding,
                "shape": list(tensor.shape), "sha256": digest.hexdigest(),
            }
            advance(checkpoint.tensors[tensor.source].nbytes)
        size = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"tensors": tensors, "files": {RESIDENT_FILE: {"size": size}}}


def write_experts(checkpoint: Checkpoint, out_dir: Path, unit: ExpertUnit, advance) -> dict:
    src, encodings = unit.source, dict(unit.encodings)
    rows = src.shapes["gate"][0]

    def expert_matrices(e: int):
        if src.fused:
            gate_up_name, down_name = src.names.fused_names
            gate_up = checkpoint.read(gate_up_name, e, 1)[0]
            return gate_up[:rows], gate_up[rows:], checkpoint.read(down_name, e, 1)[0]
        return [checkpoint.read(name) for name in src.names.per_expert_names(e)]

    def encode(e: int):
        return [quantize(m, encodings[name]) for name, m in zip(EXPERT_MATRICES, expert_matrices(e))]

    source_bytes_per_expert = expert_source_bytes(checkpoint, src) // src.count
    return write_expert_layer(out_dir, src.layer, src.count, encodings, src.shapes, encode, lambda e: advance(source_bytes_per_expert))


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
        return sum(align_up(tensor_bytes(enc, t.shape), TENSOR_ALIGN) for t, enc in unit.tensors)
    _, expert_bytes = expert_matrix_table(dict(unit.encodings), unit.source.shapes)
    return align_up(expert_bytes, EXPERT_ALIGN) * unit.source.count


def run_unit(source_dir: Path, out_dir: Path, unit, advance) -> dict:
    checkpoint = Checkpoint(source_dir)
    try:
        if isinstance(unit, ResidentUnit):
            return write_resident(checkpoint, out_dir, unit, advance)
        return write_experts(checkpoint, out_dir, unit, advance)
    finally:
        checkpoint.close()


_worker_progress = None


def _init_worker(counter) -> None:
    global _worker_progress
    _worker_progress = counter


def _advance_shared(nbytes: int) -> None:
    with _worker_progress.get_lock():
        _worker_progress.value += nbytes


def _run_unit_in_worker(source_dir: Path, out_dir: Path, unit) -> dict:
    return run_unit(source_dir, out_dir, unit, _advance_shared)


# --- the whole conversion ---------------------------------------------------------------


def make_units(plan: ConversionPlan, recipe: Recipe) -> list:
    resident = ResidentUnit(tuple((t, recipe.encoding(t.name, t.shape)) for t in plan.resident))
    experts = [
        ExpertUnit(src, tuple((m, recipe.encoding(name, src.shapes[m])) for m, name in src.canonical.items()))
        for src in plan.expert_layers
    ]
    return [resident, *experts]


def fingerprint(provenance: dict, files: dict, options: ConvertOptions) -> dict:
    return {
        "source": provenance["source"], "revision": provenance["revision"],
        "source_sizes": {name: f["size"] for name, f in files.items()},
        "quant": options.quant, "overrides": [list(o) for o in options.overrides], "converter_version": __version__,
    }


def our_files(out: Path) -> list[Path]:
    names = [MANIFEST_NAME, JOURNAL_NAME, RESIDENT_FILE, *TOKENIZER_FILES]
    return [out / n for n in names] + sorted(out.glob("*.partial")) + [out / "experts"]


def prepare_output(out: Path, print_: dict, force: bool) -> dict:
    """Journalled units to keep: those of an unfinished run of this same conversion."""
    journal_path = out / JOURNAL_NAME
    if not out.exists() or not any(out.iterdir()):
        return {}
    journal = None
    if journal_path.is_file():
        try:
            journal = json.loads(journal_path.read_text())
        except json.JSONDecodeError:
            journal = None
    if journal and journal.get("fingerprint") == print_:
        return journal.get("units", {})
    if not force:
        if journal or (out / MANIFEST_NAME).exists():
            raise ConvertError(f"{out}: holds a different conversion (other source or quant); use --force to replace it")
        raise ConvertError(f"{out}: folder is not empty and holds no colibri conversion; choose another or use --force")
    for path in our_files(out):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return {}


def check_free_space(out: Path, needed: int) -> None:
    probe = out if out.exists() else out.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ConvertError(f"{out}: needs {needed / 1e9:.2f} GB more, only {free / 1e9:.2f} GB free on that disk")


def convert(src: str, out, options: ConvertOptions | None = None) -> dict:
    """Convert `src` into the colibri layout at `out`; returns the summary."""
    options = options or ConvertOptions()
    started = time.monotonic()
    out = Path(out)
    source_dir, provenance = resolve_source(src, options.revision)
    checkpoint = Checkpoint(source_dir)
    plan = make_plan(checkpoint)
    config = plan.config
    recipe = Recipe(options.quant, config.n_layers, config.n_experts, config.tie_word_embeddings, list(options.overrides))
    units = make_units(plan, recipe)
    files = source_files(checkpoint)
    print_ = fingerprint(provenance, files, options)

    done = prepare_output(out, print_, options.force)
    todo = [u for u in units if not _unit_done(out, u.name, done)]
    check_free_space(out, sum(unit_output_bytes(u) for u in todo))
    out.mkdir(parents=True, exist_ok=True)
    journal = {"fingerprint": print_, "units": {k: v for k, v in done.items() if k in {u.name for u in units}}}
    write_atomic(out / JOURNAL_NAME, json.dumps(journal, indent=1).encode())

    sizes = {u.name: unit_source_bytes(checkpoint, u) for u in units}
    total = sum(sizes.values())
    skipped_bytes = total - sum(sizes[u.name] for u in todo)
    bar = tqdm(total=total, initial=skipped_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="converting", disable=not options.progress, dynamic_ncols=True)
    try:
        _run_units(source_dir, out, todo, options.workers, bar, journal)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            kept = len(journal["units"])
            raise ConvertError(f"{out}: disk full ({kept} of {len(units)} units kept); free space and rerun the same command to resume") from None
        raise
    finally:
        bar.close()
        checkpoint.close()

    manifest = build_manifest(plan, options, provenance, files, journal["units"], source_dir, out)
    write_manifest(out, manifest)
    elapsed = time.monotonic() - started
    return summarize(manifest, checkpoint, plan, total - skipped_bytes, elapsed, len(units) - len(todo))


def _unit_done(out: Path, name: str, done: dict) -> bool:
    fragment = done.get(name)
    return bool(fragment) and all((out / f).is_file() and (out / f).stat().st_size == info["size"] for f, info in fragment["files"].items())


def _record(out: Path, journal: dict, name: str, fragment: dict) -> None:
    journal["units"][name] = fragment
    write_atomic(out / JOURNAL_NAME, json.dumps(journal, indent=1).encode())


def _run_units(source_dir: Path, out: Path, units: list, workers: int, bar: tqdm, journal: dict) -> None:
    if workers <= 1 or len(units) <= 1:
        for unit in units:
            _record(out, journal, unit.name, run_unit(source_dir, out, unit, bar.update))
        return
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(counter,)) as pool:
        pending = {pool.submit(_run_unit_in_worker, source_dir, out, unit): unit for unit in units}
        reported = 0
        try:
            while pending:
                finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                with counter.get_lock():
                    bar.update(counter.value - reported)
                    reported = counter.value
                for future in finished:
                    unit = pending.pop(future)
                    _record(out, journal, unit.name, future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def build_manifest(plan: ConversionPlan, options: ConvertOptions, provenance: dict, files: dict, fragments: dict, source_dir: Path, out: Path) -> dict:
    tensors, out_files, expert_layers = {}, {}, []
    for fragment in fragments.values():
        tensors.update(fragment.get("tensors", {}))
        out_files.update(fragment["files"])
        if "expert_layer" in fragment:
            expert_layers.append(fragment["expert_layer"])
    copied = []
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            data = (source_dir / name).read_bytes()
            write_atomic(out / name, data)
            out_files[name] = {"size": len(data)}
            copied.append(name)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "converter": {"name": "colibri-convert", "version": __version__},
        "config": plan.config.to_dict(),
        "quant": {"recipe": options.quant, "overrides": [list(o) for o in options.overrides], "imatrix": None},
        "provenance": {**provenance, "source_files": files, "skipped_tensors": plan.skipped},
        "files": dict(sorted(out_files.items())),
        "tensors": dict(sorted(tensors.items())),
        "expert_layers": sorted(expert_layers, key=lambda e: e["layer"]),
        "tokenizer_files": copied,
    }


def summarize(manifest: dict, checkpoint: Checkpoint, plan: ConversionPlan, converted_bytes: int, seconds: float, resumed: int) -> dict:
    resident_bytes = sum(t["nbytes"] for t in manifest["tensors"].values())
    resident_weights = sum(int(np.prod(t["shape"])) for t in manifest["tensors"].values())
    expert_bytes = sum(e["expert_bytes"] * e["count"] for e in manifest["expert_layers"])
    expert_weights = sum(e["count"] * sum(int(np.prod(m["shape"])) for m in e["matrices"].values()) for e in manifest["expert_layers"])
    encodings: dict[str, int] = {}
    for t in manifest["tensors"].values():
        encodings[t["encoding"]] = encodings.get(t["encoding"], 0) + 1
    for e in manifest["expert_layers"]:
        for m in e["matrices"].values():
            encodings[m["encoding"]] = encodings.get(m["encoding"], 0) + e["count"]
    return {
        "architecture": plan.config.architecture,
        "quant": manifest["quant"]["recipe"],
        "source_bytes": checkpoint.source_bytes(),
        "output_bytes": sum(f["size"] for f in manifest["files"].values()),
        "resident_bytes": resident_bytes,
        "expert_bytes": expert_bytes,
        "resident_bpw": 8 * resident_bytes / max(resident_weights, 1),
        "expert_bpw": 8 * expert_bytes / max(expert_weights, 1),
        "parameters": resident_weights + expert_weights,
        "moe_layers": len(manifest["expert_layers"]),
        "experts_per_layer": plan.config.n_experts,
        "tensors_by_encoding": dict(sorted(encodings.items())),
        "skipped_tensors": len(plan.skipped),
        "mtp_layers_skipped": plan.config.mtp_layers_skipped,
        "units_resumed": resumed,
        "seconds": seconds,
        "source_mb_per_s": converted_bytes / 1e6 / max(seconds, 1e-9),
    }


def format_summary(s: dict, out) -> str:
    gb = 1e9
    lines = [
        f"converted {s['architecture']} to {s['quant']} in {s['seconds']:.1f} s → {out}",
        f"  parameters     {s['parameters'] / 1e9:.3f} B ({s['moe_layers']} MoE layers × {s['experts_per_layer']} experts)",
        f"  source         {s['source_bytes'] / gb:.3f} GB",
        f"  output         {s['output_bytes'] / gb:.3f} GB "
        f"(resident {s['resident_bytes'] / gb:.3f} GB at {s['resident_bpw']:.2f} bpw, "
        f"experts {s['expert_bytes'] / gb:.3f} GB at {s['expert_bpw']:.2f} bpw)",
        f"  throughput     {s['source_mb_per_s']:.1f} MB/s of source",
        "  tensors        " + ", ".join(f"{k} {v}" for k, v in s["tensors_by_encoding"].items()),
    ]
    if s["units_resumed"]:
        lines.append(f"  resumed        {s['units_resumed']} units were already done and kept")
    if s["skipped_tensors"]:
        lines.append(f"  skipped        {s['skipped_tensors']} tensors ({s['mtp_layers_skipped']} multi-token-prediction layers, not used for generation)")
    return "\n".join(lines)
