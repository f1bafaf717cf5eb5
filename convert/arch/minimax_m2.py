"""MiniMax-M2: Q/K RMSNorm over the whole projection, partial rotary, sigmoid router with a
selection bias and no groups, top-k renormalised; experts w1/w3/w2, no shared expert."""

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

TINY = {  # MiniMaxAI/MiniMax-M2 (its checkpoint in FP8 128x128 blocks; "rotary_dim" says partial rotary)
    "architectures": ["MiniMaxM2ForCausalLM"],
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 256,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 32,
    "router_aux_loss_coef": 0.001,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 512,
}


class MiniMaxM2(Adapter):
    model_types = ("minimax_m2",)
    tiny_models = {"minimax_m2": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.MINIMAXM2
    moe_block = "block_sparse_moe"
    expert_leaves = ("w1", "w3", "w2")
    router_bias_leaf = "e_score_correction_bias"  # beside the router, not in it
    gguf_norm_topk = True  # llama.cpp's minimax-m2 graph renormalises the top-k weights
    gguf_ffn_is_expert = True  # its loader sizes the experts by feed_forward_length

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, "num_local_experts", "num_experts_per_tok", "intermediate_size")
        fields = common_fields(hf, "minimax_m2", self.gguf_arch)
        if hf.get("rotary_dim") is not None:  # the released configs' partial rotary
            fields["rope_dim"] = int(hf["rotary_dim"])
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported (MiniMax-M2 routes by sigmoid)")
        if hf.get("qk_norm_type", "per_layer") != "per_layer" or not hf.get("use_qk_norm", True):
            raise ConfigError(f"config.json: qk_norm_type {hf.get('qk_norm_type')!r} / use_qk_norm "
                              f"{hf.get('use_qk_norm')!r}: MiniMax-M2 normalizes Q and K over the whole projection")
        return ModelConfig(
            **fields,
            qk_norm="full",
            moe_layers=list(range(fields["n_layers"])),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="sigmoid",
            router_norm_topk=True,
            router_bias=True,
        )

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        return {"router": "sigmoid"}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
