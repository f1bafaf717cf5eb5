"""The value definition: every tensor's float32 values from its name and the seed.

The stream of a tensor part named ``n`` is the concatenation over ``k = 0, 1, ...`` of
``Generator(PCG64(SeedSequence([seed, *blake2b(n), k]))).standard_normal(CHUNK)``,
scaled by the tensor's ``std`` and shifted by its ``mean``; a tensor is its parts'
streams concatenated (stable: tests and benchmark stamps rely on it).
"""

from __future__ import annotations

import hashlib

import numpy as np

from colibri.convert.synthetic.storage import (
    bf16_bits_to_float32, float32_to_bf16_bits, fp8_e4m3_to_float32, fp8_quantize_tensor,
)

#: elements per independently seeded random sub-stream (part of the value definition)
CHUNK = 1 << 20


def name_key(seed: int, name: str) -> list[int]:
    h = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    return [int(seed)] + [int.from_bytes(h[i : i + 4], "little") for i in range(0, 16, 4)]


def normal_chunk(key: list[int], k: int, n: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key + [k])))
    return rng.standard_normal(n, dtype=np.float32)


def part_range(seed: int, name: str, total: int, start: int, stop: int) -> np.ndarray:
    """Standard normal values [start, stop) of the stream of part ``name`` (``total`` long)."""
    key = name_key(seed, name)
    out = []
    k0, k1 = start // CHUNK, (stop - 1) // CHUNK
    for k in range(k0, k1 + 1):
        base = k * CHUNK
        z = normal_chunk(key, k, min(CHUNK, total - base))
        out.append(z[max(start - base, 0) : stop - base])
    return out[0] if len(out) == 1 else np.concatenate(out)


def affine(z: np.ndarray, spec) -> np.ndarray:
    """``z`` scaled by ``spec.std`` and shifted by ``spec.mean``, in place."""
    if spec.std != 1.0:
        z *= np.float32(spec.std)
    if spec.mean:
        z += np.float32(spec.mean)
    return z


def table_values(spec, seed: int = 0) -> np.ndarray:
    """A ``table`` tensor's int64 rows: each the ``spec.shape[1]`` distinct ids of 0..choices-1
    whose normal values are largest."""
    rows, k = spec.shape
    z = part_range(seed, spec.name, rows * spec.choices, 0, rows * spec.choices).reshape(rows, spec.choices)
    return np.argsort(-z, axis=1, kind="stable")[:, :k].astype(np.int64)


def tensor_values(spec, seed: int = 0) -> np.ndarray:
    """Float32 values of a (non scale_inv) tensor before storage rounding/quantisation."""
    if spec.kind == "table":
        return table_values(spec, seed).astype(np.float32)
    if spec.kind == "scale_inv":
        raise ValueError("scale_inv tensors are derived from their weight; use stored_values")
    part_len = spec.numel // len(spec.parts)
    z = np.concatenate([part_range(seed, p, part_len, 0, part_len) for p in spec.parts])
    return affine(z, spec).reshape(spec.shape)


def stored_values(spec, seed: int = 0, plan: list | None = None) -> np.ndarray:
    """What a correct reader decodes from the file for ``spec`` (float32).

    bf16/f16 rounding and FP8 quantisation applied; for FP8 weights this is the raw e4m3
    value (multiply by the scale_inv blocks to dequantise); for ``scale_inv`` the block
    scales (``plan`` is then needed to find the source weight).
    """
    if spec.kind == "scale_inv":
        if plan is None:
            raise ValueError("stored_values of a scale_inv tensor needs the plan")
        src = next(s for s in plan if s.name == spec.source)
        _, scales = fp8_quantize_tensor(tensor_values(src, seed))
        return scales
    x = tensor_values(spec, seed)
    if spec.dtype == "F32":
        return x
    if spec.dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    if spec.dtype == "BF16":
        return bf16_bits_to_float32(float32_to_bf16_bits(x))
    codes, _ = fp8_quantize_tensor(x)
    return fp8_e4m3_to_float32(codes)
