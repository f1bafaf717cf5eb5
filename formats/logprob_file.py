"""Log-probability files: a base model's predictions over a text, kept to compare other versions
of the model against (llama-perplexity's `--kl-divergence-base` format; `formats/spec.md` §11).

Little-endian: the 8 bytes `_logits_`; int32 `n_ctx`, `n_vocab`, `n_chunk`; the chunks' token
ids, int32 [n_chunk × n_ctx], as tokenized (before a chunk's first token is replaced by BOS);
then for each chunk, for each scored position (the `n_ctx − 1 − n_ctx/2` positions from
`n_ctx/2` on, each predicting the token after it), a row of `2·⌈n_vocab/2⌉ + 4` uint16: two
float32, `scale` and `min_log_prob`, then one code per token, log p ≈ scale·code + min_log_prob
(code 0 for a logit more than 16 below the row's largest).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
HEADER = struct.Struct("<8siii")
LOG_RANGE = 16.0  # logits further than this below a row's largest all get code 0
MAX_CTX = 1 << 20
MAX_VOCAB = 1 << 24


class LogProbFileError(ValueError):
    """A file this reader refuses; the message is one line naming it."""


def row_width(n_vocab: int) -> int:
    """uint16 per row: the two float32 in front, then the codes, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def encode_rows(logits: np.ndarray) -> np.ndarray:
    """[rows, n_vocab] float logits as [rows, row_width] uint16 rows (llama.cpp's `log_softmax`)."""
    logits = np.asarray(logits, np.float32)
    rows, n_vocab = logits.shape
    top = logits.max(axis=1, keepdims=True)
    low = np.maximum(logits.min(axis=1, keepdims=True), top - np.float32(LOG_RANGE))
    log_sum = np.log(np.exp(logits - top, dtype=np.float64).sum(axis=1, keepdims=True)).astype(np.float32)
    scale = (top - low) / np.float32(65535)
    out = np.zeros((rows, row_width(n_vocab)), np.uint16)
    head = np.concatenate([scale, low - top - log_sum], axis=1).astype(np.float32)
    out[:, :4] = head.view(np.uint16)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.rint((logits - low) * (np.float32(1) / safe))
    out[:, 4:4 + n_vocab] = np.where((logits > low) & (scale > 0), codes, 0).astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """[rows, n_vocab] float32 log-probabilities of encoded rows."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    return head[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float32) + head[:, 1:2]


class LogProbWriter:
    """Writes a file chunk by chunk to `<path>.partial`; `commit` renames it into place."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, chunks: list[list[int]]):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.n_vocab, self.expected = n_vocab, len(chunks)
        self.file = open(self.partial, "wb")
        self.file.write(HEADER.pack(MAGIC, n_ctx, n_vocab, len(chunks)))
        self.file.write(np.asarray(chunks, "<i4").tobytes())
        self.written = 0

    def add(self, logits: np.ndarray) -> None:
        """One chunk's scored rows of logits, in order."""
        self.file.write(encode_rows(logits).astype("<u2").tobytes())
        self.written += 1

    def commit(self) -> None:
        if self.written != self.expected:
            raise ValueError(f"{self.path}: {self.written} chunks written of {self.expected}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


class LogProbFile:
    """A file opened for reading: `n_ctx`, `n_vocab`, `chunks` (token ids), and `rows(i)`, the
    log-probabilities of chunk i's scored positions. Every size is checked against the file's
    length before anything is read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError as e:
            raise LogProbFileError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise LogProbFileError(f"{self.path}: not a log-probability file (no {MAGIC.decode()} header)")
        _, self.n_ctx, self.n_vocab, n_chunk = HEADER.unpack(head)
        if not (4 <= self.n_ctx <= MAX_CTX and 2 <= self.n_vocab <= MAX_VOCAB and n_chunk >= 1):
            raise LogProbFileError(f"{self.path}: n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, n_chunk {n_chunk} "
                                   f"out of range")
        self.row_bytes = 2 * row_width(self.n_vocab)
        self.chunk_bytes = scored_positions(self.n_ctx) * self.row_bytes
        self.data_offset = HEADER.size + 4 * n_chunk * self.n_ctx
        expected = self.data_offset + n_chunk * self.chunk_bytes
        if size != expected:
            raise LogProbFileError(f"{self.path}: {size} bytes, its header implies {expected}")
        tokens = np.fromfile(self.path, "<i4", n_chunk * self.n_ctx, offset=HEADER.size)
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise LogProbFileError(f"{self.path}: token ids outside its {self.n_vocab}-token vocabulary")
        self.chunks = tokens.reshape(n_chunk, self.n_ctx)

    def rows(self, chunk: int) -> np.ndarray:
        """[scored positions, n_vocab] float32 log-probabilities of one chunk."""
        raw = np.fromfile(self.path, "<u2", self.chunk_bytes // 2, offset=self.data_offset + chunk * self.chunk_bytes)
        return decode_rows(raw.reshape(-1, self.row_bytes // 2), self.n_vocab)
