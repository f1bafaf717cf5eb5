"""colibri verify-source: is a downloaded checkpoint complete, sane and intact?

In order: the index against the shards (missing, listed twice, unlisted), every
safetensors header (`read_header`), the tensors against config.json (`make_plan`), and
the sha256 of every shard against the hub's LFS hashes, the HF cache's blob names or a
`SHA256SUMS` file. Also home of what `colibri verify` shares with it: findings, the
report, and reading files in parallel threads under one progress bar.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from colibri.convert.arch import ConfigError
from colibri.convert.plan import make_plan
from colibri.formats.checkpoint import HUB_REPO_ID, INDEX_NAME, SINGLE_NAME, Checkpoint, CheckpointError, cache_blob_sha256, read_header, read_weight_map, shard_names
from colibri.formats.layout import write_atomic
from colibri.formats.messages import some

ERROR, WARNING = "error", "warning"
CHUNK_BYTES = 8 << 20
SUMS_NAME = "SHA256SUMS"
SUMS_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")
ORIGINS = {"hub": "the hub's LFS sha256", "hf-cache": "its HF cache blob name", "SHA256SUMS": SUMS_NAME}


# --- shared with `colibri verify` -----------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    severity: str  # ERROR or WARNING
    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.file}: {self.message}"


@dataclass
class Report:
    """What a check found, what it learnt about each file, and a one-line summary."""

    findings: list[Finding] = field(default_factory=list)
    files: dict[str, dict] = field(default_factory=dict)
    summary: str = ""

    def add(self, severity: str, file, message: str) -> None:
        self.findings.append(Finding(severity, str(file), message))

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    @property
    def ok(self) -> bool:
        return not self.of(ERROR)

    def to_json(self) -> dict:
        def listed(severity):
            return [{"file": f.file, "message": f.message} for f in self.of(severity)]

        return {"ok": self.ok, "errors": listed(ERROR), "warnings": listed(WARNING), "files": self.files, "summary": self.summary}

    def text(self) -> str:
        counts = [f"{len(self.of(s))} {s}{'s' * (len(self.of(s)) > 1)}" for s in (ERROR, WARNING) if self.of(s)]
        verdict = ("OK" if self.ok else "FAILED") + (f" ({', '.join(counts)})" if counts else "")
        return "\n".join([*map(str, self.findings), f"{verdict}: {self.summary}"])


def human(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


_buffers = threading.local()


def read_chunks(path: Path, start: int, length: int, chunk: int = CHUNK_BYTES):
    """Bytes [start, start + length) of `path`, `chunk` bytes at a time (the last may be shorter).

    Each chunk is a view of this thread's buffer, valid until the next one is read.
    """
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < chunk:
        buffer = _buffers.buffer = memoryview(bytearray(max(chunk, CHUNK_BYTES)))
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_SEQUENTIAL)
        end = start + length
        while start < end:
            view = buffer[: min(chunk, end - start)]
            got = os.preadv(fd, [view], start)
            if got < len(view):
                raise OSError(f"file ends at byte {start + got}, before byte {end}")
            yield view
            start += got
    finally:
        os.close(fd)


class _Cancelled(Exception):
    pass


def run_parallel(work, tasks: list, total_bytes: int, jobs: int, progress: bool, desc: str) -> list:
    """`work(task, advance)` for every task on `jobs` threads under one byte bar; results in task order.

    hashlib and `os.preadv` release the GIL, so threads hash on as many cores. On an
    interrupt, running tasks stop at their next `advance` and queued ones never start.
    """
    lock, stop = threading.Lock(), threading.Event()
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=not progress, dynamic_ncols=True, leave=False) as bar:

        def advance(nbytes: int) -> None:
            if stop.is_set():
                raise _Cancelled
            with lock:
                bar.update(nbytes)

        pool = ThreadPoolExecutor(max(1, jobs))
        try:
            results = list(pool.map(lambda task: work(task, advance), tasks))
        except BaseException:
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
        pool.shutdown()
        return results


# --- verify-source ------------------------------------------------------------------------


def locate(src: str, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """(folder, hub repo id, commit) of SRC: a folder, or a repo id already in the local HF cache."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{src}: not a folder (give the checkpoint's folder)")
        return path, None, None
    from huggingface_hub import snapshot_download

    if not HUB_REPO_ID.match(src):
        raise CheckpointError(f"{src}: no such folder, and not a Hugging Face repo id")
    try:
        local = Path(snapshot_download(src, revision=revision, local_files_only=True))
    except Exception:
        raise CheckpointError(f"{src}: not in the local Hugging Face cache (download it first, e.g. with colibri-convert)") from None
    return local, src, local.name


