"""Qwen2-MoE (sigmoid-gated shared expert, qkv bias) and Qwen3-MoE (per-head q/k norm)."""

import gguf

from colibri.convert.arch.base import Adapter, common_fields, require
from colibri.formats.model_config import ModelConfig


def sparse_layers(hf: dict, n_layers: int) -> list[int]:
    """Qwen's rule: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


class Qwen2Moe(Adapter):
    model_types = ("qwen2_moe",)
    gguf_arch = gguf.MODEL_ARCH.QWEN2MOE
    shared_block = "shared_expert"

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, shared = require(hf, ("num_experts", "num_local_experts"), "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        fields = common_fields(hf, "qwen2_moe", self.gguf_arch)
        return ModelConfig(
            **fields,
            attn_bias=True,
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=sparse_layers(hf, fields["n_layers"]),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=bool(hf.get("norm_topk_prob", False)),
            n_shared_experts=1 if shared else 0,
            shared_expert_ffn=shared,
            shared_expert_gate=bool(shared),
        )


class Qwen3Moe(Adapter):
    model_types = ("qwen3_moe",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, ("num_experts", "num_local_experts"), "num_experts_per_tok", "moe_intermediate_size")
        fields = common_fields(hf, "qwen3_moe", self.gguf_arch)
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            qk_norm="head",
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=sparse_layers(hf, fields["n_layers"]),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=bool(hf.get("norm_topk_prob", True)),
        )
