"""Benchmark: expert-cache hit rates of each policy on routing traces, next to Belady's optimum.

Replays `colibri run --trace-routing FILE` output (JSON lines: position, layer, experts)
through the runtime's own `CacheIndex` with every policy at several cache sizes (in
experts), and through Belady's MIN (evict the expert whose next use is farthest away: the
offline upper bound no online policy can beat). Prints a table, writes bench/out/policy.json.

    python bench/policy.py TRACE.jsonl [TRACE2.jsonl ...] [--sizes 0.05 0.1 0.25 0.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from colibri.runtime.expert_store import POLICIES
from colibri.runtime.policy_replay import SHARES, policy_table, read_trace

BENCH = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SHARES),
                        help="cache sizes as shares of all distinct experts in the trace")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "policy.json", help="the JSON results (default: %(default)s)")
    args = parser.parse_args()
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
