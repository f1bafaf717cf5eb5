#!/usr/bin/env python
"""Benchmark: an MLA model's sweep with its prompts' expansions kept from cut to cut
(`runtime.kept_expansions`, the default budget) against expanded again each cut (a budget of 0).

--docs documents of random ids (lengths uniform in --doc-tokens, a fixed seed) go through one
sweep (`runtime.sweep.Sweep`, a window of all of them), every expert in RAM, each decoding
--gen-tokens. The two settings alternate --repeat times; each run prints its seconds, its prompt
tokens a second, and whether its tokens and logits are bit-identical to the first run's. Medians
at the end; JSON in bench/out/kept_expansions.json.

    python bench/kept_expansions.py --model DIR [--docs 16] [--doc-tokens 100,400] [--gen-tokens 4]
        [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import model as model_module
from colibri.runtime import open_model
from colibri.runtime.expert_store import cache_bytes_for_all
from colibri.runtime.sweep import Sweep

BENCH = Path(__file__).resolve().parent


def one_sweep(path: Path, docs: list[list[int]], gen_tokens: int, keep_bytes: int, threads: int) -> tuple[float, bytes]:
    """Seconds of one sweep with `keep_bytes` for the kept expansions, and its outputs' bytes."""
    model_module.EXPANDED_MLA_KEEP_BYTES = keep_bytes  # (read when the decoder is made)
    layout = ModelLayout(path)
    model = open_model(path, threads=threads, ctx=max(map(len, docs)) + gen_tokens, io="pread",
                       expert_cache=cache_bytes_for_all(layout), parallel=len(docs))
    runner = Sweep(model, len(docs), keep_logits=True)
    for doc in docs:
        runner.add(doc, gen_tokens, ignore_eos=True)
    out = {}
    started = time.perf_counter()
    while runner.busy:
        for event in runner.step():
            out.setdefault(event.sequence, []).append(np.int64(event.token).tobytes() + event.logits.tobytes())
    seconds = time.perf_counter() - started
    model.close()
    return seconds, b"".join(b"".join(out[k]) for k in sorted(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a converted MLA model")
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", default="100,400", help="shortest,longest prompt in tokens")
    parser.add_argument("--gen-tokens", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    shortest, longest = map(int, args.doc_tokens.split(","))
    rng = np.random.default_rng(0)
    vocab = ModelLayout(args.model).config.vocab_size
    docs = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(shortest, longest + 1, args.docs)]
    prompt_tokens = sum(map(len, docs))
    settings = {"expanded again each cut": 0, "kept": model_module.EXPANDED_MLA_KEEP_BYTES}
    seconds, first = {name: [] for name in settings}, None
    for _ in range(args.repeat):
        for name, keep_bytes in settings.items():
            took, outputs = one_sweep(args.model, docs, args.gen_tokens, keep_bytes, args.threads)
            first = outputs if first is None else first
            seconds[name].append(took)
            print(f"{name}: {took:.2f} s, {prompt_tokens / took:.1f} prompt tok/s, "
                  f"{'the same bits' if outputs == first else 'OTHER BITS'}", flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"{args.docs} documents, {prompt_tokens} prompt tokens; medians: " +
          ", ".join(f"{name} {s:.2f} s" for name, s in medians.items()) +
          f"; kept is {medians['expanded again each cut'] / medians['kept']:.2f}x")
    out = BENCH / "out" / "kept_expansions.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": str(args.model), "docs": args.docs, "prompt_tokens": prompt_tokens,
                               "seconds": seconds, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
