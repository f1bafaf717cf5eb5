"""`colibri perplexity MODEL --text FILE`: llama-perplexity's figure, and its KL divergence against a base.

The method is llama-perplexity's: the text is tokenized as the model does (a BOS in front where
its tokenizer adds one) and cut into chunks of `--ctx` tokens; each chunk runs from an empty
cache with its first token replaced by BOS (where there is one), and the predictions of its last
`ctx − 1 − ctx/2` tokens are scored: PPL = exp(mean negative log-likelihood) ± its standard
error. `--parallel N` runs N chunks together on the batch engine, each in a KV slot, cut into
steps where the engine cuts prompts; every row is computed as alone, so N changes the speed,
never a bit of the result.

`--save-base FILE` keeps the scored log-probabilities in llama-perplexity's
`--kl-divergence-base` format (`formats/logprob_file.py`); `--kl-base FILE` scores the same
chunks against such a file, ours or llama.cpp's, and prints what `llama-perplexity
--kl-divergence` prints: KL divergence (mean, median, percentiles, max), Δp, same top token,
PPL(Q) / PPL(base).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from colibri.formats.logprob_file import LogProbFile, LogProbFileError, LogProbWriter
from colibri.runtime.batch import STEP_PROMPT_TOKENS
from colibri.runtime.options import add_engine_flags, engine_options, option_names
from colibri.runtime.text import read_text_file

PERPLEXITY_OPTIONS = option_names()
PERCENTILES = (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001)


class PerplexityError(ValueError):
    """A text, base file or option the command cannot use; the message is one line naming it."""


# --- the chunks ----------------------------------------------------------------------------


def text_chunks(tokenizer, path: Path, n_ctx: int, limit: int | None) -> list[list[int]]:
    """The text of `path` as llama-perplexity cuts it: whole chunks of `n_ctx` token ids (as
    tokenized, before any BOS replacement), at most `limit`."""
    if n_ctx < 4:
        raise PerplexityError(f"--ctx {n_ctx}: a chunk needs at least 4 tokens")
    ids = tokenizer.encode(read_text_file(path, PerplexityError))
    if len(ids) < 2 * n_ctx:
        raise PerplexityError(f"{path}: {len(ids)} tokens; scoring chunks of --ctx {n_ctx} needs at least {2 * n_ctx}")
    count = len(ids) // n_ctx if limit is None else min(limit, len(ids) // n_ctx)
    return [ids[i * n_ctx:(i + 1) * n_ctx] for i in range(count)]


def leading_bos(tokenizer) -> int | None:
    """The BOS a chunk starts with: the model's, when its tokenizer puts one in front of a text."""
    bos = tokenizer.bos_id
    return bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None


def scored_logits(model, chunks: list[list[int]], bos: int | None, parallel: int):
    """(chunk index, logits [ctx − 1 − ctx/2, vocab] of its scored positions) of every chunk,
    `parallel` of them through the batch engine together, each in its own KV slot."""
    n_ctx = len(chunks[0])
    first = n_ctx // 2
    slots = model.slots[:parallel]
    for start in range(0, len(chunks), parallel):
        group = [([bos] if bos is not None else chunk[:1]) + chunk[1:] for chunk in chunks[start:start + parallel]]
        for slot in slots:
            slot.length = 0
        kept = [[] for _ in group]
        for at in range(0, n_ctx, STEP_PROMPT_TOKENS):
            step = min(STEP_PROMPT_TOKENS, n_ctx - at)
            wanted = [p - at for p in range(max(at, first), min(at + step, n_ctx - 1))]
            rows = [k * step + p for k in range(len(group)) for p in wanted]
            logits = model.decoder.forward_batch([(ids[at:at + step], slot) for ids, slot in zip(group, slots)], rows)
            for k in range(len(group)):
                kept[k].append(logits[k * len(wanted):(k + 1) * len(wanted)])
        for k, parts in enumerate(kept):
            yield start + k, np.concatenate(parts)


# --- the figures -------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error, as llama-perplexity gives them (0 under 11 values)."""
    mean = float(values.mean())
    variance = float((values ** 2).mean()) - mean * mean
    return mean, math.sqrt(variance / (len(values) - 1)) if variance > 0 and len(values) > 10 else 0.0


