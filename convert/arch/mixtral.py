"""Mixtral: softmax router over all experts, top-k renormalised; experts w1/w3/w2."""

import gguf

from colibri.convert.arch.base import Adapter, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

TINY = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 512,
}


class Mixtral(Adapter):
    model_types = ("mixtral",)
    tiny_models = {"mixtral": TinyModel(TINY, "llama")}
    gguf_arch = gguf.MODEL_ARCH.LLAMA  # llama.cpp runs Mixtral as `llama` with experts
    moe_block = "block_sparse_moe"
    expert_leaves = ("w1", "w3", "w2")
    gguf_ffn_is_expert = True
    gguf_norm_topk = True
    gguf_permuted_qk = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, "num_local_experts", "num_experts_per_tok", "intermediate_size")
        fields = common_fields(hf, "mixtral", self.gguf_arch)
        return ModelConfig(
            **fields,
            moe_layers=list(range(fields["n_layers"])),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=True,
        )

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        if c.rope_dim != c.head_dim:
            return [f"llama needs rope over the whole head ({c.rope_dim} of {c.head_dim} dims)"]
        return []
