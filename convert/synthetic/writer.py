"""Writing a synthetic checkpoint: safetensors written by hand, tensor by tensor and chunk
by chunk (bounded memory, ``workers`` threads), sharded and indexed as on the hub."""

from __future__ import annotations

import json
import os
import pathlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from colibri.convert.synthetic.configs import resolve_config
from colibri.convert.synthetic.tensor_plan import DTYPES, TensorSpec, checkpoint_plan
from colibri.convert.synthetic.storage import bf16_round_inplace, fp8_quantize_2d
from colibri.convert.synthetic.tokenizer import write_tokenizer_files
from colibri.convert.synthetic.values import CHUNK, affine, name_key, normal_chunk, part_range, table_values
from colibri.formats.checkpoint import FP8_BLOCK

#: default cap of one safetensors shard when a checkpoint is too big for ``shards`` files
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


def _assign_shards(specs: list[TensorSpec], shards: int, max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    total = sum(s.nbytes for s in specs)
    cap = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else int(max_shard_bytes)
    n = max(1, min(int(shards), len(specs)))
    if max_shard_bytes is None and total <= n * cap:
        # balanced split into ``shards`` files by cumulative size
        target = total / n
        groups: list[list[TensorSpec]] = [[] for _ in range(n)]
        cum = 0
        for s in specs:
            idx = min(n - 1, int((cum + s.nbytes / 2) / target)) if target else 0
            groups[idx].append(s)
            cum += s.nbytes
        return [g for g in groups if g]
    # greedy, every shard at most ``cap`` bytes (a single larger tensor gets its own)
    groups, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > cap:
            groups.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        groups.append(cur)
    return groups


def _header_bytes(group: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in group:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _encode_plain(z: np.ndarray, spec: TensorSpec) -> np.ndarray:
    z = affine(z, spec)
    if spec.dtype == "F32":
        return z
    if spec.dtype == "F16":
        return z.astype(np.float16)
    u = z.view(np.uint32)
    bf16_round_inplace(u)
    return u.astype(np.uint16)


class _Writer:
    def __init__(self, seed: int, workers: int):
        self.seed = int(seed)
        self.workers = max(1, int(workers))
        self.pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None
        self.scales: dict[str, np.ndarray] = {}

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()

    def _map_ordered(self, fn, items):
        """fn over items, results in order; bounded number in flight."""
        if self.pool is None or len(items) <= 1:
            for it in items:
                yield fn(it)
            return
        window: deque = deque()
        it = iter(items)
        for item in it:
            window.append(self.pool.submit(fn, item))
            if len(window) >= 2 * self.workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def write_tensor(self, f, spec: TensorSpec) -> None:
        if spec.kind == "scale_inv":
            scales = self.scales.pop(spec.source)
            assert scales.shape == spec.shape, (scales.shape, spec.shape)
            f.write(np.ascontiguousarray(scales, dtype="<f4").tobytes())
            return
        if spec.kind == "table":
            f.write(np.ascontiguousarray(table_values(spec, self.seed), dtype="<i8").tobytes())
            return
        part_len = spec.numel // len(spec.parts)
        if spec.dtype == "F8_E4M3":
            self._write_fp8(f, spec, part_len)
            return
        jobs = []
        for p in spec.parts:
            key = name_key(self.seed, p)
            for k in range(-(-part_len // CHUNK)):
                jobs.append((key, k, min(CHUNK, part_len - k * CHUNK)))

        def work(job):
            key, k, n = job
            return _encode_plain(normal_chunk(key, k, n), spec)

        for arr in self._map_ordered(work, jobs):
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))

    def _write_fp8(self, f, spec: TensorSpec, part_len: int) -> None:
        # matrices: 2-D weight -> itself; fused [E, R, C] -> E matrices, each made of
        # len(parts)/E consecutive parts
        if len(spec.shape) == 2:
            mats, (rows, cols) = 1, spec.shape
        else:
            mats, rows, cols = spec.shape
        parts_per_mat = len(spec.parts) // mats
        rows_per_part = rows // parts_per_mat
        # jobs of whole 128-row blocks, about CHUNK elements each (fewer regenerated chunks)
        step = FP8_BLOCK * max(1, CHUNK // (cols * FP8_BLOCK))
        jobs = []
        for m in range(mats):
            for r0 in range(0, rows, step):
                jobs.append((m, r0, min(rows, r0 + step)))

        def work(job):
            m, r0, r1 = job
            pieces = []
            r = r0
            while r < r1:  # a row block may straddle two parts (e.g. gate/up of one expert)
                pi, pr = divmod(r, rows_per_part)
                take = min(r1 - r, rows_per_part - pr)
                name = spec.parts[m * parts_per_mat + pi]
                pieces.append(part_range(self.seed, name, part_len, pr * cols, (pr + take) * cols))
                r += take
            x = affine(pieces[0] if len(pieces) == 1 else np.concatenate(pieces), spec).reshape(r1 - r0, cols)
            return fp8_quantize_2d(x)

        scale_rows = []
        for codes, scale in self._map_ordered(work, jobs):
            f.write(memoryview(np.ascontiguousarray(codes)).cast("B"))
            scale_rows.append(scale)
        scales = np.concatenate(scale_rows, axis=0)
        if mats > 1:
            scales = scales.reshape(mats, -1, scales.shape[-1])
        self.scales[spec.name] = scales


def _clear_weights(out: pathlib.Path) -> None:
    stale = list(out.glob("model*.safetensors")) + list(out.glob("model*.safetensors.partial"))
    for p in stale + [out / "model.safetensors.index.json"]:
        if p.is_file():
            p.unlink()


def write_checkpoint(
    out_dir,
    arch: str,
    *,
    config: dict | None = None,
    dtype: str = "bf16",
    fused_experts: bool = False,
    shards: int = 2,
    seed: int = 0,
    init_std: float = 0.02,
    router_std: float | None = None,
    max_shard_bytes: int | None = None,
    workers: int | None = None,
) -> pathlib.Path:
    """Write a hub-layout checkpoint of ``arch`` with deterministic random weights.

    ``dtype``: ``f32``, ``f16``, ``bf16`` or ``fp8`` (DeepSeek-V3 style block FP8 for the
    linear weights, bf16 elsewhere, ``quantization_config`` in config.json).
    ``fused_experts``: experts as ``experts.gate_up_proj`` [E, 2I, D] /
    ``experts.down_proj`` [E, D, I] (transformers-v5 in-memory layout) instead of
    per-expert tensors.  ``shards`` files (balanced by size) unless that would exceed
    ``max_shard_bytes`` (default 2 GB) per file, or when ``max_shard_bytes`` is given,
    then greedy packing.  A single shard is written as ``model.safetensors`` without an
    index, like the hub.  Memory stays bounded: tensors are generated and written chunk
    by chunk (``workers`` threads, default min(4, cpu count)).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if seed < 0:
        raise ValueError("seed must be non-negative")
    cfg = resolve_config(arch, config)
    torch_dtype = DTYPES[dtype][2]
    cfg["torch_dtype"] = torch_dtype
    cfg.pop("dtype", None)
    if dtype == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        cfg.pop("quantization_config", None)
    specs = checkpoint_plan(
        arch, cfg, dtype=dtype, fused_experts=fused_experts, init_std=init_std, router_std=router_std
    )

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n", "utf-8")
    write_tokenizer_files(out, arch, cfg)

    groups = _assign_shards(specs, shards, max_shard_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    writer = _Writer(seed, workers)
    weight_map = {}
    try:
        for fname, group in zip(names, groups):
            tmp = out / (fname + ".partial")
            with open(tmp, "wb") as f:
                f.write(_header_bytes(group))
                for s in group:
                    writer.write_tensor(f, s)
                    weight_map[s.name] = fname
            os.replace(tmp, out / fname)
    finally:
        writer.close()
    if n > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", "utf-8")
    return out
