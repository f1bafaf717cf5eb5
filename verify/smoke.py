"""`colibri smoke MODEL --record FILE` / `--compare FILE`: a fixed-prompt baseline, and the drift from it.

`--record` runs a fixed prompt set greedily and writes FILE (JSON: prompts, token ids, the
first 200 characters of each output, speeds, expert hit rate, the manifest's sha256, quant
recipe, machine, tool version, date) and FILE with suffix `.npz`: the logits of every
position, float16, each row shifted so its maximum is 0 (most precise where the mass is).

`--compare` teacher-forces the same prompts on the baseline's tokens (one prefill of prompt +
generated tokens) and reports, like `llama-perplexity --kl-divergence`, KL(baseline ‖ new),
RMS Δp of the baseline's token and the same-top-1 rate. Scored are the predictions of every
token after the first of each sequence (logits row i predicts token i + 1). Then it runs
greedy generation freely for token agreement and the speed ratio.

Exit codes: 0 done / within bounds, 1 a `--max-kl` / `--min-top1` bound failed, 2 an unusable
baseline or prompt file (one line naming the file).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from colibri.runtime.memory import total_ram
from colibri.runtime.options import add_engine_flags, engine_options, option_names
from colibri.version import __version__

FORMAT = "colibri-smoke"
VERSION = 1
HEAD_CHARS = 200
DEFAULT_MAX_TOKENS = 32
SMOKE_OPTIONS = option_names("parallel")  # the engine flags a baseline takes: its prompts run one at a time
SMOKE_CTX = 1024  # positions a baseline's prompt and its tokens get (--ctx's default here)
PROMPTS = (
    "The river town woke slowly, and",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
    "A short list of things to pack for a week of hiking:",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "In 1969, the first people to walk on the Moon",
)


class SmokeError(Exception):
    """A baseline or prompt file that cannot be used; the message is one line naming the file."""


# --- running the prompts -----------------------------------------------------------------


def _warm_up(model, ids: list[int]) -> None:
    """Load the kernels before anything is timed."""
    model.reset()
    model.prefill(ids[:2])
    model.decode(ids[0])


def free_run(model, prompt_ids: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    """Greedy continuations (stopping at a stop token or the context end) and the run's numbers."""
    stop = model.tokenizer.eos_ids
    _warm_up(model, prompt_ids[0])
    outputs, prompt_s, decodes, decode_s = [], 0.0, 0, 0.0
    for ids in prompt_ids:
        model.reset()
        started = time.perf_counter()
        logits = model.prefill(ids, all_logits=False)[-1]
        prompt_s += time.perf_counter() - started
        tokens = []
        for _ in range(max_tokens):
            token = int(np.argmax(logits))
            if token in stop:
                break
            tokens.append(token)
            if len(tokens) == max_tokens or model.position >= model.ctx:
                break
            started = time.perf_counter()
            logits = model.decode(token)
            decode_s += time.perf_counter() - started
            decodes += 1
        outputs.append(tokens)
    stats = model.stats()
    numbers = {
        "prompt_tok_per_s": sum(map(len, prompt_ids)) / prompt_s if prompt_s else None,
        "generation_tok_per_s": decodes / decode_s if decode_s else None,
        "expert_hit_rate": stats["expert_hit_rate"],
        "expert_bytes_read_per_token": stats["expert_bytes_read_per_token"],
    }
    return outputs, numbers


