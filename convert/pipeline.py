"""The resumable conversion pipeline every source shares (safetensors, GGUF).

A source describes its conversion as a `Job`: the normalized config, independent units of
work (the resident file, one file per MoE layer) and a picklable function that writes one
unit into OUT and returns its manifest fragment. `run_job` does the rest the same way for
every source: each finished unit is recorded in a journal (`OUT/.colibri-convert.json`)
with a fingerprint of the conversion, so a killed run rerun with the same arguments skips
the journalled units and produces byte-identical output; units run in `workers`
processes (threads for a job whose units only copy and hash); the manifest is written
last, so until then OUT is an unfinished conversion. The finished journal stays (a rerun
of the same conversion is then a quick no-op) and the manifest records its sha256, as it
does for every file that holds no tensors.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from tqdm import tqdm

from colibri.formats.layout import (
    FORMAT_NAME, FORMAT_VERSION, JOURNAL_NAME, MANIFEST_NAME, RESIDENT_FILE, TOKENIZER_FILES, write_atomic, write_manifest,
)
from colibri.convert.target_size import MAX_TABLES, type_runs
from colibri.formats.model_config import ModelConfig
from colibri.version import __version__


LOCK_NAME = ".colibri-convert.lock"


class ConvertError(Exception):
    """A conversion that cannot proceed; the message is one line."""


class TableScorer(Protocol):
    """Scores a table of types by its conversion (`colibri.cli.kl_scorer`: the KL divergence from a base)."""

    def check(self, config: ModelConfig) -> None:
        """Refuse, in one line, a model it cannot score, before anything is converted."""

    def __call__(self, overrides: list[tuple[str, str]]) -> float:
        """The score of the conversion `overrides` make, lower better."""


@dataclass
class ConvertOptions:
    quant: str | None = None  # recipe; None: Q4_K_M for a checkpoint (a GGUF is imported as it is)
    overrides: list[tuple[str, str]] = field(default_factory=list)
    imatrix: Path | None = None  # llama-imatrix's GGUF: importance weights for the quantizers
    target_size: int | None = None  # bytes of weight files: each tensor's type chosen to fit (convert.target_size)
    max_read_per_token: int | None = None  # with target_size: bytes of experts a token may read
    scorer: TableScorer | None = None  # with target_size: target_size.refine re-weighs the table's choice by it
    max_tables: int = MAX_TABLES  # with scorer: tables scored at most
    workers: int = 1
    force: bool = False
    revision: str | None = None
    progress: bool = True


@dataclass
class Job:
    """One conversion, described by its source; `run_job` carries it out."""

    config: ModelConfig
    units: list  # each has a unique `name`
    run_unit: Callable  # picklable: run_unit(out, unit, advance) -> manifest fragment
    source_bytes: dict[str, int]  # unit name → bytes of source it reads (progress)
    output_bytes: dict[str, int]  # unit name → bytes it writes (free-space check)
    quant: dict  # the manifest's `quant`
    provenance: dict  # the manifest's `provenance`
    tokenizer_files: dict[str, bytes]  # written into OUT and listed in `tokenizer_files`
    total_source_bytes: int
    action: str  # the summary's first words, e.g. "converted mixtral to Q4_K_M"
    threads: bool = False  # units only read, hash and write (all release the GIL): threads, not processes
    types_chosen: dict | None = None  # --target-size's table: canonical name → encoding
    ranking: list | None = None  # the tables target_size.refine scored, as dicts


def fingerprint(job: Job) -> dict:
    """What makes two runs the same conversion (a rerun resumes only when this matches)."""
    p = job.provenance
    return {
        "source": p["source"], "revision": p["revision"],
        "source_sizes": {name: f["size"] for name, f in p["source_files"].items()},
        "quant": job.quant["recipe"], "overrides": job.quant["overrides"], "converter_version": __version__,
    }


def our_files(out: Path) -> list[Path]:
    names = [MANIFEST_NAME, JOURNAL_NAME, RESIDENT_FILE, *TOKENIZER_FILES]
    return [out / n for n in names] + sorted(out.glob("*.partial")) + [out / "experts"]


def prepare_output(out: Path, print_: dict, force: bool) -> dict:
    """Journalled units to keep: those of an unfinished run of this same conversion."""
    journal_path = out / JOURNAL_NAME
    if not out.exists() or not any(p.name != LOCK_NAME for p in out.iterdir()):
        return {}
    journal = None
    if journal_path.is_file():
        raw = journal_path.read_bytes()
        try:
            journal = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            journal = None
    if journal and journal.get("fingerprint") == print_:
        if not _journal_changed(out, raw):
            return journal.get("units", {})
        if not force:
            raise ConvertError(f"{journal_path}: differs from the sha256 {MANIFEST_NAME} records; use --force to convert again")
    elif not force:
        if journal or (out / MANIFEST_NAME).exists():
            raise ConvertError(f"{out}: holds a different conversion (other source or quant); use --force to replace it")
        raise ConvertError(f"{out}: folder is not empty and holds no colibri conversion; choose another or use --force")
    for path in our_files(out):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return {}


def _journal_changed(out: Path, raw: bytes) -> bool:
    """A finished conversion's journal whose bytes are not those its manifest records."""
    try:
        recorded = json.loads((out / MANIFEST_NAME).read_bytes())["files"][JOURNAL_NAME]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return hashlib.sha256(raw).hexdigest() != recorded