def hub_files(repo_id: str, commit: str, report: Report) -> dict[str, tuple[str, int]]:
    """{file: (LFS sha256, size)} from the hub; empty when offline or unreachable."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return {}
    try:
        info = HfApi().model_info(repo_id, revision=commit, files_metadata=True)
    except Exception as e:
        report.add(WARNING, repo_id, f"hub unreachable ({type(e).__name__}); checking against local hashes only")
        return {}
    return {s.rfilename: (s.lfs.sha256, s.lfs.size) for s in info.siblings or [] if s.lfs}


def parse_sums(text: str) -> tuple[dict[str, str], list[int]]:
    """`sha256sum` output → ({name: hex}, numbers of the lines that are not `<hex>  <name>`)."""
    sums, bad = {}, []
    for number, line in enumerate(text.splitlines(), 1):
        match = SUMS_LINE.fullmatch(line)
        if match:
            sums[match.group(2)] = match.group(1)
        elif line.strip():
            bad.append(number)
    return sums, bad


def write_sums(directory: Path, digests: dict[str, str]) -> None:
    """Add `digests` to the folder's SHA256SUMS (other entries kept), atomically."""
    path = directory / SUMS_NAME
    sums = parse_sums(path.read_text(errors="replace"))[0] if path.is_file() else {}
    sums.update(digests)
    write_atomic(path, "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())).encode())


def split_message(message: str, default: str) -> tuple[str, str]:
    """'file: text' → (file, text); a message that names no file → (default, message)."""
    head, sep, rest = message.partition(": ")
    return (Path(head).name, rest) if sep and " " not in head else (default, message)


def check_index(directory: Path, report: Report) -> tuple[list[str], dict | None]:
    """(shards, the index's weight map or None for a single file); missing and unlisted shards reported."""
    index = directory / INDEX_NAME
    weight_map = None
    if index.is_file():
        try:
            weight_map = read_weight_map(index)
        except CheckpointError as e:
            report.add(ERROR, *split_message(str(e), INDEX_NAME))
            return [], None
        shards = sorted(set(weight_map.values()))
    else:
        try:
            shards = shard_names(directory)
        except CheckpointError as e:
            report.add(ERROR, *split_message(str(e), directory.name))
            return [], None
    for shard in shards:
        if not (directory / shard).is_file():
            report.add(ERROR, shard, f"missing, though {INDEX_NAME} names it")
    listed = "named in " + INDEX_NAME if weight_map is not None else SINGLE_NAME
    for path in sorted(directory.glob("*.safetensors")):
        if path.name not in shards:
            report.add(WARNING, path.name, f"not {listed}: ignored by loaders and by this check")
    return shards, weight_map


def check_headers(directory: Path, shards: list[str], weight_map: dict | None, report: Report) -> None:
    """Every header parses and is sane; no tensor in two shards; shards and index agree."""
    holder: dict[str, str] = {}
    for shard in shards:
        if not (directory / shard).is_file():
            continue
        try:
            entries = read_header(directory / shard)
        except CheckpointError as e:
            report.add(ERROR, *split_message(str(e), shard))
            continue
        twice = [n for n in entries if n in holder]
        if twice:
            report.add(ERROR, shard, f"tensor {some(twice)} also in {holder[twice[0]]}")
        holder.update((n, shard) for n in entries if n not in holder)
        if weight_map is not None:
            elsewhere = [n for n in entries if weight_map.get(n) != shard]
            lacking = [n for n, s in weight_map.items() if s == shard and n not in entries]
            if elsewhere:
                report.add(ERROR, shard, f"holds tensor {some(elsewhere)}, which {INDEX_NAME} places elsewhere or not at all")
            if lacking:
                report.add(ERROR, shard, f"lacks tensor {some(lacking)}, which {INDEX_NAME} places there")


def check_plan(directory: Path, report: Report) -> None:
    """The tensors are what config.json implies for the architecture (names, shapes, experts)."""
    try:
        checkpoint = Checkpoint(directory)
        try:
            make_plan(checkpoint)
        finally:
            checkpoint.close()
    except (CheckpointError, ConfigError) as e:
        report.add(ERROR, *split_message(str(e), "config.json"))


def expected_digests(directory: Path, shards: list[str], hub: dict, report: Report) -> dict[str, tuple[str, str]]:
    """{shard: (sha256, origin)} from the first source that knows it: hub, HF cache blob name, SHA256SUMS."""
    sums_path, sums = directory / SUMS_NAME, {}
    if sums_path.is_file():
        sums, bad = parse_sums(sums_path.read_text(errors="replace"))
        if bad:
            report.add(WARNING, SUMS_NAME, f"line {some(map(str, bad))} not of the form '<sha256>  <name>'")
    expected = {}
    for shard in shards:
        blob = cache_blob_sha256(directory / shard)
        if shard in hub:
            expected[shard] = (hub[shard][0], "hub")
        elif blob:
            expected[shard] = (blob, "hf-cache")
        elif shard in sums:
            expected[shard] = (sums[shard], "SHA256SUMS")
    return expected


def _hash_file(path: Path, advance) -> str | OSError:
    digest = hashlib.sha256()
    try:
        for chunk in read_chunks(path, 0, path.stat().st_size):
            digest.update(chunk)
            advance(len(chunk))
    except OSError as e:
        return e
    return digest.hexdigest()


def hash_files(paths: list[Path], jobs: int | None = None, progress: bool = True) -> list[str | OSError]:
    """sha256 hex of each file (or the error reading it), largest files started first."""
    sizes = [p.stat().st_size for p in paths]
    order = sorted(range(len(paths)), key=lambda i: -sizes[i])
    jobs = jobs or min(os.cpu_count() or 1, len(paths))
    results = run_parallel(_hash_file, [paths[i] for i in order], sum(sizes), jobs, progress, "sha256")
    by_index = dict(zip(order, results))
    return [by_index[i] for i in range(len(paths))]


def verify_source(src: str, revision: str | None = None, *, jobs: int | None = None, quick: bool = False,
                  write_sums_file: bool = False, progress: bool = True) -> Report:
    """Check a checkpoint folder or cached hub repo; see the module docstring."""
    directory, repo_id, commit = locate(src, revision)
    report = Report()
    shards, weight_map = check_index(directory, report)
    check_headers(directory, shards, weight_map, report)
    if report.ok:
        check_plan(directory, report)
    present = [s for s in shards if (directory / s).is_file()]
    hub = hub_files(repo_id, commit, report) if repo_id else {}
    for shard in shards:
        size = (directory / shard).stat().st_size if shard in present else None
        report.files[shard] = {"size": size, "sha256": None, "verified_against": None}
        if shard in hub and size is not None and size != hub[shard][1]:
            report.add(ERROR, shard, f"has {size} bytes, the hub's file has {hub[shard][1]}")
    total = sum(report.files[s]["size"] for s in present)
    described = f"{len(shards)} shards, {human(total)}"
    if quick or not present:
        report.summary = f"{described}; sha256 not checked" + (" (--quick)" if quick else "")
        return report

    expected = expected_digests(directory, present, hub, report)
    for shard, digest in zip(present, hash_files([directory / s for s in present], jobs, progress)):
        if isinstance(digest, OSError):
            report.add(ERROR, shard, f"cannot read: {digest}")
            continue
        report.files[shard]["sha256"] = digest
        if shard in expected:
            want, origin = expected[shard]
            if digest == want:
                report.files[shard]["verified_against"] = origin
            else:
                report.add(ERROR, shard, f"sha256 {digest} does not match {ORIGINS[origin]} ({want})")
    hashed = [s for s in present if report.files[s]["sha256"]]
    unverified = [s for s in hashed if s not in expected]
    if unverified:
        report.add(WARNING, directory.name, f"sha256 of {len(unverified)} shards computed but not verified: no hub hash, "
                   f"HF cache blob name or {SUMS_NAME} entry" + ("" if write_sums_file else " (--write-sums records them)"))
    if write_sums_file:
        if report.ok:
            write_sums(directory, {s: report.files[s]["sha256"] for s in hashed})
        else:
            report.add(WARNING, SUMS_NAME, "not written: the checkpoint has errors")
    origins = Counter(report.files[s]["verified_against"] for s in hashed if report.files[s]["verified_against"])
    against = ", ".join(f"{n} against {o}" for o, n in sorted(origins.items())) or "none"
    report.summary = f"{described}; sha256 verified: {against}"
    return report
