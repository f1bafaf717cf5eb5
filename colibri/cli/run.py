"""`colibri run` and `colibri plan`: the runtime's command-line face."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from colibri.cli.isa_flag import add_isa_flag, settle_isa
from colibri.runtime.memory import format_size, size_argument
from colibri.runtime.options import add_engine_flags, engine_options


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a converted model folder")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="generate a continuation of TEXT")
    source.add_argument("--prompt-file", type=Path, metavar="FILE", help="read the prompt from FILE")
    source.add_argument("--chat", action="store_true", help="interactive chat on stdin, using the model's chat template")
    source.add_argument("--prompt-dir", type=Path, metavar="IN",
                        help="batch job: one output per prompt file in IN (.txt/.md plain, .json {\"messages\": [...]}); done ones are skipped")
    p.add_argument("--out-dir", type=Path, metavar="OUT", help="where --prompt-dir writes IN's outputs (NAME.out for IN/NAME; not inside IN)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="--prompt-dir: spread the documents over a Ray cluster (auto = the running one, local = start "
                        "one on this machine for the job, else a cluster address); every node needs the model folder "
                        "at --model's path; the answers are written here (needs the ray extra)")
    p.add_argument("--ray-actors", type=int, default=None, metavar="N",
                   help="--ray: actors, each with the model open and --parallel slots (default: one per node)")
    p.add_argument("--sweep", action="store_true",
                   help="--prompt-dir: read a window of documents' prompts layer by layer, each layer's experts once "
                        "for all of them, then decode them together (--parallel N: the window; default: as many as "
                        "fit in a quarter of the RAM budget's room, or with --scratch in half its free space, at most "
                        "4096)")
    p.add_argument("--scratch", type=Path, metavar="DIR",
                   help="--sweep: keep the window's KV caches and hidden states in nameless files in DIR (an existing "
                        "folder on a fast disk), which the kernel pages out when RAM is short")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    add_engine_flags(p)  # --parallel: the documents of --prompt-dir decoded together
    add_isa_flag(p)
    p.add_argument("--direct-io", action="store_const", const="direct", dest="io", default=argparse.SUPPRESS,
                   help="the same as --io direct")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p × the top probability (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed for sampling (default: random; 0 for --prompt-dir, so that a rerun reproduces each answer)")
    p.add_argument("--json", action="store_true", help="print the output and the run's numbers as one JSON object")
    p.add_argument("--stats", type=Path, metavar="FILE",
                   help="--prompt-dir: write the job's numbers (its summary, each document's, the plan's ceiling) "
                        "to FILE as JSON, for colibri report")
    p.add_argument("--trace-routing", type=Path, metavar="FILE", help="write the experts chosen per token per layer (JSON lines)")


def _sampling(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p, "seed": args.seed}


def format_stats(stats: dict) -> str:
    """One line of the numbers a run produced."""

    def rate(v):
        return "-" if v is None else f"{v:.2f}"

    return (
        f"[prompt {stats['prompt_tokens']} tok at {rate(stats['prompt_tok_per_s'])} tok/s, generated "
        f"{stats['generated_tokens']} tok at {rate(stats['generation_tok_per_s'])} tok/s, first token "
        f"{rate(stats['time_to_first_token_s'])} s, expert hit rate {stats['expert_hit_rate']:.1%}, "
        f"{format_size(stats['expert_bytes_read_per_token'])} read/token{_prefetch_stats(stats)}, "
        f"peak RSS {format_size(stats['peak_rss_bytes'])}]"
    )


def _prefetch_stats(stats: dict) -> str:
    if not stats["prefetch"] or stats["prefetch_accuracy"] is None:
        return ""
    hidden = stats["read_hidden_share"]
    return (f", prefetch accuracy {stats['prefetch_accuracy']:.0%}"
            + (f", {hidden:.0%} of read time hidden" if hidden is not None else ""))


def run_chat(model, args) -> int:
    messages = []
    print("chat: type a message, an empty line or Ctrl-D ends", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = []
        for piece in model.generate(messages, **_sampling(args)):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def run_command(args: argparse.Namespace) -> int:
    from colibri.runtime import open_model

    options = engine_options(args, "run")
    for flag, needs, given in (("--ray", "--prompt-dir", args.prompt_dir), ("--sweep", "--prompt-dir", args.prompt_dir),
                               ("--scratch", "--sweep", args.sweep)):
        if getattr(args, flag[2:]) and not given:
            raise SystemExit(f"colibri run: error: {flag} needs {needs}")
    if args.sweep and args.ray:
        raise SystemExit("colibri run: error: --sweep runs on this machine; drop --ray")
    if args.scratch and not args.scratch.is_dir():
        raise SystemExit(f"colibri run: error: --scratch {args.scratch}: not an existing folder")
    settle_isa(args, "run")
    if not args.prompt_dir:
        model = open_model(args.model, options)
        with _routing_trace(model, args):
            return run_chat(model, args) if args.chat else run_prompt(model, args)
    from colibri.cli.batch_job import claimed_documents, run_batch

    sampling = {**_sampling(args), "seed": args.seed if args.seed is not None else 0}
    with claimed_documents(args.prompt_dir, args.out_dir) as (inputs, todo):  # OUT is this job's from here
        if args.ray:
            from colibri.cli.ray_batch import run_prompt_dir

            return run_prompt_dir(args, sampling, inputs, todo, options)
        window = None
        if args.sweep:
            from colibri.formats.layout import ModelLayout
            from colibri.runtime.sweep import sweep_options, sweep_window

            layout = ModelLayout(args.model)
            window = sweep_window(layout, options, len(todo), args.scratch)
            options = sweep_options(layout, options, window, args.scratch)
        model = open_model(args.model, options, jobs=len(todo))
        with _routing_trace(model, args):
            return run_batch(model, args, sampling, inputs, todo, window)


@contextmanager
def _routing_trace(model, args):
    """The experts chosen per token per layer written to --trace-routing while the block runs."""
    if not args.trace_routing:
        yield
        return
    with open(args.trace_routing, "w") as trace:
        model.trace_routing(trace)
        yield


def run_prompt(model, args) -> int:
    """--prompt or --prompt-file: one continuation, streamed, then the run's numbers."""
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    pieces = []
    for piece in model.generate(prompt, **_sampling(args)):
        pieces.append(piece)
        if not args.json:
            print(piece, end="", flush=True)
    stats = model.stats()
    if args.json:
        print(json.dumps({"output": "".join(pieces), "stats": stats}))
    else:
        print()
        print(format_stats(stats), file=sys.stderr)
    return 0