def teacher_forced(model, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens) - 1, vocab]: row i predicts tokens[i + 1]."""
    model.reset()
    return model.prefill(tokens[:-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


# --- record --------------------------------------------------------------------------------


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": total_ram(), "os": platform.platform(),
            "python": platform.python_version()}


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, or one prompt per non-empty line."""
    try:
        text = path.read_text(encoding="utf-8")
        prompts = json.loads(text) if text.lstrip().startswith("[") else [s for s in text.splitlines() if s.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SmokeError(f"{path}: cannot read prompts ({' '.join(str(e).split())})") from None
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise SmokeError(f"{path}: expected non-empty prompts, one per line or a JSON list of strings")
    return prompts


def record(model, path: Path, prompts=PROMPTS, max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
    """Run `prompts` greedily and write the baseline `path` + its `.npz`; returns the baseline."""
    from colibri.formats.layout import MANIFEST_NAME, write_atomic

    path = Path(path)
    npz = path.with_suffix(".npz")
    if npz == path:
        raise SmokeError(f"{path}: the baseline is JSON and its logits go to FILE.npz; choose a name like baseline.json")
    tok = model.tokenizer
    prompt_ids = [tok.encode(p) for p in prompts]
    generated, numbers = free_run(model, prompt_ids, max_tokens)
    buffer = io.BytesIO()
    rows = {}
    for i, (ids, gen) in enumerate(zip(prompt_ids, generated)):
        logits = teacher_forced(model, ids + gen)
        rows[f"logits_{i}"] = (logits - logits.max(axis=1, keepdims=True)).astype(np.float16)
    np.savez_compressed(buffer, **rows)
    write_atomic(npz, buffer.getvalue())
    layout = model.layout
    baseline = {
        "format": FORMAT,
        "version": VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
        "machine": machine(),
        "model": {
            "path": str(layout.directory.resolve()),
            "manifest_sha256": hashlib.sha256((layout.directory / MANIFEST_NAME).read_bytes()).hexdigest(),
            "architecture": model.config.architecture,
            "vocab_size": model.config.vocab_size,
            "quant": layout.manifest["quant"],
        },
        "settings": {"max_tokens": max_tokens, "ctx": model.ctx, "kv_quant": model.cache.kind,
                     "ram_budget_bytes": model.budget.ram, "expert_cache_bytes": model.budget.expert_cache},
        **numbers,
        "logits": {"file": npz.name, "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
                   "layout": "logits_<prompt>: float16 [prompt + generated tokens - 1, vocab], row i predicts "
                             "token i + 1, each row shifted so its maximum is 0"},
        "prompts": [{"text": p, "prompt_ids": ids, "generated_ids": gen, "output_head": tok.decode(gen)[:HEAD_CHARS]}
                    for p, ids, gen in zip(prompts, prompt_ids, generated)],
    }
    write_atomic(path, json.dumps(baseline, indent=1, ensure_ascii=False).encode())
    return baseline


# --- compare -------------------------------------------------------------------------------


def load_baseline(path: Path) -> tuple[dict, list[np.ndarray]]:
    """The baseline JSON and its logits; a missing, corrupt or mismatched pair raises SmokeError."""
    path = Path(path)
    try:
        baseline = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SmokeError(f"{path}: no such baseline (write one with --record)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SmokeError(f"{path}: not a readable baseline ({' '.join(str(e).split())})") from None
    if not isinstance(baseline, dict) or baseline.get("format") != FORMAT:
        raise SmokeError(f"{path}: not a colibri smoke baseline")
    if baseline.get("version") != VERSION:
        raise SmokeError(f"{path}: baseline version {baseline.get('version')}; this colibri reads {VERSION}, "
                         "record it again")
    npz = path.with_suffix(".npz")
    try:
        data = npz.read_bytes()
    except OSError as e:
        raise SmokeError(f"{npz}: cannot read the logits of baseline {path.name} ({e.strerror})") from None
    try:
        if hashlib.sha256(data).hexdigest() != baseline["logits"]["sha256"]:
            raise SmokeError(f"{npz}: does not match baseline {path.name} (sha256 differs): "
                             "corrupt or from another recording")
        with np.load(io.BytesIO(data)) as z:
            logits = [z[f"logits_{i}"] for i in range(len(baseline["prompts"]))]
        for p, rows in zip(baseline["prompts"], logits):
            if rows.shape != (len(p["prompt_ids"]) + len(p["generated_ids"]) - 1, baseline["model"]["vocab_size"]):
                raise ValueError(f"logits of shape {rows.shape} for {p['text']!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise SmokeError(f"{path}: malformed baseline ({type(e).__name__}: {e})") from None
    return baseline, logits


def _refuse_other_tokenizer(model, baseline: dict, path: Path) -> None:
    theirs, ours = baseline["model"], model.config
    where = (f"{path}: recorded on {theirs['architecture']} ({theirs['path']}), "
             f"{model.layout.directory} is {ours.architecture}")
    if theirs["vocab_size"] != ours.vocab_size:
        raise SmokeError(f"{where}: vocabularies differ ({theirs['vocab_size']} vs {ours.vocab_size} tokens); "
                         "a baseline compares conversions of the same model")
    for n, p in enumerate(baseline["prompts"], 1):
        if model.tokenizer.encode(p["text"]) != p["prompt_ids"]:
            raise SmokeError(f"{where}: prompt {n} tokenizes differently, the tokenizers differ; "
                             "a baseline compares conversions of the same model")


def compare(model, baseline: dict, logits: list[np.ndarray], path: Path = Path("baseline")) -> dict:
    """Teacher-forced divergence and free-running agreement of `model` against a loaded baseline."""
    _refuse_other_tokenizer(model, baseline, path)
    prompts = baseline["prompts"]
    generated, numbers = free_run(model, [p["prompt_ids"] for p in prompts], baseline["settings"]["max_tokens"])
    divergence = []
    for p, tokens in zip(prompts, generated):
        ref = p["generated_ids"]
        divergence.append(None if tokens == ref else next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                                          min(len(tokens), len(ref))))
    kl, dp, top1 = [], [], []
    for p, base_rows in zip(prompts, logits):
        tokens = p["prompt_ids"] + p["generated_ids"]
        base, new = _log_softmax(base_rows), _log_softmax(teacher_forced(model, tokens))
        probs = np.exp(base)
        kl.append(np.maximum((probs * (base - new)).sum(axis=1), 0.0))
        rows, target = np.arange(len(base)), np.array(tokens[1:])
        dp.append(np.exp(new[rows, target]) - probs[rows, target])
        top1.append(base.argmax(axis=1) == new.argmax(axis=1))
    kl, dp, top1 = np.concatenate(kl), np.concatenate(dp), np.concatenate(top1)
    speed, base_speed = numbers["generation_tok_per_s"], baseline["generation_tok_per_s"]
    return {
        "model": str(model.layout.directory), "quant": model.layout.manifest["quant"]["recipe"],
        "baseline": str(path), "baseline_quant": baseline["model"]["quant"]["recipe"], "baseline_date": baseline["date"],
        "prompts": len(prompts), "positions": len(kl),
        "mean_kl": float(kl.mean()), "median_kl": float(np.median(kl)), "p99_kl": float(np.percentile(kl, 99)),
        "max_kl": float(kl.max()), "rms_dp": float(np.sqrt(np.mean(dp**2))), "same_top1": float(top1.mean()),
        "token_agreement": divergence.count(None) / len(prompts), "first_divergence": divergence,
        "speed_ratio": speed / base_speed if speed and base_speed else None,
        **numbers, "baseline_generation_tok_per_s": base_speed,
    }


def failed_bounds(report: dict, max_kl: float | None, min_top1: float | None) -> list[str]:
    """The `--max-kl` / `--min-top1` bounds the report breaks, one line each."""
    failed = []
    if max_kl is not None and report["mean_kl"] > max_kl:
        failed.append(f"--max-kl {max_kl:g}: mean KL divergence {report['mean_kl']:.6g} is above it")
    if min_top1 is not None and report["same_top1"] < min_top1:
        failed.append(f"--min-top1 {min_top1:g}: same-top-1 rate {report['same_top1']:.4f} is below it")
    return failed


# --- the command -----------------------------------------------------------------------


def _rate(value) -> str:
    return "-" if value is None else f"{value:.2f} tok/s"


def format_record(b: dict, path: Path) -> str:
    n = sum(len(p["generated_ids"]) for p in b["prompts"])
    lines = [f"recorded {len(b['prompts'])} prompts ({n} generated tokens) of {b['model']['path']} "
             f"({b['model']['quant']['recipe']}) → {path} + {b['logits']['file']}",
             f"  prompt {_rate(b['prompt_tok_per_s'])}, generation {_rate(b['generation_tok_per_s'])}, expert hit rate "
             f"{b['expert_hit_rate']:.1%}, {b['expert_bytes_read_per_token'] / 2**20:.2f} MiB read/token"]
    lines += [f"  {i}. {p['text']!r} → {json.dumps(p['output_head'], ensure_ascii=False)}"
              for i, p in enumerate(b["prompts"], 1)]
    return "\n".join(lines)


def format_report(r: dict) -> str:
    ratio = "-" if r["speed_ratio"] is None else f"{r['speed_ratio']:.2f}"
    lines = [
        f"smoke: {r['model']} ({r['quant']}) against {r['baseline']} ({r['baseline_quant']}, {r['baseline_date']})",
        f"  {r['prompts']} prompts, {r['positions']} positions teacher-forced on the baseline's tokens",
        f"  KL divergence     mean {r['mean_kl']:.6f}  median {r['median_kl']:.6f}  p99 {r['p99_kl']:.6f}  "
        f"max {r['max_kl']:.6f}",
        f"  RMS Δp            {r['rms_dp']:.3%}",
        f"  same top-1        {r['same_top1']:.2%}",
        f"  free-running      {round(r['token_agreement'] * r['prompts'])}/{r['prompts']} prompts identical; first "
        "divergence at token " + ", ".join("-" if d is None else str(d) for d in r["first_divergence"]),
        f"  generation        {_rate(r['generation_tok_per_s'])} vs {_rate(r['baseline_generation_tok_per_s'])} "
        f"baseline (ratio {ratio}); prompt {_rate(r['prompt_tok_per_s'])}, expert hit rate {r['expert_hit_rate']:.1%}",
    ]
    lines += [f"  FAIL {b}" for b in r["failed_bounds"]]
    if r["bounds"] and not r["failed_bounds"]:
        lines.append("  PASS " + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in r["bounds"].items()))
    return "\n".join(lines)


def add_smoke_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a converted model folder")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, metavar="FILE",
                      help="run the prompts greedily; write the baseline FILE (JSON) and its logits FILE.npz")
    mode.add_argument("--compare", type=Path, metavar="FILE",
                      help="measure MODEL against baseline FILE: KL divergence, top-1, token agreement, speed")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="--record: prompts, one per line or a JSON list (default: a built-in set of 6)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"--record: tokens to generate per prompt (default: {DEFAULT_MAX_TOKENS})")
    p.add_argument("--max-kl", type=float, metavar="X",
                   help="--compare: fail (exit 1) when the mean KL divergence is above X")
    p.add_argument("--min-top1", type=float, metavar="Y",
                   help="--compare: fail (exit 1) when the same-top-1 rate (0..1) is below Y")
    add_engine_flags(p, SMOKE_OPTIONS, ctx=SMOKE_CTX)
    p.add_argument("--json", action="store_true", help="print the baseline / the comparison as one JSON object")


def smoke_command(args: argparse.Namespace) -> int:
    from colibri.runtime import open_model

    try:
        misplaced = ("max_kl", "min_top1") if args.record else ("prompts", "max_tokens")
        for name in misplaced:
            if getattr(args, name) is not None:
                raise SmokeError(f"--{name.replace('_', '-')} does not apply to --{'record' if args.record else 'compare'}")
        loaded = load_baseline(args.compare) if args.compare else None
        prompts = read_prompts(args.prompts) if args.prompts else PROMPTS
        model = open_model(args.model, engine_options(args, "smoke"))
        if args.record:
            max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
            baseline = record(model, args.record, prompts, max_tokens)
            print(json.dumps(baseline, indent=1, ensure_ascii=False) if args.json else format_record(baseline, args.record))
            return 0
        report = compare(model, *loaded, args.compare)
    except SmokeError as e:
        print(f"colibri smoke: error: {e}", file=sys.stderr)
        return 2
    report["bounds"] = {k: v for k, v in (("max_kl", args.max_kl), ("min_top1", args.min_top1)) if v is not None}
    report["failed_bounds"] = failed_bounds(report, args.max_kl, args.min_top1)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if args.json:
        for bound in report["failed_bounds"]:
            print(f"colibri smoke: FAIL {bound}", file=sys.stderr)
    return 1 if report["failed_bounds"] else 0
