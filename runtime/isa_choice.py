"""`--isa auto`: the instruction set the kernels are compiled for, chosen by timing them once.

numba compiles all of a process's kernels for one target (`emitter.TARGET_CPUS`). On a CPU that
offers more than AVX2 (AVX-512, AVX-VNNI, AMX), its own target is not always the faster one for
a decoded token: wider vectors can lower the clock, and a kernel bound by memory gains nothing
from them. `choose` settles it by measurement. A worker process per candidate target
(`isa_probe`), each compiling for its target, multiplies one token by samples of the model's own
matrices, kind by kind (encoding and width), in rounds that alternate between the workers so that
a noisy machine slows both alike. Each kind's time per byte, weighted by the bytes of that kind a
decoded token reads, gives each target's seconds a token; native stays unless another target is
MARGIN faster. The result is cached in a file beside numba's cache, keyed by the CPU, the kernels'
sources, the threads and the model's kinds of matrix, so later runs go straight on.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding

from colibri.formats.layout import ModelLayout, write_atomic
from colibri.formats.recipe import tensor_category
from colibri.runtime.kernels.emitter import TARGET_CPUS, target_environment

AUTO = "auto"
CHOICES = (AUTO, "native", *TARGET_CPUS)
MARGIN = 0.03  # another target replaces native only when it is this much faster
ROUNDS = 5  # timed rounds, each worker in turn
SAMPLE_BYTES = 64 << 20  # of each kind of matrix, copied into the workers' RAM
CACHE_NAME = "isa-choices.json"
MAX_CACHE_BYTES = 1 << 20  # a larger cache file is not ours to trust: it is timed again
_OVERRIDES = ("avx512", "amx", "avx10", "avxvnni", "gfni")  # host features the "avx2" target drops


class IsaError(RuntimeError):
    """A worker that could not time its target; the message says which and why."""


@dataclass(frozen=True)
class MatrixKind:
    """The matrices of one encoding and width, and the bytes of them a decoded token reads."""

    encoding: str
    cols: int
    bytes_per_token: int
    sources: tuple  # ("tensor", name) or ("experts", layer, matrix), in the order samples are taken

    @property
    def key(self) -> str:
        return f"{self.encoding}x{self.cols}"


@dataclass(frozen=True)
class IsaChoice:
    target: str
    seconds_per_token: dict  # target -> the products' seconds a decoded token, as timed
    cached: bool

    def timings(self, digits: int = 3) -> str:
        """Each target's products a token, for a report: "avx2 0.097 ms, native 0.094 ms"."""
        return ", ".join(f"{t} {s * 1e3:.{digits}f} ms" for t, s in sorted(self.seconds_per_token.items()))


def matrix_kinds(layout: ModelLayout) -> list[MatrixKind]:
    """The kinds of matrix a decoded token multiplies by: every resident matrix but the token
    embedding (a lookup, unless it doubles as the output), and each layer's routed experts, of
    which a token reads n_experts_used."""
    found: dict[tuple, list] = {}  # (encoding, cols) -> [bytes a token, sources]
    output = "output.weight" if "output.weight" in layout.tensors else "token_embd.weight"
    for t in layout.tensors.values():
        if len(t.shape) != 2 or (tensor_category(t.name) == "token_embd" and t.name != output):
            continue
        entry = found.setdefault((t.encoding, t.shape[1]), [0, []])
        entry[0] += t.nbytes
        entry[1].append(("tensor", t.name))
    used = layout.config.n_experts_used
    for layer in sorted(layout.expert_layers):
        for name, m in layout.expert_layers[layer].matrices.items():
            entry = found.setdefault((m.encoding, m.shape[1]), [0, []])
            entry[0] += m.nbytes * used
            entry[1].append(("experts", layer, name))
    return [MatrixKind(encoding, cols, total, tuple(sources)) for (encoding, cols), (total, sources) in sorted(found.items())]


def _host_features() -> list[str]:
    return llvmlite.binding.get_host_cpu_features().flatten().split(",")


def candidates() -> list[str]:
    """The targets worth timing here: native, and AVX2 alone where this CPU has more."""
    features = _host_features()
    more = [f for f in features if f.startswith("+") and f[1:].startswith(_OVERRIDES)]
    return ["native", "avx2"] if more and "+avx2" in features else ["native"]


def process_target() -> str:
    """The target this process compiles for: the name whose NUMBA_CPU_NAME is set, else native
    (a NUMBA_CPU_NAME of none of ours is returned as it is)."""
    cpu = os.environ.get("NUMBA_CPU_NAME")
    if not cpu:
        return "native"
    return next((name for name, value in TARGET_CPUS.items() if value == cpu), cpu)


