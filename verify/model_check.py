"""colibri verify: is a converted model complete and intact?

First the manifest: schema, format version, its own checksum and consistency
(`ModelLayout`), its tables against the config (every resident tensor and expert layer the
architecture implies, with that shape, in the encoding the recorded recipe gives), every
file's size, and files in the folder it does not list. Then every byte is read once, on
parallel threads: the sha256 of each resident tensor, each expert record and each other
file (config, tokenizer, chat template, journal), NaN/Inf in the f16 scales of every block
and in float tensors, expert ids in a token → experts table (DeepSeek-V4's hash layers), and
zeros in all padding (between resident tensors and after each expert record). A format-1 model is checked as far as it records checksums; one warning
names the files it cannot cover.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from colibri.formats.config_check import EXPERT_ID_TABLE
from colibri.formats.encodings import E8M0_OFFSETS, SCALE_OFFSETS, block_size
from colibri.formats.layout import (
    EXPERT_MATRICES, JOURNAL_NAME, MANIFEST_NAME, FormatError, ModelLayout, data_files, expert_file_name, manifest_digest_problem,
    reserved_name, unhashed_files,
)
from colibri.formats.messages import some
from colibri.formats.recipe import Recipe
from colibri.verify.sha_check import CHUNK_BYTES, ERROR, WARNING, Finding, Report, human, read_chunks, run_parallel, split_message

PAD = "padding"
RAW = "bytes"  # a whole file hashed, its contents not interpreted
IDS = "expert ids"  # a token → experts table, stored F32: whole numbers below the segment's limit
# Float encodings: the unsigned view and the exponent mask that marks NaN/Inf.
EXPONENTS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}
F16_EXPONENT = 0x7C00
E8M0_NAN = 0xFF  # the E8M0 exponent byte that stands for NaN
PROBLEMS = {PAD: "non-zero padding bytes", **dict.fromkeys(EXPONENTS, "NaN/Inf values")}


@dataclass(frozen=True)
class Segment:
    start: int  # absolute byte offset in the file
    nbytes: int
    kind: str  # an encoding, or PAD (must be zeros), or IDS
    label: str  # its name in a finding: "down", "padding", "before tensor X"
    limit: int = 0  # IDS: the expert count


@dataclass(frozen=True)
class Task:
    file: str
    what: str  # "tensor blk.0.attn_q.weight", "layer 3 expert 5", "padding"
    segments: tuple[Segment, ...]
    sha256: str | None  # of the non-padding segments, in order

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def bad_offsets(chunk, kind: str, limit: int = 0) -> np.ndarray:
    """Offsets in `chunk` of non-zero padding bytes, NaN/Inf floats, blocks with a NaN/Inf
    scale (f16, or E8M0), or values of an IDS table that are not whole numbers in 0..limit - 1."""
    if kind == RAW:
        return np.empty(0, np.int64)
    if kind == IDS:
        values = np.frombuffer(chunk, "<f4")
        return np.flatnonzero(~((values >= 0) & (values < limit) & (values == np.floor(values)))) * values.itemsize
    if kind == PAD:
        data = np.frombuffer(chunk, np.uint8)
        return np.flatnonzero(data) if data.any() else np.empty(0, np.int64)
    if kind in EXPONENTS:
        dtype, mask = EXPONENTS[kind]
        values = np.frombuffer(chunk, dtype)
        return np.flatnonzero((values & mask) == mask) * values.itemsize
    block = block_size(kind)[1]
    count = len(chunk) // block
    bad = [np.flatnonzero((np.ndarray((count,), "<u2", chunk, offset, (block,)) & F16_EXPONENT) == F16_EXPONENT)
           for offset in SCALE_OFFSETS[kind]]
    bad += [np.flatnonzero(np.ndarray((count,), np.uint8, chunk, offset, (block,)) == E8M0_NAN)
            for offset in E8M0_OFFSETS.get(kind, ())]
    if kind == "IQ1_M":  # its f16 d is the top nibbles of the four scale words
        words = [np.ndarray((count,), "<u2", chunk, 48 + 2 * k, (block,)) for k in range(4)]
        d = (words[0] >> 12) | ((words[1] >> 8) & 0x00F0) | ((words[2] >> 4) & 0x0F00) | (words[3] & 0xF000)
        bad.append(np.flatnonzero((d & F16_EXPONENT) == F16_EXPONENT))
    return np.unique(np.concatenate(bad)) * block


def chunk_bytes(kind: str) -> int:
    """The largest read of whole blocks of `kind` (floats and padding: any multiple of 4) up to CHUNK_BYTES."""
    unit = 4 if kind == IDS else 1 if kind in PROBLEMS or kind == RAW else block_size(kind)[1]
    return CHUNK_BYTES // unit * unit


def check_task(directory: Path, task: Task, advance) -> list[Finding]:
    """Read `task`'s segments once: sha256 of the data, NaN/Inf and padding checks."""
    digest, findings = hashlib.sha256(), []
    try:
        for seg in task.segments:
            count, first, position = 0, None, seg.start
            for chunk in read_chunks(directory / task.file, seg.start, seg.nbytes, chunk_bytes(seg.kind)):
                if seg.kind != PAD:
                    digest.update(chunk)
                bad = bad_offsets(chunk, seg.kind, seg.limit)
                if len(bad):
                    first = position + int(bad[0]) if first is None else first
                    count += len(bad)
                position += len(chunk)
                advance(len(chunk))
            if count:
                problem = f"values that are not expert ids 0..{seg.limit - 1}" if seg.kind == IDS else \
                    PROBLEMS.get(seg.kind, "blocks with a NaN/Inf scale")
                findings.append(Finding(ERROR, task.file, f"{task.what} {seg.label}".strip() + f": {problem} ({count}), first at byte {first}"))
    except OSError as e:
        return [Finding(ERROR, task.file, f"{task.what}: cannot read ({e})")]
    if task.sha256 is not None and digest.hexdigest() != task.sha256:
        data = [s for s in task.segments if s.kind != PAD]
        span = f"bytes {data[0].start}..{data[-1].start + data[-1].nbytes}"
        findings.insert(0, Finding(ERROR, task.file, f"{task.what} ({span}): sha256 mismatch"))
    return findings