class Scores:
    """Negative log-likelihoods of the scored tokens and, against a base, llama-perplexity's
    per-token KL divergence, Δp and top-token agreement."""

    def __init__(self):
        self.nll, self.base_nll, self.kld, self.p_diff, self.same_top = [], [], [], [], []

    def add(self, logits: np.ndarray, targets: np.ndarray, base: np.ndarray | None = None) -> None:
        """One chunk: `logits` [n, vocab] predicting `targets` [n]; `base` [n, vocab] its log-probabilities."""
        logp = log_softmax(logits)
        picked = np.arange(len(targets))
        self.nll.append(-logp[picked, targets])
        if base is None:
            return
        base = base.astype(np.float64)
        self.base_nll.append(-base[picked, targets])
        kept = base > -16.0  # llama.cpp leaves out the base's improbable tokens
        self.kld.append(np.where(kept, np.exp(base) * (base - logp), 0.0).sum(axis=1))
        self.p_diff.append(np.exp(logp[picked, targets]) - np.exp(base[picked, targets]))
        self.same_top.append(logits.argmax(axis=1) == base.argmax(axis=1))

    def ppl(self) -> tuple[float, float]:
        mean, error = mean_and_error(np.concatenate(self.nll))
        return math.exp(mean), math.exp(mean) * error

    def summary(self) -> dict:
        nll = np.concatenate(self.nll)
        ppl, ppl_error = self.ppl()
        out = {"ppl": ppl, "ppl_stderr": ppl_error, "tokens": int(len(nll))}
        if not self.kld:
            return out
        base_nll, kld, p_diff = (np.concatenate(v) for v in (self.base_nll, self.kld, self.p_diff))
        same = np.concatenate(self.same_top)
        base_mean, base_error = mean_and_error(base_nll)
        mean, error = mean_and_error(nll)
        covariance = float((nll * base_nll).mean() - nll.mean() * base_nll.mean()) / (len(nll) - 1) if len(nll) >= 10 else 0.0
        ratio_error = math.sqrt(max(error ** 2 + base_error ** 2 - 2 * covariance, 0.0))
        kld_mean, kld_error = mean_and_error(kld)
        mse, mse_error = mean_and_error(p_diff ** 2)
        top = float(same.mean())
        out.update({
            "ppl_base": math.exp(base_mean), "ppl_base_stderr": math.exp(base_mean) * base_error,
            "ppl_ratio": math.exp(mean - base_mean), "ppl_ratio_stderr": math.exp(mean - base_mean) * ratio_error,
            "kld_mean": kld_mean, "kld_stderr": kld_error, "kld_median": float(np.median(kld)),
            **{f"kld_p{100 * q:g}".replace(".", "_"): float(np.quantile(kld, q)) for q in PERCENTILES},
            "kld_max": float(kld.max()), "kld_min": float(kld.min()),
            "dp_mean": float(p_diff.mean()), "dp_max": float(p_diff.max()), "dp_min": float(p_diff.min()),
            "rms_dp": math.sqrt(mse), "rms_dp_stderr": 0.5 / math.sqrt(mse) * mse_error if mse > 0 else 0.0,
            "same_top_p": top, "same_top_p_stderr": math.sqrt(top * (1 - top) / (len(same) - 1)),
        })
        return out


def perplexity(model, chunks: list[list[int]], parallel: int, base: LogProbFile | None = None,
               save: LogProbWriter | None = None, progress=None) -> dict:
    """Score `chunks` (compare them with `base`, keep their log-probabilities in `save`)."""
    bos = leading_bos(model.tokenizer)
    first = len(chunks[0]) // 2
    scores = Scores()
    for index, logits in scored_logits(model, chunks, bos, parallel):
        targets = np.asarray(chunks[index][first + 1:])
        base_rows = base.rows(index) if base is not None else None
        scores.add(logits, targets, base_rows)
        if save is not None:
            save.add(logits)
        if progress is not None:
            progress(scores)
    return scores.summary()


# --- the command -------------------------------------------------------------------------