def _disk_bandwidth(text: str):
    """--disk-bw: "measure", or GB/s as bytes/s."""
    if text == "measure":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a read bandwidth in GB/s (e.g. 3.5) nor 'measure'")
    return value * 1e9


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a converted model folder")
    p.add_argument("--ram", type=size_argument, required=True, metavar="SIZE", help="the machine's RAM, e.g. 32G")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the largest power of two whose KV cache takes at most a quarter of the free RAM)")
    add_engine_flags(p, ("kv_quant",))
    p.add_argument("--disk-bw", type=_disk_bandwidth, default=None, metavar="GB/s|measure",
                   help="the disk's read bandwidth in GB/s, or 'measure' to read the model's expert files cold (default: not used)")
    p.add_argument("--hit-rate", type=float, default=None, help="expected expert cache hit rate 0..1 (default: cache share of all experts)")
    p.add_argument("--measure-speed", action="store_true",
                   help="time a few batch decode steps of the model on this machine (tens of seconds), so that the "
                        "batch table gives expected tok/s instead of ceilings only")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="a `colibri run --trace-routing` file of an earlier run: distinct experts per step of a "
                        "batch, and of a sweep's passes, from its routing instead of uniform routing")
    p.add_argument("--threads", type=int, default=None, help="compute threads for --measure-speed (default: all cores)")
    job = p.add_argument_group("a folder job as a sweep (`colibri run --prompt-dir --sweep`): its window, scratch, "
                               "disk reads and their time (--disk-bw; default: measure), and with --measure-speed "
                               "its compute and total time")
    job.add_argument("--docs", type=int, metavar="D", help="documents in the folder")
    job.add_argument("--doc-tokens", type=int, metavar="T", help="--docs: prompt tokens of a document, on average")
    job.add_argument("--gen-tokens", type=int, metavar="G", help="--docs: tokens generated per document")
    job.add_argument("--parallel", type=int, metavar="N",
                     help="--docs: the sweep's window (default: what `colibri run --sweep` chooses within the "
                          "recommended --ram-budget)")
    job.add_argument("--scratch", type=Path, metavar="DIR", help="--docs: the --scratch folder the sweep would use")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def plan_command(args: argparse.Namespace) -> int:
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.plan import measure_costs, measure_disk_bandwidth, plan, traced_choices

    _check_job_arguments(args)
    layout = ModelLayout(args.model)
    if args.docs and args.disk_bw is None:
        args.disk_bw = "measure"
    disk_bw = measure_disk_bandwidth(layout) if args.disk_bw == "measure" else args.disk_bw
    costs = measure_costs(args.model, threads=args.threads, doc_tokens=args.doc_tokens) if args.measure_speed else None
    trace = traced_choices(args.trace, layout.config.n_experts) if args.trace else None
    p = plan(layout, args.ram, args.ctx, args.kv_quant, disk_bw=disk_bw, hit_rate=args.hit_rate, costs=costs,
             trace=trace)
    if args.docs:
        from colibri.runtime.sweep_plan import sweep_plan

        p["sweep"] = sweep_plan(layout, costs, disk_bw, args.docs, args.doc_tokens, args.gen_tokens,
                                p["ram"] - p["os_reserve_bytes"], args.kv_quant, args.ctx, args.parallel, args.scratch,
                                trace)
    print(json.dumps(p, indent=1) if args.json else format_plan(p, args.model))
    return 0 if p["fits"] and p.get("sweep", {}).get("fits", True) else 1