def cache_file() -> Path:
    """Where the choices are kept: NUMBA_CACHE_DIR when set, else beside the kernels' numba
    cache, else (a read-only install) the user's cache folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / CACHE_NAME
    from colibri.runtime.kernels import CACHES

    beside = CACHES[0]
    if os.access(beside if beside.is_dir() else beside.parent, os.W_OK):
        return beside / CACHE_NAME
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri" / CACHE_NAME


def cache_key(kinds: list[MatrixKind], threads: int) -> str:
    from colibri.runtime.kernels import SOURCES
    from colibri.kernel_cache import sources_hash

    facts = [llvmlite.binding.get_host_cpu_name(), _host_features(), sources_hash(SOURCES), threads,
             [(k.key, k.bytes_per_token) for k in kinds]]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()


def _read_cache(path: Path) -> dict:
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return {}
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _cached_choice(entry) -> IsaChoice | None:
    if not isinstance(entry, dict) or entry.get("target") not in CHOICES[1:]:
        return None
    seconds = entry.get("seconds_per_token")
    if not isinstance(seconds, dict) or not all(isinstance(v, (int, float)) for v in seconds.values()):
        return None
    return IsaChoice(entry["target"], seconds, cached=True)


def decide(seconds_per_token: dict) -> str:
    """The target to compile for: the fastest, if it beats native by MARGIN, else native."""
    fastest = min(seconds_per_token, key=seconds_per_token.get)
    native = seconds_per_token.get("native")
    return fastest if native is None or seconds_per_token[fastest] < native * (1 - MARGIN) else "native"


def choose(model_dir, threads: int, cache: Path | None = None, report=None) -> IsaChoice:
    """The target this machine decodes the model at `model_dir` fastest with, from the cache or
    timed now (`report(line)` hears about a timing run: it takes some seconds, and the first
    time a target is timed, numba compiles its kernels)."""
    targets = candidates()
    if targets == ["native"]:
        return IsaChoice("native", {}, cached=False)
    kinds = matrix_kinds(ModelLayout(model_dir))
    cache = cache or cache_file()
    key = cache_key(kinds, threads)
    entries = _read_cache(cache)
    choice = _cached_choice(entries.get(key))
    if choice:
        return choice
    if report:
        report(f"timing the kernels built for {' and '.join(targets)} on this model's matrices, once "
               f"(kept in {cache})")
    seconds = time_targets(model_dir, targets, threads, kinds)
    choice = IsaChoice(decide(seconds), seconds, cached=False)
    entries[key] = {"target": choice.target, "seconds_per_token": seconds}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(entries, indent=1).encode())
    except OSError:
        pass  # nowhere to keep it: the next run times again
    return choice


def time_targets(model_dir, targets: list[str], threads: int, kinds: list[MatrixKind]) -> dict:
    """Each target's seconds of products a decoded token, from workers timed in turn."""
    workers = {}  # target -> (process, its stderr: a file, which no amount of warnings can fill)
    try:
        for target in targets:
            env = dict(os.environ)
            if target != "native":
                env.update(target_environment(target))
            log = tempfile.TemporaryFile("w+")
            workers[target] = subprocess.Popen(
                [sys.executable, "-m", "colibri.runtime.isa_probe", str(model_dir), "--threads", str(threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env), log
        for target, worker in workers.items():
            _answer(target, worker, None)  # compiled, and the samples copied
        rounds = {target: [] for target in targets}
        for _ in range(ROUNDS):
            for target, worker in workers.items():
                rounds[target].append(_answer(target, worker, "time"))
    finally:
        for process, log in workers.values():
            if process.poll() is None:
                process.kill()
            process.wait()
            log.close()
    by_key = {k.key: k for k in kinds}
    return {target: sum(by_key[key].bytes_per_token * statistics.median(r[key]["seconds"] for r in timed)
                        / timed[0][key]["bytes"] for key in by_key)
            for target, timed in rounds.items()}


def _answer(target: str, worker: tuple, command: str | None) -> dict:
    process, log = worker
    try:
        if command:
            process.stdin.write(command + "\n")
            process.stdin.flush()
        return json.loads(process.stdout.readline())
    except (ValueError, BrokenPipeError):  # no answer, or a worker gone before the question
        process.kill()
        process.wait()
        log.seek(0)
        reason = log.read().strip().splitlines()
        raise IsaError(f"timing the kernels built for {target} failed: {reason[-1] if reason else 'no answer'}") from None
