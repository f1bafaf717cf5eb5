"""Batch generation across machines on Ray (the optional `ray` extra).

- `ColibriGenerator`, a callable class for Ray Data, each actor opening the model once:

      ds.map_batches(ColibriGenerator, fn_constructor_kwargs={"model": "/models/m", "parallel": 8},
                     concurrency=4, batch_size=32)

  A batch's rows hold `prompt` (text) or `messages` (chat), and optionally `id` and the
  sampling settings (`max_tokens`, `temperature`, `top_k`, `top_p`, `min_p`, `seed`); they
  run through the batch engine, `parallel` at a time (the other keyword arguments are
  `EngineOptions` fields; without `parallel`, as many as fit: `engine.slots_for`), and come
  back with `text`, `prompt_tokens`, `generated_tokens` and `finish_reason` added.
- `run_prompt_dir`, `colibri run --prompt-dir IN --out-dir OUT --ray ADDRESS`: the driver
  reads IN, hands the documents to the actors a few at a time (one actor per node unless
  `--ray-actors` says otherwise) and writes each answer itself, atomically, as it comes back:
  OUT is on the driver's machine, nodes need only the model folder. The work of an actor lost
  mid-run goes to the others, and an answer written is never written again. `--stats` merges
  the actors' numbers (`runtime.batch.merge_stats`, each actor's kept too); `--trace-routing`
  writes their routing records, a chunk at a time, each with its `actor` and with steps
  numbered across the job. An actor that died takes its numbers with it.
Every answer is the one the same document gets on one machine: a sequence's output does not
depend on what runs beside it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import sys
import time
from collections import deque
from pathlib import Path

from colibri.cli.batch_job import plan_for, write_answer
from colibri.cli.prompt_dir import output_path, read_prompt
from colibri.runtime.options import MOST_PARALLEL, EngineOptions

SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")
INSTALL_HINT = "pip install 'colibri-moe[ray]' (Ray Data's map_batches also needs 'ray[data]')"


def import_ray():
    try:
        import ray
    except ImportError:
        raise SystemExit(f"colibri run: error: --ray needs Ray: {INSTALL_HINT}") from None
    return ray


class ColibriGenerator:
    """Rows of prompts in, the same rows with their generated text out (see the module)."""

    def __init__(self, model: str, options: EngineOptions | None = None, jobs: int = MOST_PARALLEL,
                 trace_routing: bool = False, **changes):
        from colibri.runtime import open_model

        self.model = open_model(model, options, jobs=jobs, **changes)
        self.scheduler = self.model.scheduler()  # one for the actor's life: its counters are the actor's
        self.trace = io.StringIO() if trace_routing else None
        if self.trace is not None:
            self.model.trace_routing(self.trace)

    def slots(self) -> int:
        """The sequences this actor decodes together (its KV slots)."""
        return len(self.model.slots)

    def stats(self) -> dict:
        """`Scheduler.stats` of everything this actor generated."""
        return self.scheduler.stats()

    def plan(self) -> dict:
        """The plan's batch row for this actor's slots (`batch_job.plan_for`)."""
        return plan_for(self.model, len(self.model.slots))

    def answer(self, rows: list[dict]) -> tuple[list[dict], str]:
        """`generate(rows)`, and the routing records it wrote (JSON lines; "" without a trace)."""
        results = self.generate(rows)
        if self.trace is None:
            return results, ""
        records = self.trace.getvalue()
        self.trace.seek(0)
        self.trace.truncate()
        return results, records

    def __call__(self, batch) -> dict:
        columns = {name: list(values) for name, values in dict(batch).items()}
        count = len(next(iter(columns.values()), []))
        rows = [{name: values[i] for name, values in columns.items()} for i in range(count)]
        results = self.generate(rows)
        return {**columns, **{name: [r[name] for r in results] for name in results[0]}} if results else columns

    def generate(self, rows: list[dict]) -> list[dict]:
        """{text, prompt_tokens, generated_tokens, finish_reason} of each row, in order; a row
        that cannot run (a prompt too long, a bad template) gets `error` and no text."""
        scheduler = self.scheduler
        order, pieces, results = {}, {}, {}
        for i, row in enumerate(rows):
            prompt = row["messages"] if row.get("messages") is not None else row["prompt"]
            sampling = {name: _plain(row[name]) for name in SAMPLING_COLUMNS if row.get(name) is not None}
            try:
                sequence = scheduler.add(_plain(prompt), **sampling)
            except Exception as e:  # one bad row must not fail the others
                results[i] = {"text": None, "finish_reason": "error", "prompt_tokens": 0, "generated_tokens": 0,
                              "error": f"{type(e).__name__}: {e}"}
                continue
            order[sequence], pieces[sequence] = i, []
        while scheduler.busy:
            for event in scheduler.step():
                pieces[event.sequence].append(event.text)
                if event.finish_reason is not None:
                    results[order[event.sequence]] = {
                        "text": "".join(pieces[event.sequence]), "finish_reason": event.finish_reason,
                        "prompt_tokens": event.numbers["prompt_tokens"],
                        "generated_tokens": event.numbers["generated_tokens"], "error": None}
        return [results[i] for i in range(len(rows))]


def _plain(value):
    """A numpy scalar or array from a Ray batch as the Python value it holds."""
    return value.tolist() if hasattr(value, "tolist") else value


def run_prompt_dir(args, sampling: dict, inputs: list[Path], todo: list[Path], options: EngineOptions) -> int:
    """`colibri run --prompt-dir --ray`: the documents of `todo` answered by actors of a Ray
    cluster; the driver writes the answers (see the module) into the OUT that
    `batch_job.claimed_documents` holds."""
    ray = import_ray()
    from colibri.runtime.text import Tokenizer
    from colibri.runtime.engine import NORMALIZER_SLACK

    limit = args.ctx * Tokenizer.from_dir(args.model).max_token_bytes * NORMALIZER_SLACK
    # "local" starts a cluster on this machine for the job whatever RAY_ADDRESS says (shutdown
    # stops it), "auto" joins the running one, anything else is a cluster's address
    ray.init(address=args.ray, log_to_driver=False, include_dashboard=False)
    try:
        count = args.ray_actors or len([n for n in ray.nodes() if n.get("Alive")])
        # no CPU reservation (the engine sets its own threads), spread: one actor per node
        worker = ray.remote(num_cpus=0, scheduling_strategy="SPREAD")(ColibriGenerator)
        jobs = -(-len(todo) // max(count, 1))  # the documents an actor gets if the work shares out evenly
        actors = [worker.remote(str(args.model), options, jobs, trace_routing=bool(args.trace_routing))
                  for _ in range(count)]
        parallel = min(ray.get([actor.slots.remote() for actor in actors]))
        started = time.perf_counter()
        with (open(args.trace_routing, "w") if args.trace_routing else contextlib.nullcontext()) as trace:
            written, failed, documents = _dispatch(ray, actors, todo, parallel, limit, sampling, args.out_dir,
                                                   RayTrace(trace, actors) if trace else None)
        if args.stats:
            alive = _alive(ray, actors)
            each = ray.get([actor.stats.remote() for actor in alive])
            plan = ray.get(alive[0].plan.remote()) if alive else {}
    finally:
        ray.shutdown()
    skipped = len(inputs) - len(todo)
    summary = {"inputs": len(inputs), "written": written, "skipped_done": skipped, "failed": failed,
               "actors": count, "parallel": parallel, "seconds": time.perf_counter() - started}
    if args.stats:
        from colibri.runtime.batch import merge_stats

        write_answer(args.stats, json.dumps({**summary, "documents": documents, "stats": merge_stats(each) if each
                                             else None, "actor_stats": each, "plan": plan}, indent=1))
    print(json.dumps(summary) if args.json else
          f"batch on Ray: {len(inputs)} prompts, {written} written, {skipped} already done, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f"; {count} actors of {parallel} slots")
    return 1 if failed else 0


class RayTrace:
    """Writes the actors' routing records into one trace file: each record with its actor's
    index, and its step renumbered so that steps are distinct across the job."""

    def __init__(self, file, actors: list):
        self.file, self.actor_index = file, {actor: i for i, actor in enumerate(actors)}
        self.steps = itertools.count()

    def write(self, actor, records: str) -> None:
        renumbered = {}
        for line in records.splitlines():
            record = json.loads(line)
            if record["step"] not in renumbered:
                renumbered[record["step"]] = next(self.steps)
            self.file.write(json.dumps({**record, "step": renumbered[record["step"]],
                                        "actor": self.actor_index[actor]}) + "\n")


def _alive(ray, actors: list) -> list:
    """The actors that still answer."""
    alive = []
    for actor in actors:
        try:
            ray.get(actor.slots.remote())
            alive.append(actor)
        except ray.exceptions.RayActorError:
            pass
    return alive


def _dispatch(ray, actors: list, todo: list[Path], parallel: int, limit: int, sampling: dict,
              out_dir: Path, trace: RayTrace | None) -> tuple[int, list[str], dict]:
    """Give each idle actor the next `parallel` documents (read only then) until all are
    answered; a chunk whose actor died goes back to the front for the others. Returns
    (written, failed names, {name: its numbers}) and writes each answered chunk's routing
    to `trace`."""
    documents, retry, failed, numbers = iter(todo), deque(), [], {}
    started = time.perf_counter()

    def next_chunk() -> list[tuple[Path, object]]:
        if retry:
            return retry.popleft()
        chunk = []
        for path in documents:
            try:
                chunk.append((path, read_prompt(path, limit)))
            except Exception as e:  # one bad prompt must not stop the night's job
                failed.append(path.name)
                print(f"{path.name}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            if len(chunk) == parallel:
                break
        return chunk

    idle, running, written = list(actors), {}, 0
    while True:
        while idle and (work := next_chunk()):
            actor = idle.pop()
            rows = [{"prompt" if isinstance(p, str) else "messages": p, **sampling} for _, p in work]
            running[actor.answer.remote(rows)] = actor, work
        if not running:
            if not idle and next_chunk():
                raise SystemExit("colibri run: error: every Ray actor died with documents left; rerun the same "
                                 "command to answer them")
            return written, failed, numbers
        done, _ = ray.wait(list(running), num_returns=1)
        actor, work = running.pop(done[0])
        try:
            results, records = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            print(f"a Ray actor died ({type(e).__name__}); its {len(work)} documents go to the others", file=sys.stderr)
            retry.appendleft(work)
            continue
        idle.append(actor)
        if trace is not None:
            trace.write(actor, records)
        for (path, _), result in zip(work, results):
            target = output_path(out_dir, path)
            if result["error"] is not None:
                failed.append(path.name)
                print(f"{path.name}: failed: {result['error']}", file=sys.stderr)
            elif not target.exists():  # a retried chunk never answers a document twice
                write_answer(target, result["text"])
                written += 1
                numbers[path.name] = {"prompt_tokens": result["prompt_tokens"],
                                      "generated_tokens": result["generated_tokens"],
                                      "finish_reason": result["finish_reason"], "finished_s": time.perf_counter() - started}
                print(f"{path.name}: {result['prompt_tokens']} prompt tokens, {result['generated_tokens']} generated",
                      file=sys.stderr)