def check_files(layout: ModelLayout, report: Report) -> set[str]:
    """Every file in `files` present with its size; returns those that are."""
    intact = set()
    files = layout.manifest["files"]
    for name, info in files.items():
        try:
            path = layout.path(name)
        except FormatError as e:
            report.add(ERROR, name, str(e).partition(": ")[2])
            continue
        size = path.stat().st_size if path.is_file() else None
        report.files[name] = {"size": size, "expected_size": info["size"]}
        if size is None:
            report.add(ERROR, name, "missing")
        elif size != info["size"]:
            report.add(ERROR, name, f"{'truncated: ' if size < info['size'] else ''}has {size} bytes, the manifest says {info['size']}")
        else:
            intact.add(name)
    for name in layout.manifest["tokenizer_files"]:
        if name not in files:
            report.add(ERROR, MANIFEST_NAME, f"tokenizer file {name} is not listed in files")
    return intact


def check_listing(layout: ModelLayout, report: Report) -> None:
    """Files in the folder the manifest does not list: an error under a name the layout
    reserves (the runtime may open it, unchecked), a warning otherwise."""
    listed = set(layout.manifest["files"]) | {MANIFEST_NAME}
    if layout.manifest["format_version"] < 2:
        listed.add(JOURNAL_NAME)  # format 1 leaves it unlisted; `check_coverage` names it
    for path in sorted(p for p in layout.directory.rglob("*") if p.is_file() or p.is_symlink()):
        name = path.relative_to(layout.directory).as_posix()
        if name not in listed and not path.resolve().is_relative_to(layout.directory.resolve()):
            report.add(ERROR, name, f"a link to {path.resolve()}, outside the model folder")
        elif name not in listed:
            if reserved_name(name):
                report.add(ERROR, name, "not listed in the manifest, so not checked, yet a file the runtime opens by this name")
            else:
                report.add(WARNING, name, "not listed in the manifest (not part of the model; not checked)")


