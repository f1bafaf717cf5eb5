"""GLM-4.5 / 4.5-Air / 4.6: partial rotary, attention bias, DeepSeek-V3-style routing."""

import gguf

from colibri.convert.arch.base import Adapter, TinyModel, common_fields, require, sigmoid_routing
from colibri.formats.model_config import ModelConfig

TINY = {  # zai-org/GLM-4.5 (partial rotary, qkv bias, qk-norm, MTP layer)
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 256,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 512,
}


class Glm4Moe(Adapter):
    model_types = ("glm4_moe",)
    tiny_models = {"glm4_moe": TinyModel(TINY, "glm")}
    gguf_arch = gguf.MODEL_ARCH.GLM4_MOE
    gguf_names = {"ffn_norm": "post_attention_norm"}  # gguf's name map gives GLM's pre-FFN norm llama.cpp's name
    gguf_leading_dense = True
    gguf_keeps_mtp = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        fields = common_fields(hf, "glm4_moe", self.gguf_arch)
        n_shared = hf.get("n_shared_experts") or 0
        first_dense = hf.get("first_k_dense_replace", 0)
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            qk_norm="head" if hf.get("use_qk_norm") else "none",
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=list(range(first_dense, fields["n_layers"])),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            **sigmoid_routing(hf),
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
            mtp_layers_skipped=self.mtp_layers(hf),
        )

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        """Sigmoid scores unless the gating function says softmax."""
        softmax = meta.get(gguf.Keys.LLM.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SOFTMAX
        return {"router": "softmax" if softmax else "sigmoid"}
