"""The KV cache: preallocated for `ctx` positions, stored as f32, f16 or q8_0.

A layer's cache holds named streams of fixed width per position: `k` and `v` (flattened
over KV heads) for ordinary attention, or MLA's `kv`: the compressed latent followed by the
shared rotary key. q8_0 stores blocks of 32 values as int8 with one f16 scale, as
GGML's Q8_0 does: about half the bytes of f16, nearly lossless. f32 is for exactness checks against a float32 reference.
"""

from __future__ import annotations

import numpy as np

KV_KINDS = ("f32", "f16", "q8_0")
FLOAT_KINDS = {"f32": np.float32, "f16": np.float16}
Q8_BLOCK = 32


class ContextOverflow(Exception):
    """More positions than the cache was allocated for."""


def kv_bytes(n_layers: int, ctx: int, widths: dict[str, int], kind: str) -> int:
    """Bytes the cache will take: f32 4, f16 2 bytes a value, q8_0 34 bytes per 32 values."""
    per_position = sum(widths.values())
    per_value = {"f32": 4.0, "f16": 2.0, "q8_0": (Q8_BLOCK + 2) / Q8_BLOCK}[kind]
    return int(n_layers * ctx * per_position * per_value)


class KVCache:
    def __init__(self, n_layers: int, ctx: int, widths: dict[str, int], kind: str = "f16"):
        if kind not in KV_KINDS:
            raise ValueError(f"--kv-quant must be one of {', '.join(KV_KINDS)}, not {kind!r}")
        if kind == "q8_0" and any(w % Q8_BLOCK for w in widths.values()):
            raise ValueError(f"q8_0 KV cache needs widths that are multiples of {Q8_BLOCK}: {widths}")
        self.ctx, self.kind, self.widths = ctx, kind, dict(widths)
        self.length = 0  # positions filled (the same in every layer once a forward pass ends)
        if kind in FLOAT_KINDS:
            self.values = [{n: np.zeros((ctx, w), FLOAT_KINDS[kind]) for n, w in widths.items()} for _ in range(n_layers)]
        else:
            self.values = [{n: np.zeros((ctx, w), np.int8) for n, w in widths.items()} for _ in range(n_layers)]
            self.scales = [{n: np.zeros((ctx, w // Q8_BLOCK), np.float16) for n, w in widths.items()} for _ in range(n_layers)]

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for layer in self.values for a in layer.values())
        if self.kind == "q8_0":
            total += sum(a.nbytes for layer in self.scales for a in layer.values())
        return total

    def check_room(self, start: int, count: int) -> None:
        if start + count > self.ctx:
            raise ContextOverflow(f"context full: {start} + {count} tokens exceed --ctx {self.ctx}")

    def write(self, layer: int, name: str, start: int, values: np.ndarray) -> None:
        """Store values [n, width] at positions start..start+n-1."""
        n = values.shape[0]
        self.check_room(start, n)
        if self.kind in FLOAT_KINDS:
            self.values[layer][name][start : start + n] = values
            return
        blocks = values.reshape(n, -1, Q8_BLOCK)
        scale = (np.abs(blocks).max(axis=2) / 127.0).astype(np.float16)
        inverse = np.divide(1.0, scale.astype(np.float32), out=np.zeros(scale.shape, np.float32), where=scale != 0)
        self.values[layer][name][start : start + n] = np.round(blocks * inverse[:, :, None]).reshape(n, -1).astype(np.int8)
        self.scales[layer][name][start : start + n] = scale

    def stored(self, layer: int, name: str, end: int) -> np.ndarray:
        """Positions 0..end-1 as `kernels.attention` takes them, without a copy when it can:
        f32 as float32, f16 as its bits (uint16); q8_0 is dequantized to float32."""
        if self.kind == "f16":
            return self.values[layer][name][:end].view(np.uint16)
        return self.read(layer, name, end)

    def read(self, layer: int, name: str, end: int) -> np.ndarray:
        """Positions 0..end-1 as float32 [end, width]."""
        if self.kind in FLOAT_KINDS:
            return self.values[layer][name][:end].astype(np.float32, copy=False)
        q = self.values[layer][name][:end].reshape(end, -1, Q8_BLOCK).astype(np.float32)
        return (q * self.scales[layer][name][:end].astype(np.float32)[:, :, None]).reshape(end, -1)