def check_coverage(layout: ModelLayout, report: Report) -> None:
    """A format-1 model: one warning naming the files no checksum covers."""
    if layout.manifest["format_version"] >= 2:
        return
    journal = [JOURNAL_NAME] if layout.path(JOURNAL_NAME).is_file() else []
    uncovered = [*unhashed_files(layout.manifest), *journal, MANIFEST_NAME]
    report.add(WARNING, MANIFEST_NAME, f"format version 1 records no checksum for {', '.join(uncovered)}: "
               "their contents are not checked (convert again for format 2)")


def file_tasks(layout: ModelLayout, intact: set[str]) -> list[Task]:
    """One task per file with a whole-file sha256 (the files that hold no tensors)."""
    covered = data_files(layout.manifest)
    return [Task(name, "whole file", (Segment(0, info["size"], RAW, ""),), info["sha256"])
            for name, info in layout.manifest["files"].items()
            if "sha256" in info and name in intact and name not in covered]


def check_text(layout: ModelLayout, report: Report) -> None:
    """The tokenizer files parse and the chat template compiles, as the runtime will load them."""
    from colibri.runtime.text import Tokenizer, TokenizerError

    try:
        Tokenizer.from_dir(layout.directory).check_chat_template()
    except TokenizerError as e:
        file, message = split_message(str(e), "tokenizer.json")
        report.add(ERROR, file, message)


def check_recipe(layout: ModelLayout, report: Report) -> None:
    """Each tensor's encoding is the one the recorded recipe and overrides give (GGUF imports excepted)."""
    quant, c = layout.manifest["quant"], layout.config
    if quant["recipe"] == "GGUF":
        return
    named = [(t.name, t.shape, t.encoding) for t in layout.tensors.values()]
    named += [(f"blk.{t.layer}.ffn_{m}_exps.weight", t.matrices[m].shape, t.matrices[m].encoding)
              for t in layout.expert_layers.values() for m in EXPERT_MATRICES]
    try:
        recipe = Recipe.for_model(quant["recipe"], c, [name for name, _, _ in named], [tuple(o) for o in quant["overrides"]],
                                  has_imatrix=quant["imatrix"] is not None)
        wrong = [f"{name} is {enc}, not {want}" for name, shape, enc in named if enc != (want := recipe.encoding(name, shape))]
    except (TypeError, ValueError, re.error) as e:
        report.add(ERROR, MANIFEST_NAME, f"quant: {e}")
        return
    if wrong:
        report.add(ERROR, MANIFEST_NAME, f"encodings contradict recipe {quant['recipe']}: {some(wrong)}")


def _tensor_segment(t, id_tables: dict[str, int]) -> Segment:
    """A resident tensor's bytes: its encoding's checks, or a token → experts table's (F32)."""
    table = t.name in id_tables and t.encoding == "F32"
    return Segment(t.offset, t.nbytes, IDS if table else t.encoding, "", id_tables.get(t.name, 0))


def resident_tasks(layout: ModelLayout, intact: set[str], report: Report) -> list[Task]:
    """One task per resident tensor, and one for the padding of each file; overlaps reported."""
    c = layout.config
    id_tables = {f"blk.{layer}.{EXPERT_ID_TABLE}": c.n_experts for layer in c.hash_layers}
    by_file = defaultdict(list)
    for t in layout.tensors.values():
        by_file[t.file].append(t)
    tasks = []
    for file, tensors in by_file.items():
        if file not in layout.manifest["files"]:
            report.add(ERROR, MANIFEST_NAME, f"tensor {tensors[0].name} is in {file}, which is not listed in files")
            continue
        tensors.sort(key=lambda t: t.offset)
        gaps, end, sound = [], 0, True
        for previous, t in zip([None, *tensors], tensors):
            if t.offset < end:
                report.add(ERROR, file, f"tensors {previous.name} and {t.name} overlap")
                sound = False
            elif t.offset > end:
                gaps.append(Segment(end, t.offset - end, PAD, f"before tensor {t.name}"))
            end = max(end, t.offset + t.nbytes)
        size = layout.manifest["files"][file]["size"]
        if end > size:
            report.add(ERROR, file, f"tensors end at byte {end}, beyond the file's {size} bytes")
            sound = False
        elif size > end:
            gaps.append(Segment(end, size - end, PAD, "at the end"))
        if sound and file in intact:
            tasks += [Task(file, f"tensor {t.name}", (_tensor_segment(t, id_tables),), t.sha256) for t in tensors]
            tasks += [Task(file, "padding", tuple(gaps), None)] if gaps else []
    return tasks