def check_free_space(out: Path, needed: int) -> None:
    probe = out if out.exists() else out.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ConvertError(f"{out}: needs {needed / 1e9:.2f} GB more, only {free / 1e9:.2f} GB free on that disk")


def run_job(job: Job, out, options: ConvertOptions, started: float | None = None) -> dict:
    """Carry out `job` into `out` (resuming an unfinished run of it); returns the summary.
    One conversion at a time may write into `out` (a lock names the other's pid); a failure
    leaves no half-written file, and no OUT at all when it had nothing to resume from."""
    started = time.monotonic() if started is None else started
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(out):
        try:
            done = prepare_output(out, fingerprint(job), options.force)
        except BaseException:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise
        try:
            return _run_locked(job, out, options, started, done)
        except BaseException:
            _clean_failed(out, created)
            raise


@contextlib.contextmanager
def _conversion_lock(out: Path):
    """An exclusive flock on `OUT/.colibri-convert.lock` (released by the OS if we die), removed when done."""
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConvertError(f"{out}: another colibri-convert (pid {other}) is converting into this folder; "
                               "wait for it, or choose another OUT") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _clean_failed(out: Path, created: bool) -> None:
    """After a failure: temp files go; an OUT this run created and left nothing to resume in goes too."""
    for tmp in [*out.glob("*.partial"), *out.glob("experts/*.partial")]:
        tmp.unlink(missing_ok=True)
    journal = out / JOURNAL_NAME
    try:
        kept = json.loads(journal.read_bytes()).get("units") if journal.is_file() else None
    except (OSError, ValueError, AttributeError):
        kept = None
    if created and not kept:
        shutil.rmtree(out, ignore_errors=True)


def _run_locked(job: Job, out: Path, options: ConvertOptions, started: float, done: dict) -> dict:
    print_ = fingerprint(job)
    todo = [u for u in job.units if not _unit_done(out, u.name, done)]
    check_free_space(out, sum(job.output_bytes[u.name] for u in todo))
    journal = {"fingerprint": print_, "units": {k: v for k, v in done.items() if k in {u.name for u in job.units}}}
    _write_journal(out, journal)

    total = sum(job.source_bytes.values())
    skipped_bytes = total - sum(job.source_bytes[u.name] for u in todo)
    bar = tqdm(total=total, initial=skipped_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="converting", disable=not options.progress, dynamic_ncols=True)
    try:
        _run_units(job.run_unit, out, todo, options.workers, bar, journal, job.threads)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            kept = len(journal["units"])
            raise ConvertError(f"{out}: disk full ({kept} of {len(job.units)} units kept); free space and rerun the same command to resume") from None
        raise
    finally:
        bar.close()

    manifest = build_manifest(job, journal["units"], out)
    write_manifest(out, manifest)
    elapsed = time.monotonic() - started
    return summarize(manifest, job, total - skipped_bytes, elapsed, len(job.units) - len(todo))


def _unit_done(out: Path, name: str, done: dict) -> bool:
    fragment = done.get(name)
    return bool(fragment) and all((out / f).is_file() and (out / f).stat().st_size == info["size"] for f, info in fragment["files"].items())


def _write_journal(out: Path, journal: dict) -> None:
    """Keys sorted: the finished journal's bytes do not depend on the order units finished in."""
    write_atomic(out / JOURNAL_NAME, json.dumps(journal, indent=1, sort_keys=True).encode())


def _record(out: Path, journal: dict, name: str, fragment: dict) -> None:
    journal["units"][name] = fragment
    _write_journal(out, journal)


_worker_progress = None


def _init_worker(counter) -> None:
    global _worker_progress
    _worker_progress = counter


def _advance_shared(nbytes: int) -> None:
    with _worker_progress.get_lock():
        _worker_progress.value += nbytes


def _run_unit_in_worker(run_unit: Callable, out: Path, unit) -> dict:
    return run_unit(out, unit, _advance_shared)


