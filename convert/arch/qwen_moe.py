"""Qwen2-MoE (sigmoid-gated shared expert, qkv bias) and Qwen3-MoE (per-head q/k norm)."""

import gguf

from colibri.convert.arch.base import Adapter, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

K = gguf.Keys.LLM

TINY_QWEN2 = {  # Qwen/Qwen1.5-MoE-A2.7B
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 8192,
    "max_window_layers": 2,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 256,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}
TINY_QWEN3 = {  # Qwen/Qwen3-30B-A3B (head_dim != hidden/heads, like the real one)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}


def sparse_layers(hf: dict, n_layers: int) -> list[int]:
    """Qwen's rule: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


class Qwen2Moe(Adapter):
    model_types = ("qwen2_moe",)
    tiny_models = {"qwen2_moe": TinyModel(TINY_QWEN2, "chatml")}
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

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        """One shared expert, its width in its own key (older converters: only in its shape)."""
        first_moe = fields["moe_layers"][0] if fields["moe_layers"] else 0
        shared_ffn = meta.get(K.EXPERT_SHARED_FEED_FORWARD_LENGTH) or shapes.get(f"blk.{first_moe}.ffn_up_shexp.weight", (0,))[0]
        return {"n_shared_experts": 1 if shared_ffn else 0, "shared_expert_ffn": shared_ffn}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        if c.n_shared_experts:
            writer.add_expert_shared_feed_forward_length(c.shared_expert_ffn)


class Qwen3Moe(Adapter):
    model_types = ("qwen3_moe",)
    tiny_models = {"qwen3_moe": TinyModel(TINY_QWEN3, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE
    o_proj_bias = True
    gguf_norm_topk = True

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