def expert_tasks(layout: ModelLayout, intact: set[str], report: Report) -> list[Task]:
    """One task per expert record: its three matrices, then its padding."""
    if len(layout.expert_layers) != len(layout.manifest["expert_layers"]):
        report.add(ERROR, MANIFEST_NAME, "an expert layer is listed twice")
    tasks = []
    for table in layout.expert_layers.values():
        file, size = table.file, table.offset + table.count * table.stride
        if file != expert_file_name(table.layer):
            report.add(ERROR, MANIFEST_NAME, f"layer {table.layer}: experts in {file}, not {expert_file_name(table.layer)}")
        if file not in layout.manifest["files"]:
            report.add(ERROR, MANIFEST_NAME, f"layer {table.layer}: {file} is not listed in files")
            continue
        if layout.manifest["files"][file]["size"] != size:
            report.add(ERROR, file, f"the manifest gives {layout.manifest['files'][file]['size']} bytes, {table.count} records of {table.stride} need {size}")
            continue
        if file not in intact:
            continue
        for e in range(table.count):
            record = table.expert_offset(e)
            segments = [Segment(record + table.matrices[m].offset, table.matrices[m].nbytes, table.matrices[m].encoding, m) for m in EXPERT_MATRICES]
            if table.stride > table.expert_bytes:
                segments.append(Segment(record + table.expert_bytes, table.stride - table.expert_bytes, PAD, PAD))
            tasks.append(Task(file, f"layer {table.layer} expert {e}", tuple(segments), table.sha256[e]))
    return tasks


def verify_model(out, *, jobs: int | None = None, quick: bool = False, progress: bool = True) -> Report:
    """Check a converted model folder; see the module docstring. `quick`: manifest and sizes only."""
    directory = Path(out)
    if not directory.is_dir():
        raise FormatError(f"{out}: no such folder")
    report = Report()
    try:
        layout = ModelLayout(directory, strict=False)
    except (FormatError, TypeError, ValueError) as e:  # ValueError: an encoding or config field it cannot represent
        problem = manifest_digest_problem(directory)
        if problem:
            report.add(ERROR, MANIFEST_NAME, problem)
        report.add(ERROR, *split_message(str(e), MANIFEST_NAME))
    if not report.ok:
        report.summary = "no usable manifest"
        return report
    if layout.manifest_problem:
        report.add(ERROR, MANIFEST_NAME, layout.manifest_problem)
    problems = layout.problems()  # the config and records against what the runtime relies on
    for problem in problems:
        report.add(ERROR, MANIFEST_NAME, problem)
    if problems:  # records that contradict their config or their files: nothing further is safe to read
        report.summary = "the manifest describes a model the runtime cannot trust; contents not read"
        return report
    intact = check_files(layout, report)
    check_listing(layout, report)
    check_coverage(layout, report)
    check_recipe(layout, report)
    check_text(layout, report)
    tasks = resident_tasks(layout, intact, report) + expert_tasks(layout, intact, report) + file_tasks(layout, intact)
    experts = sum(t.count for t in layout.expert_layers.values())
    described = f"{len(layout.tensors)} tensors, {experts} experts in {len(layout.expert_layers)} layers, {len(layout.manifest['files'])} files"
    if quick:
        report.summary = f"{described}; sizes checked, contents not read (--quick)"
        return report
    total = sum(t.nbytes for t in tasks)
    for findings in run_parallel(partial(check_task, directory), tasks, total, jobs or os.cpu_count() or 1, progress, "verify"):
        report.findings.extend(findings)
    checked = sum(t.sha256 is not None for t in tasks)
    report.summary = f"{described}; {human(total)} read, {checked} sha256 checked"
    return report