def add_perplexity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a converted model folder")
    p.add_argument("--text", type=Path, metavar="FILE", help="UTF-8 text to score (not needed with --kl-base, "
                   "whose file holds its tokens)")
    p.add_argument("--chunks", type=int, default=None, metavar="K", help="score at most K chunks (default: all)")
    p.add_argument("--save-base", type=Path, metavar="FILE",
                   help="keep the log-probabilities, to compare other versions of the model with (--kl-base)")
    p.add_argument("--kl-base", type=Path, metavar="FILE",
                   help="a base's log-probabilities (--save-base here, or llama-perplexity --kl-divergence-base): "
                        "score its chunks and print the KL divergence from it")
    add_engine_flags(p, PERPLEXITY_OPTIONS, ctx=512, parallel=4)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def refuse_other_vocabulary(base: LogProbFile, vocab_size: int, model: str = "the model") -> None:
    """One line, when `base` holds log-probabilities over another vocabulary than `model`'s."""
    if base.n_vocab != vocab_size:
        raise PerplexityError(f"{base.path}: a vocabulary of {base.n_vocab} tokens, {model} has {vocab_size}")


def base_chunks(base: LogProbFile, model, limit: int | None) -> list[list[int]]:
    refuse_other_vocabulary(base, model.config.vocab_size)
    chunks = base.chunks[:limit] if limit else base.chunks
    return [list(map(int, c)) for c in chunks]


def perplexity_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from colibri.runtime import open_model

    if args.text is None and args.kl_base is None:
        raise PerplexityError("--text FILE is needed (or --kl-base FILE, which holds its text's tokens)")
    if args.chunks is not None and args.chunks < 1:
        raise PerplexityError(f"--chunks {args.chunks}: must be at least 1")
    try:
        base = LogProbFile(args.kl_base) if args.kl_base else None
    except LogProbFileError as e:
        raise PerplexityError(str(e)) from None
    ctx = base.n_ctx if base else args.ctx
    started = time.perf_counter()
    model = open_model(args.model, engine_options(args, "perplexity", ctx=ctx))
    save = None
    try:
        chunks = base_chunks(base, model, args.chunks) if base else text_chunks(model.tokenizer, args.text, ctx, args.chunks)
        parallel = min(len(model.slots), len(chunks))
        save = LogProbWriter(args.save_base, ctx, model.config.vocab_size, chunks) if args.save_base else None
        bar = tqdm(total=len(chunks), desc="perplexity", unit="chunk", disable=args.no_progress or args.json, file=sys.stderr)

        def progress(scores: Scores) -> None:
            bar.update(1)
            bar.set_postfix(ppl=f"{scores.ppl()[0]:.4f}")

        result = perplexity(model, chunks, parallel, base, save, progress)
        bar.close()
        if save is not None:
            save.commit()
            save = None
    finally:
        if save is not None:
            save.abort()
        model.close()
    result.update(chunks=len(chunks), ctx=ctx, parallel=parallel, seconds=round(time.perf_counter() - started, 2),
                  text=str(args.text) if args.text else None, kl_base=str(args.kl_base) if args.kl_base else None)
    print(json.dumps(result) if args.json else format_result(result))
    return 0


def format_result(r: dict) -> str:
    lines = [f"{r['chunks']} chunks of {r['ctx']} tokens ({r['tokens']} scored), {r['parallel']} at a time, {r['seconds']} s",
             f"PPL = {r['ppl']:.4f} +/- {r['ppl_stderr']:.5f}"]
    if "kld_mean" in r:
        lines += [
            f"Mean PPL(Q)/PPL(base): {r['ppl_ratio']:.6f} ± {r['ppl_ratio_stderr']:.6f}   PPL(base) {r['ppl_base']:.4f}",
            f"Mean    KLD: {r['kld_mean']:10.6f} ± {r['kld_stderr']:.6f}",
            f"Maximum KLD: {r['kld_max']:10.6f}",
            f"99.9%   KLD: {r['kld_p99_9']:10.6f}",
            f"99.0%   KLD: {r['kld_p99']:10.6f}",
            f"Median  KLD: {r['kld_median']:10.6f}",
            f"RMS Δp    : {100 * r['rms_dp']:6.3f} ± {100 * r['rms_dp_stderr']:.3f} %",
            f"Same top p: {100 * r['same_top_p']:6.3f} ± {100 * r['same_top_p_stderr']:.3f} %",
        ]
    return "\n".join(lines)
