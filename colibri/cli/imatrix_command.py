"""`colibri imatrix MODEL --text FILE -o OUT.gguf`: an importance matrix from our runtime.

The text is tokenized and cut into chunks of `--chunk` tokens (the first of each replaced by
BOS where the model has one, as llama-imatrix does); each chunk runs from an empty context,
every matrix adding the squares of its inputs (`runtime/imatrix_collect.py`). The perplexity of the
second half of each chunk is reported as llama-imatrix reports it. OUT is rewritten every
`--save-every` chunks and at the end, each time whole (a crash keeps the last one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from colibri.runtime.options import add_engine_flags, engine_options, option_names
from colibri.runtime.text import read_text_file

IMATRIX_OPTIONS = option_names("ctx", "parallel")  # one sequence, of --chunk positions


class ImatrixInputError(ValueError):
    """A text or an option the command cannot use; the message is one line naming it."""


def add_imatrix_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a converted model folder")
    p.add_argument("--text", type=Path, required=True, metavar="FILE", help="UTF-8 text to run (calibration data)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                   help="the importance matrix to write (llama-imatrix's GGUF format)")
    p.add_argument("--chunk", type=int, default=512, metavar="N", help="tokens per chunk (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, metavar="K", help="run at most K chunks (default: all the text holds)")
    p.add_argument("--save-every", type=int, default=10, metavar="K",
                   help="rewrite OUT every K chunks, so that a crash loses at most K (default: %(default)s)")
    add_engine_flags(p, IMATRIX_OPTIONS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def read_chunks(tokenizer, path: Path, chunk: int, limit: int | None) -> list[list[int]]:
    """The text of `path` as chunks of `chunk` token ids, BOS first where the model has one."""
    if chunk < 2:
        raise ImatrixInputError(f"--chunk {chunk}: a chunk needs at least 2 tokens")
    ids = tokenizer.encode(read_text_file(path, ImatrixInputError), add_bos=False)
    count = len(ids) // chunk if limit is None else min(len(ids) // chunk, limit)
    if count < 1:
        raise ImatrixInputError(f"{path}: {len(ids)} tokens, fewer than one chunk of --chunk {chunk}")
    chunks = [ids[i * chunk:(i + 1) * chunk] for i in range(count)]
    if tokenizer.bos_id is not None:
        for c in chunks:
            c[0] = tokenizer.bos_id
    return chunks


def second_half_nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of a chunk's last len/2 − 1 tokens, each predicted from the
    position before it (llama-imatrix's and llama-perplexity's), and how many."""
    first = len(ids) // 2
    rows = logits[first:len(ids) - 1].astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    targets = np.asarray(ids[first + 1:])
    return float((log_norm - rows[np.arange(len(targets)), targets]).sum()), len(targets)


def imatrix_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from colibri.runtime import open_model
    from colibri.runtime.imatrix_collect import ActivationSums

    if args.save_every < 1:
        raise ImatrixInputError(f"--save-every {args.save_every}: must be at least 1")
    started = time.perf_counter()
    model = open_model(args.model, engine_options(args, "imatrix", ctx=max(args.chunk, 2)))
    try:
        chunks = read_chunks(model.tokenizer, args.text, args.chunk, args.chunks)
        sums = ActivationSums()
        sums.attach(model)
        nll, scored = 0.0, 0
        bar = tqdm(chunks, desc="imatrix", unit="chunk", disable=args.no_progress or args.json, file=sys.stderr)
        for done, ids in enumerate(bar, 1):
            model.reset()
            chunk_nll, count = second_half_nll(model.prefill(ids), ids)
            nll, scored = nll + chunk_nll, scored + count
            bar.set_postfix(ppl=f"{np.exp(nll / scored):.3f}")
            if done % args.save_every == 0 or done == len(chunks):
                sums.write(args.output, [args.text.name], done, args.chunk)
    finally:
        model.close()
    summary = {"output": str(args.output), "chunks": len(chunks), "chunk_size": args.chunk,
               "tokens": len(chunks) * args.chunk, "perplexity": float(np.exp(nll / scored)), "entries": len(sums.sums),
               "seconds": round(time.perf_counter() - started, 2)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['output']}: {summary['entries']} tensors from {summary['chunks']} chunks of {args.chunk} tokens; "
              f"perplexity of their second halves {summary['perplexity']:.4f} ({summary['seconds']} s)")
    return 0
