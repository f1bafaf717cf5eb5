"""Rotary position embeddings: frequency tables (plain and YaRN) and their application.

Frequencies follow transformers' `modeling_rope_utils` (`_compute_default_rope_parameters`,
`_compute_yarn_parameters`, `_compute_llama3_parameters`), so positions rotate exactly as in the reference models.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from colibri.formats.model_config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `scale` times (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [rope_dim / 2], attention factor applied to cos/sin)."""
    dim, base = config.rope_dim, config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(base) ** exponents
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if kind == "llama3":
        return llama3_frequencies(1.0 / pos_freqs, scaling), 1.0
    if kind == "factors":  # llama.cpp's rope_freqs: each frequency divided by its factor
        return ((1.0 / pos_freqs) / np.asarray(scaling["factors"], np.float32)).astype(np.float32), 1.0
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, yarn, llama3, factors)")
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def llama3_frequencies(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """inv_freq stretched as transformers' `_compute_llama3_parameters` does it (float32)."""
    factor, low, high = (np.float32(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = np.float32(scaling["original_max_position_embeddings"])
    inv_freq = inv_freq.astype(np.float32)
    wavelen = np.float32(2 * math.pi) / inv_freq
    stretched = np.where(wavelen > original / low, inv_freq / factor, inv_freq).astype(np.float32)
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    if high > low:
        smooth = (original / wavelen[medium] - low) / (high - low)
        stretched[medium] = (1 - smooth) * stretched[medium] / factor + smooth * stretched[medium]
    return stretched.astype(np.float32)


class RopeTable(NamedTuple):
    """What the rotation kernel takes: cos and sin [ctx, dim / 2] of each position's angles,
    the rotated features `dim`, and whether pairs are interleaved."""

    cos: np.ndarray
    sin: np.ndarray
    dim: int
    interleaved: bool


class Rope:
    """cos/sin tables for positions 0..ctx-1 and the rotation of q/k heads."""

    def __init__(self, config: ModelConfig, ctx: int):
        inv_freq, attention_factor = inverse_frequencies(config)
        angles = np.arange(ctx, dtype=np.float32)[:, None] * inv_freq[None, :]
        self.cos = (np.cos(angles) * np.float32(attention_factor)).astype(np.float32)  # [ctx, dim/2]
        self.sin = (np.sin(angles) * np.float32(attention_factor)).astype(np.float32)
        self.dim = config.rope_dim
        self.interleaved = config.rope_interleaved
        self.table = RopeTable(self.cos, self.sin, self.dim, self.interleaved)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate the first `dim` features of x [n, heads, width] at `positions` [n]; rest unchanged."""
        return rotated(x, self.table, positions)


def rotated(x: np.ndarray, table: RopeTable, positions: np.ndarray) -> np.ndarray:
    """x [n, heads, width] with its first `table.dim` features rotated at `positions` [n]."""
    out = np.empty(x.shape, np.float32)
    rotate_into(x, table, np.asarray(positions, dtype=np.int64), out)
    return out


@njit(cache=True, nogil=True)
def rotate_into(x, table, positions, out):
    """out = x with the pairs of its first `table.dim` features rotated by each position's
    angles: features (2j, 2j + 1) when interleaved, else (j, j + dim / 2). out may be x."""
    cos, sin, interleaved, half = table.cos, table.sin, table.interleaved, table.dim // 2
    for i in range(x.shape[0]):
        c, s = cos[positions[i]], sin[positions[i]]
        for h in range(x.shape[1]):
            source, target = x[i, h], out[i, h]
            target[:] = source
            for j in range(half):
                first, second = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                a, b = source[first], source[second]
                target[first] = a * c[j] - b * s[j]
                target[second] = b * c[j] + a * s[j]
