"""OLMoE: q/k RMSNorm over the whole projection, softmax router without renormalisation."""

import gguf

from colibri.convert.arch.base import Adapter, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

TINY = {  # allenai/OLMoE-1B-7B-0924
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 512,
}


class Olmoe(Adapter):
    model_types = ("olmoe",)
    tiny_models = {"olmoe": TinyModel(TINY, "olmoe")}
    gguf_arch = gguf.MODEL_ARCH.OLMOE
    o_proj_bias = True
    gguf_ffn_is_expert = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, ("num_experts", "num_local_experts"), "num_experts_per_tok", "intermediate_size")
        fields = common_fields(hf, "olmoe", self.gguf_arch)
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            qk_norm="full",
            clip_qkv=hf.get("clip_qkv"),
            moe_layers=list(range(fields["n_layers"])),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=bool(hf.get("norm_topk_prob", False)),
        )