def _run_units(run_unit: Callable, out: Path, units: list, workers: int, bar: tqdm, journal: dict, threads: bool) -> None:
    if workers <= 1 or len(units) <= 1:
        for unit in units:
            _record(out, journal, unit.name, run_unit(out, unit, bar.update))
        return
    if threads:
        lock = threading.Lock()

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        pool = ThreadPoolExecutor(workers)
        pending = {pool.submit(run_unit, out, unit, advance): unit for unit in units}
        poll = None
    else:
        context = multiprocessing.get_context("spawn")
        counter, reported = context.Value("q", 0), [0]
        pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(counter,))
        pending = {pool.submit(_run_unit_in_worker, run_unit, out, unit): unit for unit in units}

        def poll() -> None:
            with counter.get_lock():
                bar.update(counter.value - reported[0])
                reported[0] = counter.value

    with pool:
        try:
            while pending:
                finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                if poll:
                    poll()
                for future in finished:
                    unit = pending.pop(future)
                    _record(out, journal, unit.name, future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def build_manifest(job: Job, fragments: dict, out: Path) -> dict:
    """The manifest from the units' fragments; writes the tokenizer files on the way and
    records their and the finished journal's size and sha256."""
    tensors, out_files, expert_layers = {}, {}, []
    for fragment in fragments.values():
        tensors.update(fragment.get("tensors", {}))
        out_files.update(fragment["files"])
        if "expert_layer" in fragment:
            expert_layers.append(fragment["expert_layer"])
    for name, data in job.tokenizer_files.items():
        write_atomic(out / name, data)
    for name, data in {**job.tokenizer_files, JOURNAL_NAME: (out / JOURNAL_NAME).read_bytes()}.items():
        out_files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "converter": {"name": "colibri-convert", "version": __version__},
        "config": job.config.to_dict(),
        "quant": job.quant,
        "provenance": job.provenance,
        "files": dict(sorted(out_files.items())),
        "tensors": dict(sorted(tensors.items())),
        "expert_layers": sorted(expert_layers, key=lambda e: e["layer"]),
        "tokenizer_files": list(job.tokenizer_files),
    }


def summarize(manifest: dict, job: Job, converted_bytes: int, seconds: float, resumed: int) -> dict:
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
        "action": job.action,
        "architecture": job.config.architecture,
        "quant": manifest["quant"]["recipe"],
        "source_bytes": job.total_source_bytes,
        "output_bytes": sum(f["size"] for f in manifest["files"].values()),
        "resident_bytes": resident_bytes,
        "expert_bytes": expert_bytes,
        "resident_bpw": 8 * resident_bytes / max(resident_weights, 1),
        "expert_bpw": 8 * expert_bytes / max(expert_weights, 1),
        "parameters": resident_weights + expert_weights,
        "moe_layers": len(manifest["expert_layers"]),
        "experts_per_layer": job.config.n_experts,
        "tensors_by_encoding": dict(sorted(encodings.items())),
        "expert_bytes_per_token": sum(job.config.n_experts_used * e["expert_bytes"] for e in manifest["expert_layers"]),
        "types_chosen": job.types_chosen,
        "ranking": job.ranking,
        "skipped_tensors": len(job.provenance["skipped_tensors"]),
        "mtp_layers_skipped": job.config.mtp_layers_skipped,
        "units_resumed": resumed,
        "seconds": seconds,
        "source_mb_per_s": converted_bytes / 1e6 / max(seconds, 1e-9),
    }


def format_summary(s: dict, out) -> str:
    gb = 1e9
    lines = [
        f"{s['action']} in {s['seconds']:.1f} s → {out}",
        f"  parameters     {s['parameters'] / 1e9:.3f} B ({s['moe_layers']} MoE layers × {s['experts_per_layer']} experts)",
        f"  source         {s['source_bytes'] / gb:.3f} GB",
        f"  output         {s['output_bytes'] / gb:.3f} GB "
        f"(resident {s['resident_bytes'] / gb:.3f} GB at {s['resident_bpw']:.2f} bpw, "
        f"experts {s['expert_bytes'] / gb:.3f} GB at {s['expert_bpw']:.2f} bpw)",
        f"  throughput     {s['source_mb_per_s']:.1f} MB/s of source",
        "  tensors        " + ", ".join(f"{k} {v}" for k, v in s["tensors_by_encoding"].items()),
        f"  read a token   {s['expert_bytes_per_token'] / 1e6:.2f} MB of routed experts",
    ]
    if s["types_chosen"]:
        lines += ["  types chosen for the size (tensor kind, layers, type):"] + \
            [f"    {line}" for line in type_runs(s["types_chosen"])]
    if s["ranking"]:
        lines += ["  scored tables (each kind's damage weight, mean KL from the base; * kept):"] + \
            [f"    {'*' if t['kept'] else ' '} {t['score']:.6f}  " +
             (", ".join(f"{kind} ×{w:g}" for kind, w in sorted(t["weights"].items())) or "as measured")
             for t in s["ranking"]]
    if s["units_resumed"]:
        lines.append(f"  resumed        {s['units_resumed']} units were already done and kept")
    if s["skipped_tensors"]:
        lines.append(f"  skipped        {s['skipped_tensors']} tensors not used for generation "
                     f"({s['mtp_layers_skipped']} multi-token-prediction layers, and any beside a multimodal checkpoint's text model)")
    return "\n".join(lines)