def _check_job_arguments(args: argparse.Namespace) -> None:
    """Exit with one line for a job flag without --docs, a job without its lengths, or a count below 1."""
    given = [flag for flag in ("doc_tokens", "gen_tokens", "parallel", "scratch") if getattr(args, flag) is not None]
    if args.docs is None and given:
        raise SystemExit(f"colibri plan: error: --{given[0].replace('_', '-')} needs --docs")
    if args.docs is None:
        return
    for flag in ("docs", "doc_tokens", "gen_tokens", "parallel"):
        value = getattr(args, flag)
        if value is None and flag != "parallel":
            raise SystemExit(f"colibri plan: error: --docs needs --{flag.replace('_', '-')}")
        if value is not None and value < 1:
            raise SystemExit(f"colibri plan: error: --{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.scratch is not None and not args.scratch.is_dir():
        raise SystemExit(f"colibri plan: error: --scratch {args.scratch}: not an existing folder")


def format_batches(p: dict) -> list[str]:
    """The batch table: KV of B slots and the aggregate decode tok/s to expect."""
    expected = p["costs"] is not None
    routing = "a routing trace" if p["routing"] == "trace" else "uniform routing"
    lines = [f"  batches (--parallel B; KV {format_size(p['kv_cache_bytes'])} a slot; distinct experts from {routing}; "
             + ("tok/s expected from this machine's measured step costs)" if expected else
                "ceilings only: --measure-speed gives expected tok/s)")]
    head = "expected in RAM, disk-bound" if expected else "memory ceiling, disk ceiling"
    lines.append(f"    {'B':>3} {'KV':>10} {'fits':>5} {'experts/step':>13} {'MB/step':>9}   aggregate tok/s ({head})")
    for r in p["batches"]:
        first, second = ((r["expected_tok_per_s"], r["expected_disk_tok_per_s"]) if expected else
                         (r["memory_ceiling_tok_per_s"], r["disk_ceiling_tok_per_s"]))
        lines.append(f"    {r['batch']:>3} {format_size(r['kv_bytes']):>10} {'yes' if r['fits'] else 'no':>5} "
                     f"{r['distinct_experts_per_step']:>13.1f} {r['expert_bytes_per_step'] / 1e6:>9.1f}   "
                     f"{first:.2f}, " + ("-" if second is None else f"{second:.2f}"))
    return lines


def format_sweep(s: dict, model) -> list[str]:
    """The sweep section: the job, its window, what it reads and holds, and its expected time."""
    routing = "; experts from a routing trace" if s.get("routing") == "trace" else ""
    lines = [f"  a sweep of {s['docs']} documents ({s['doc_tokens']} prompt tokens and {s['gen_tokens']} generated "
             f"each; --ctx {s['ctx']}{routing}): {s['window']} at a time"]
    where = f"in --scratch {s['scratch']}" if s["scratch"] else "in RAM"
    lines.append(f"    the window's KV caches and prompt hidden states: {format_size(s['window_bytes'])} {where}")
    if not s["fits"]:
        return lines + [f"    does NOT fit: {s['why']}"]
    lines.append(f"    expert cache {format_size(s['expert_cache_bytes'])}; reads {s['bytes_read'] / 1e9:.2f} GB from disk, "
                 f"{format_size(s['bytes_per_generated_token'])} per generated token: {s['disk_s']:.1f} s")
    if s["compute_s"] is None:
        alone = f": the disk alone allows {s['docs'] * s['gen_tokens'] / s['disk_s']:.2f} tok/s generated" \
            if s["disk_s"] else ""
        lines.append(f"    compute not measured (--measure-speed times this model on this machine first){alone}")
    else:
        lines.append(f"    compute {s['compute_s']:.1f} s (this machine's measured costs) → expected {s['seconds']:.1f} s, "
                     f"{s['tok_per_s']:.2f} tok/s generated ({s['bound_by']}-bound)")
    scratch = f" --scratch {s['scratch']}" if s["scratch"] else ""
    lines.append(f"    run: colibri run --model {model} --prompt-dir IN --out-dir OUT --sweep --parallel {s['window']} "
                 f"--ctx {s['ctx']} --max-tokens {s['gen_tokens']} --ram-budget {format_size(s['ram_budget'])}{scratch}")
    return lines


def format_plan(p: dict, model) -> str:
    """The budget table of `runtime.plan.plan` for people."""
    kv = f"KV cache (--ctx {p['ctx']}, {p['kv_quant']})" + (", DeltaNet states" if p["state_bytes"] else "")
    rows = [("resident weights (always in RAM)", p["resident_bytes"]), (kv, p["kv_cache_bytes"]),
            ("expert cache (recommended --expert-cache)", p["expert_cache_bytes"]), ("scratch", p["scratch_bytes"]),
            ("runtime (Python, numba, kernels)", p["runtime_bytes"]), ("OS and page cache reserve (15%)", p["os_reserve_bytes"])]
    lines = [f"plan for {model} in {format_size(p['ram'])} of RAM"]
    lines += [f"  {label:<44} {format_size(nbytes):>10}" for label, nbytes in rows]
    lines.append(f"  {'all routed experts on disk':<44} {format_size(p['all_experts_bytes']):>10}")
    lines.append(f"  expert bytes per token {format_size(p['expert_bytes_per_token'])}, hit rate {p['hit_rate']:.0%} → "
                 f"{format_size(p['streamed_bytes_per_token'])} read from disk per token")
    disk = f"disk {p['disk_bandwidth'] / 1e9:.2f} GB/s" if p["disk_bandwidth"] else "disk speed not given (--disk-bw)"
    lines.append(f"  {disk}, memory {p['memory_bandwidth'] / 1e9:.1f} GB/s → decode ceiling "
                 f"{p['ceiling_tok_per_s']:.2f} tok/s ({p['bound_by']}-bound)"
                 + (f"; expected {p['expected_tok_per_s']:.2f} tok/s from this machine's measured costs"
                    if p["expected_tok_per_s"] else ""))
    lines += format_batches(p)
    if "sweep" in p:
        lines += format_sweep(p["sweep"], model)
    lines.append("  experts read with --io:")
    lines += [f"    {mode:<7} {text}" for mode, text in p["io"]["modes"].items()]
    lines.append(f"    here: --io {p['io']['recommended']} ({p['io']['why']})")
    if not p["fits"]:
        lines.append("  does NOT fit: lower --ctx, use --kv-quant q8_0, or add RAM")
    else:
        lines.append(f"  recommended: colibri run --model {model} --ram-budget {format_size(p['ram'] - p['os_reserve_bytes'])} "
                     f"--expert-cache {format_size(p['expert_cache_bytes'])} --ctx {p['ctx']} --io {p['io']['recommended']}")
    return "\n".join(lines)
