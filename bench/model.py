#!/usr/bin/env python
"""Write the benchmark MoE checkpoint (hub layout, deterministic random bf16 weights).

    python bench/model.py OUT [--shape mixtral-ref|qwen3-ref|qwen3-128|deepseek-v4-slice|deepseek-v3-slice] [--seed 0] [--force]

``mixtral-ref``: Mixtral architecture, hidden 2048, expert FFN 1024, 32 experts, top-4,
16 layers, 16 heads / 4 KV heads, vocab 32000, rope theta 1e6, untied head, bf16,
weights N(0, 0.02), routers N(0, 2/sqrt(hidden)) -- 3.52 B parameters, ~7.0 GB.
``qwen3-ref``: Qwen3-MoE with more, smaller experts: hidden 2048, expert FFN 768,
64 experts, top-8, 12 layers, 16 heads / 4 KV heads of dim 128, vocab 32000 -- 3.88 B
parameters, ~7.8 GB. ``qwen3-128``: Qwen3-30B-A3B's layer (128 experts of FFN 768, top-8)
in 6 layers, otherwise as ``qwen3-ref`` -- ~3.7 B parameters, ~7.4 GB. ``deepseek-v4-slice``:
DeepSeek-V4-Flash's real widths (hidden 4096, 64 heads of 512, query LoRA 1024, 8 output groups of
1024, indexer 64 x 128 keeping 512, window 128, experts of FFN 2048, top-6 and one shared, vocab
129280) in 4 layers (window, CSA, HCA, CSA; the first hash-routed) of 16 experts -- ~3.3 B
parameters, ~6.6 GB. ``deepseek-v3-slice``: DeepSeek-V3's real widths (hidden 7168, 128 MLA heads,
query LoRA 1536, latent 512, a dense first layer of FFN 18432, experts of FFN 2048, top-8 in 8 groups
keeping 4, one shared, vocab 129280) in 4 layers of 16 experts -- ~5.2 B parameters, ~10.4 GB.

Nothing is written when OUT already holds a complete checkpoint made with the same
parameters (recorded in ``OUT/.colibri-bench.json``, written last).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import resource
import sys
import time

from colibri.convert import synthetic

STAMP = ".colibri-bench.json"

SHAPES = {
    "mixtral-ref": {
        "arch": "mixtral",
        "config": {
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
        },
    },
    "qwen3-ref": {
        "arch": "qwen3_moe",
        "config": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 12,
            "max_window_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 32000,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    },
    "qwen3-128": {"arch": "qwen3_moe", "config": None},  # qwen3-ref's, with the changes below
    "deepseek-v4-slice": {
        "arch": "deepseek_v4",
        "config": {
            "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
            "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
            "sliding_window": 128, "moe_intermediate_size": 2048, "n_routed_experts": 16, "num_experts_per_tok": 6,
            "n_shared_experts": 1, "vocab_size": 129280, "num_hidden_layers": 4, "num_hash_layers": 1,
            "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        },
    },
    "deepseek-v3-slice": {
        "arch": "deepseek_v3",
        "config": {
            "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 16, "num_experts_per_tok": 8,
            "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1, "num_hidden_layers": 4,
            "num_nextn_predict_layers": 0, "vocab_size": 129280,
        },
    },
}
SHAPES["qwen3-128"]["config"] = {**SHAPES["qwen3-ref"]["config"], "num_experts": 128, "num_hidden_layers": 6,
                                 "max_window_layers": 6}
DTYPE = "bf16"
INIT_STD = 0.02


def _params(shape: str, seed: int) -> dict:
    spec = SHAPES[shape]
    hidden = spec["config"]["hidden_size"]
    return {
        "shape": shape,
        "arch": spec["arch"],
        "config": spec["config"],
        "dtype": DTYPE,
        "seed": seed,
        "init_std": INIT_STD,
        "router_std": 2.0 / math.sqrt(hidden),
        "generator_version": synthetic.GENERATOR_VERSION,
    }


def _weight_files(out: pathlib.Path) -> dict[str, int]:
    names = [p.name for p in out.glob("*.safetensors")] + [
        n for n in ("model.safetensors.index.json", "config.json", "tokenizer.json") if (out / n).exists()
    ]
    return {n: (out / n).stat().st_size for n in sorted(names)}


def is_complete(out: pathlib.Path, params: dict) -> bool:
    """True when ``out`` holds the checkpoint of ``params`` in full."""
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        rec = json.loads(stamp.read_text())
    except ValueError:
        return False
    if rec.get("params") != json.loads(json.dumps(params)):
        return False
    files = rec.get("files") or {}
    return bool(files) and all((out / n).is_file() and (out / n).stat().st_size == s for n, s in files.items())


def build(out: pathlib.Path, shape: str = "mixtral-ref", seed: int = 0, force: bool = False) -> bool:
    """Write the checkpoint unless it is already there; returns True when written."""
    params = _params(shape, seed)
    if not force and is_complete(out, params):
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    config = synthetic.tiny_config(params["arch"], **params["config"])
    synthetic.write_checkpoint(
        out,
        params["arch"],
        config=config,
        dtype=params["dtype"],
        seed=seed,
        init_std=params["init_std"],
        router_std=params["router_std"],
    )
    files = _weight_files(out)
    (out / STAMP).write_text(json.dumps({"params": params, "files": files}, indent=2) + "\n")
    return True


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=pathlib.Path, help="output folder")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-ref")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite even if a complete checkpoint is there")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    written = build(args.out, args.shape, args.seed, args.force)
    dt = time.perf_counter() - t0
    params = _params(args.shape, args.seed)
    config = synthetic.tiny_config(params["arch"], **params["config"])
    n_params = sum(s.numel for s in synthetic.checkpoint_plan(params["arch"], config, dtype=DTYPE))
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    state = "written" if written else "already complete, skipped"
    print(
        f"{args.shape}: {state} in {dt:.1f} s -> {args.out} "
        f"({n_params / 1e9:.2f} B params, {size / 1e9:.2f} GB safetensors, peak RSS {_peak_rss_mb():.0f} MB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
