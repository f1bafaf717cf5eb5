"""dots.llm1 (rednote-hilab): Qwen3's attention (q/k RMSNorm per head) with DeepSeek-V3's
mixture (sigmoid scores, a correction bias for the choice, shared experts, dense first
layers). llama.cpp stores it as `dots1`."""

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, TinyModel, common_fields, require, sigmoid_routing
from colibri.formats.model_config import ModelConfig

TINY = {  # rednote-hilab/dots.llm1.inst at tiny widths
    "architectures": ["Dots1ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_position_embeddings": 32768,
    "max_window_layers": 3,
    "model_type": "dots1",
    "moe_intermediate_size": 256,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "sliding_window": None,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_sliding_window": False,
    "vocab_size": 512,
}


class Dots1(Adapter):
    model_types = ("dots1",)
    tiny_models = {"dots1": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.DOTS1
    gguf_leading_dense = True  # leading_dense_block_count, the shared experts' count and the gating function

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        kinds = hf.get("layer_types")
        if kinds and set(kinds) != {"full_attention"}:
            raise ConfigError(f"config.json: layer_types {sorted(set(kinds))} (colibri runs dots.llm1's full attention only)")
        fields = common_fields(hf, "dots1", self.gguf_arch)
        n_shared = hf.get("n_shared_experts") or 0
        first_dense = hf.get("first_k_dense_replace", 0)
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            qk_norm="head",
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=list(range(first_dense, fields["n_layers"])),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            **sigmoid_routing(hf, norm_topk=False),  # transformers' Dots1TopkRouter's, whatever scoring_func says
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
        )

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        sigmoid = meta.get(gguf.Keys.LLM.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
        return {"router": "sigmoid" if sigmoid else "softmax"}

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = [f"{c.router_groups} expert groups (llama.cpp's dots1 routes without groups)"] if c.router_groups > 1 else []
        if c.n_kv_heads != c.n_heads:
            problems.append(f"{c.n_kv_heads} key-value heads for {c.n_heads} (llama.cpp's dots1 loads k and v as wide as q)")
        return problems
