"""Benchmark: expert-cache hit rates of each policy on routing traces, next to Belady's optimum.

Replays `colibri run --trace-routing FILE` output (JSON lines: position, layer, experts)
through the runtime's own `CacheIndex` with every policy at several cache sizes (in
experts), and through Belady's MIN (evict the expert whose next use is farthest away: the
offline upper bound no online policy can beat). Prints a table, writes bench/out/policy.json.

`--model DIR --text FILE` first writes such a trace of decoding: the text's first --tokens
tokens fed one at a time to the model (teacher-forced, as a document is read token by token),
so a trained model's real routing is replayed, without a prompt's many-token steps.

    python bench/policy.py TRACE.jsonl [TRACE2.jsonl ...] [--sizes 0.05 0.1 0.25 0.5] [--out FILE]
    python bench/policy.py --model DIR --text FILE [--tokens 2048] [--trace-out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from colibri.runtime import open_model
from colibri.runtime.expert_store import POLICIES
from colibri.runtime.policy_replay import SHARES, policy_table, read_trace

BENCH = Path(__file__).resolve().parent


def decode_trace(model_dir: Path, text: Path, tokens: int, out: Path) -> Path:
    """The routing of `text`'s first `tokens` tokens, each decoded alone, written to `out`."""
    model = open_model(model_dir, ctx=tokens + 1)
    ids = model.tokenizer.encode(text.read_text(encoding="utf-8"))[:tokens]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        model.trace_routing(f)
        for token in ids:
            model.decode(token)
    model.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--model", type=Path, help="a converted model to trace, with --text")
    parser.add_argument("--text", type=Path, help="the text its decoding is fed")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of --text decoded (default: %(default)s)")
    parser.add_argument("--trace-out", type=Path, help="where that trace goes (default: bench/out/trace-MODEL.jsonl)")
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SHARES),
                        help="cache sizes as shares of all distinct experts in the trace")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "policy.json", help="the JSON results (default: %(default)s)")
    args = parser.parse_args()
    if args.model:
        if not args.text:
            parser.error("--model needs --text")
        args.traces.append(decode_trace(args.model, args.text, args.tokens,
                                        args.trace_out or BENCH / "out" / f"trace-{args.model.name}.jsonl"))
    if not args.traces:
        parser.error("give traces, or --model and --text")
    results = []
    print(f"{'trace':<28}{'cache':>7}" + "".join(f"{p:>9}" for p in POLICIES) + f"{'Belady':>9}")
    for path in args.traces:
        for row in policy_table(read_trace(path), args.sizes):
            results.append({"trace": path.name, **row})
            print(f"{path.name:<28}{row['cache_share']:>6.0%} " + "".join(f"{row[p]:>9.1%}" for p in POLICIES)
                  + f"{row['belady']:>9.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
