"""`colibri-convert --target-size --kl-base FILE`: a table of types scored by its KL divergence.

A candidate table (as overrides of the recipe) is converted into a scratch folder, run on the
base file's chunks through the runtime, and scored by the mean KL divergence of its predictions
from the base's (llama-perplexity's measure, `verify.perplexity`); the folder is removed after.
Each score is journalled beside OUT (`ScoreJournal`) as it comes, so a rerun after a crash or a
kill scores only the tables it has not; the journal goes when the conversion is done.
The base is a `colibri perplexity REF --text CALIBRATION --save-base FILE` of a reference
conversion (BF16 or Q8_0), or llama-perplexity's `--kl-divergence-base` output: it holds the
calibration text's tokens, so no text is read here.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

from colibri.convert.pipeline import ConvertOptions
from colibri.formats.layout import write_atomic
from colibri.formats.logprob_file import LogProbFile, LogProbFileError
from colibri.verify.perplexity import PerplexityError, base_chunks, perplexity, refuse_other_vocabulary
from colibri.version import __version__

SCORING_SLOTS = 4  # chunks run together through the batch engine
OWNER_FILE = "owner.pid"  # in a scratch folder: the process that made it


@contextlib.contextmanager
def scratch_beside(out: Path):
    """A scratch folder beside OUT for the tables' conversions, removed after. Those a killed run
    left beside the same OUT (their owner process gone) are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}-scoring-"
    for stale in out.parent.glob(glob.escape(prefix) + "*"):
        if stale.is_dir() and not _owner_alive(stale / OWNER_FILE):
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        (work / OWNER_FILE).write_text(str(os.getpid()))
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _owner_alive(owner: Path) -> bool:
    try:
        pid = int(owner.read_text())
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def journal_beside(out: Path) -> Path:
    """Where the scores of OUT's tables are journalled."""
    return out.parent / f".{out.name}-scores.json"


def _identity(path: Path | None) -> list:
    """What a changed input would change: each file's name, size and modification time (a
    folder's files, in order); a name that is no local path (a Hugging Face repo id) as itself."""
    if path is None or not path.exists():
        return [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


class ScoreJournal:
    """Scores of tables (as their overrides), kept in a JSON file under a fingerprint of what
    else makes the score: a file of another fingerprint, or one that does not parse, is started
    afresh. Each new score is written through (atomically) before it is returned."""

    def __init__(self, path: Path, fingerprint: dict, fresh: bool = False):
        self.path, self.fingerprint, self.scores = path, fingerprint, {}
        if fresh or not path.is_file():
            return
        try:
            journal = json.loads(path.read_bytes())
            if journal["fingerprint"] == fingerprint:
                self.scores = {self._key(overrides): float(score) for overrides, score in journal["scores"]}
        except (ValueError, KeyError, TypeError):
            self.scores = {}

    @staticmethod
    def _key(overrides) -> str:
        return json.dumps([list(o) for o in overrides])

    def get(self, overrides) -> float | None:
        return self.scores.get(self._key(overrides))

    def put(self, overrides, score: float) -> None:
        self.scores[self._key(overrides)] = score
        entries = [[json.loads(key), value] for key, value in self.scores.items()]
        write_atomic(self.path, json.dumps({"fingerprint": self.fingerprint, "scores": entries}).encode())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class KlScorer:
    """overrides → the mean KL divergence from `base` of the conversion of `src` they make
    (with `options`' recipe and importance matrix), over at most `chunks` of its chunks; each
    score is also given to `report` as a line. Scores are journalled in `journal` (OUT's, by
    `journal_beside`): those of an earlier run of the same conversion are not scored again."""

    def __init__(self, src: str, base: Path, options: ConvertOptions, work: Path, journal: Path,
                 chunks: int | None = None, report: Callable[[str], None] | None = None):
        try:
            self.base = LogProbFile(base)
        except LogProbFileError as e:
            raise PerplexityError(str(e)) from None
        if chunks is not None and chunks < 1:
            raise PerplexityError(f"--kl-chunks {chunks}: must be at least 1")
        self.src, self.chunks, self.work, self.report = src, chunks, work, report
        fingerprint = {"source": _identity(Path(src)), "revision": options.revision, "quant": options.quant,
                       "imatrix": _identity(options.imatrix and Path(options.imatrix)), "base": _identity(Path(base)),
                       "chunks": chunks, "version": __version__}
        self.journal = ScoreJournal(journal, fingerprint, fresh=options.force)
        self.options = replace(options, target_size=None, max_read_per_token=None, scorer=None, force=True,
                               progress=False)
        self.scored = 0

    def check(self, config) -> None:
        refuse_other_vocabulary(self.base, config.vocab_size, self.src)

    def __call__(self, overrides: list[tuple[str, str]]) -> float:
        journalled = self.journal.get(overrides)
        if journalled is not None:
            self.scored += 1
            if self.report is not None:
                self.report(f"table {self.scored}: mean KL {journalled:.6f} (scored by an earlier run)")
            return journalled
        result = self._score(overrides)
        self.journal.put(overrides, result["kld_mean"])
        self.scored += 1
        if self.report is not None:
            self.report(f"table {self.scored}: mean KL {result['kld_mean']:.6f} over {result['tokens']} tokens")
        return result["kld_mean"]

    def _score(self, overrides: list[tuple[str, str]]) -> dict:
        from colibri.convert.hf_to_colibri import convert
        from colibri.runtime import open_model

        out = self.work / "candidate"
        convert(self.src, out, replace(self.options, overrides=list(overrides)))
        try:
            model = open_model(out, ctx=self.base.n_ctx, parallel=SCORING_SLOTS)
            try:
                chunks = base_chunks(self.base, model, self.chunks)
                result = perplexity(model, chunks, min(len(model.slots), len(chunks)), self.base)
            finally:
                model.close()
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return result
