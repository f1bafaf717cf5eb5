#!/usr/bin/env python
"""RAM one sequence's cache takes, at given contexts, for release configs colibri cannot hold
here: what `plan` and the RAM budget count (`runtime.model.Decoder.cache_shape_for`).

    python bench/cache_size.py [--ctx 4096,131072,1048576] [--json]

DeepSeek-V4-Flash's config.json values (a snapshot of the hub file; every field agrees with
transformers' defaults): 43 layers, `compress_ratios` [0, 0] + [4, 128] × 20 + [4], window 128,
one key-value head of 512, indexer keys of 128. Llama-4-Scout and -Maverick (their text_config):
48 layers of 8 key-value heads of 128, three in four chunked to 8192 positions. Kimi-Linear-48B-A3B:
27 layers, 7 of them MLA (a latent of 512 and a shared key of 64 a position), 20 KDA (32 heads of
128: a fixed state). MiniMax-M3 (its text_config: transformers' MiniMaxM3VLTextConfig defaults, a
context of 1048576): 60 layers of 4 key-value heads of 128, the 57 after the 3 dense ones with
block-sparse attention and index keys of 128 a position. GLM-5-Next (its text_config as
docs/glm5_next.md lists it): 45 layers, 34 KDA (64 heads of 128: a fixed state) and 11 MLA (a
latent of 512 a position, nothing rotated) with indexers of pools of 4 (a key and a gate of 128 a
position, one key of 128 a pool).
"""

from __future__ import annotations

import argparse
import json

from colibri.convert.arch import adapter_for
from colibri.convert.arch.base import normalized_config
from colibri.runtime.kv_cache import KV_KINDS
from colibri.runtime.model import Decoder

CONFIGS = {
    "DeepSeek-V4-Flash": {
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "q_lora_rank": 1024, "qk_rope_head_dim": 64, "num_experts_per_tok": 6, "n_routed_experts": 256,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 3, "swiglu_limit": 10.0,
        "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
    },
    "Llama-4-Scout": {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192, "max_position_embeddings": 10485760, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192}, "use_qk_norm": True, "rms_norm_eps": 1e-5,
    },
    "Llama-4-Maverick": {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8192, "max_position_embeddings": 1048576, "rope_theta": 500000.0,
        "use_qk_norm": False, "rms_norm_eps": 1e-5,
    },
    "Kimi-Linear-48B-A3B": {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446, "model_max_length": 1048576, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "short_conv_kernel_size": 4},
    },
    "MiniMax-M3": {
        "model_type": "minimax_m3_vl_text", "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072,
        "dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "num_hidden_layers": 60,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_local_experts": 128,
        "num_experts_per_tok": 4, "routed_scaling_factor": 2.0, "max_position_embeddings": 1048576,
        "rope_theta": 5000000, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6, "moe_layer_freq": [0] * 3 + [1] * 57,
        "sparse_attention_config": {"sparse_attention_freq": [0] * 3 + [1] * 57, "sparse_num_index_heads": 4,
                                    "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                    "sparse_local_block": 1},
    },
    "GLM-5-Next": {
        "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 288, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "v_head_dim": 256,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 4, "first_k_dense_replace": 3,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
        "swiglu_limit": 10.0, "num_nextn_predict_layers": 1,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", default="4096,131072,1048576", help="contexts, comma-separated (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    contexts = [int(c) for c in args.ctx.split(",")]
    rows = []
    for name, hf in CONFIGS.items():
        shape = Decoder.cache_shape_for(normalized_config(adapter_for(hf), hf))
        for ctx in contexts:
            rows.append({"model": name, "ctx": ctx, **{kind: shape.nbytes(ctx, kind) for kind in KV_KINDS}})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'model':20s} {'ctx':>9s} " + " ".join(f"{kind:>10s}" for kind in KV_KINDS) + "   (GiB a sequence)")
    for row in rows:
        print(f"{row['model']:20s} {row['ctx']:9d} " + " ".join(f"{row[kind] / 2**30:10.3f}" for kind in KV_KINDS))


if __name__ == "__main__":
    main()
