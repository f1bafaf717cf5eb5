"""`colibri run --prompt-dir`: a folder of prompts through the batch engine, resumable.

Up to `--parallel` documents decode together (`runtime.batch.Scheduler`); each answer is
written when its document finishes, to a temporary file that is synced and renamed, so a run
killed at any moment leaves finished answers whole and no partial ones: a rerun skips the
done documents and redoes the ones that were in flight. Because a sequence's output does not
depend on what ran beside it, a rerun of one document reproduces the answer it had.
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from colibri.formats.layout import write_atomic
from colibri.cli.prompt_dir import check_folders, output_path, prompt_files, read_prompt

PARTIAL_SUFFIX = ".partial"  # what write_atomic writes beside its target
LOCK_NAME = ".colibri-run.lock"


@contextmanager
def claimed_documents(prompt_dir: Path, out_dir: Path):
    """Hold OUT for this job while the block runs, and yield (every prompt file, those without
    an answer yet). OUT is locked before anything in it is touched: a second job on it is
    refused in one line and leaves the first one's files alone; then a killed run's leftovers
    (NAME.partial) are removed."""
    check_folders(prompt_dir, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_out_dir(out_dir)
    try:
        for stale in out_dir.glob("*" + PARTIAL_SUFFIX):
            stale.unlink()
        inputs = prompt_files(prompt_dir)
        yield inputs, [p for p in inputs if not output_path(out_dir, p).exists()]
    finally:
        lock.close()


def write_answer(target: Path, text: str) -> None:
    """`text` in `target`, all or nothing: written beside it (NAME.partial), synced, then renamed over it."""
    write_atomic(target, text.encode("utf-8"))


def lock_out_dir(out_dir: Path):
    """Hold an exclusive lock on OUT for this job (two jobs answering into one folder would
    redo and overwrite each other's documents)."""
    handle = open(out_dir / LOCK_NAME, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise SystemExit(f"colibri run: error: --out-dir {out_dir} is in use by another colibri run") from None
    return handle


def run_documents(scheduler, todo: list[Path], out_dir: Path, sampling: dict, progress: tqdm, debug: bool = False):
    """Answer every document of `todo` through `scheduler` (a `runtime.batch.Scheduler` or a
    `runtime.sweep.Sweep`), at most len(scheduler.slots) at a time; returns
    (written, failed names, {name: its numbers}, the run's stats). A document that cannot be
    read or tokenized fails alone."""
    documents = iter(todo)
    running: dict[int, tuple[Path, list[str]]] = {}
    written, failed, numbers = 0, [], {}
    started = time.perf_counter()

    def fail(path: Path, error: Exception) -> None:
        failed.append(path.name)
        progress.write(f"{path.name}: failed: {type(error).__name__}: {error}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        progress.update(1)

    def top_up() -> None:  # keep one document queued per slot, read only when needed
        while len(scheduler.queue) < len(scheduler.slots):
            path = next(documents, None)
            if path is None:
                return
            try:
                sequence = scheduler.add(read_prompt(path, scheduler.model.prompt_bytes_limit()), **sampling)
            except Exception as e:  # one bad prompt must not stop the night's job
                fail(path, e)
                continue
            running[sequence] = path, []

    top_up()
    while scheduler.busy:
        for event in scheduler.step():
            path, pieces = running[event.sequence]
            pieces.append(event.text)
            if event.finish_reason is None:
                continue
            del running[event.sequence]
            write_answer(output_path(out_dir, path), "".join(pieces))
            written += 1
            numbers[path.name] = mine = {**event.numbers, "finished_s": time.perf_counter() - started}
            progress.write(f"{path.name}: {mine['prompt_tokens']} prompt tokens, "
                           f"{mine['generated_tokens']} generated", file=sys.stderr)
            progress.update(1)
        generated = scheduler.counters["generated_tokens"]
        progress.set_postfix_str(f"{generated / (time.perf_counter() - started):.2f} tok/s", refresh=False)
        top_up()
    return written, failed, numbers, scheduler.stats()


def plan_for(model, parallel: int) -> dict:
    """The plan's batch row for this job's batch size (the largest planned one not above it)."""
    from colibri.runtime.plan import plan

    p = plan(model.layout, model.budget.ram, model.ctx, model.cache.kind)
    rows = [row for row in p["batches"] if row["batch"] <= parallel]
    return rows[-1] if rows else {}


def run_batch(model, args, sampling: dict, inputs: list[Path], todo: list[Path], window: int | None = None) -> int:
    """The nightly batch job over `todo` (the documents of `inputs` without an answer), in the
    OUT that `claimed_documents` holds: through the model's KV slots, or with `args.sweep` a
    sweep of `window` documents at a time (`runtime.sweep`)."""
    from colibri.runtime.sweep import Sweep

    with tqdm(total=len(inputs), initial=len(inputs) - len(todo), unit="doc", desc="documents",
              disable=None, file=sys.stderr) as progress:

        def on_layer(layer: int, documents: int) -> None:  # a sweep's prompt pass, which can take hours
            progress.set_postfix_str(f"prompts of {documents} documents: layer {layer + 1}/{model.config.n_layers}")

        scheduler = Sweep(model, window, args.scratch, on_layer) if args.sweep else model.scheduler()
        parallel = len(scheduler.slots)
        written, failed, documents, stats = run_documents(scheduler, todo, args.out_dir, sampling, progress, args.debug)
    skipped = len(inputs) - len(todo)
    summary = {"inputs": len(inputs), "written": written, "skipped_done": skipped, "failed": failed,
               "parallel": parallel, "sweep": args.sweep, "documents": documents, "stats": stats}
    if args.stats:
        write_answer(args.stats, json.dumps({**summary, "plan": plan_for(model, parallel)}, indent=1))
    rate = stats["tok_per_s"]
    print(json.dumps(summary) if args.json else
          f"batch: {len(inputs)} prompts, {written} written, {skipped} already done, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + (f"; {parallel} at a time{' (sweep)' if args.sweep else ''}, {rate:.2f} tok/s generated" if rate else ""))
    return 1 if failed else 0
