"""ERNIE-4.5 MoE (baidu): GQA rotating pairs over the whole head, dense first layers, softmax
routing whose correction bias (`moe_statics`) only chooses the experts, shared experts.
llama.cpp stores it as `ernie4_5-moe`."""

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, ResidentView, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

K = gguf.Keys.LLM

TINY = {  # baidu/ERNIE-4.5-21B-A3B-PT at tiny widths
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_position_embeddings": 131072,
    "model_type": "ernie4_5_moe",
    "moe_intermediate_size": 256,
    "moe_k": 2,
    "moe_layer_end_index": 2,
    "moe_layer_interval": 1,
    "moe_layer_start_index": 1,
    "moe_num_experts": 8,
    "moe_num_shared_experts": 1,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
    "use_bias": False,
    "vocab_size": 512,
}


def moe_layers(hf: dict, n_layers: int) -> list[int]:
    """transformers' rule: every `moe_layer_interval`-th layer from `moe_layer_start_index` to
    `moe_layer_end_index` (-1: the last)."""
    start, interval = hf.get("moe_layer_start_index", 0), hf.get("moe_layer_interval", 1) or 1
    end = hf.get("moe_layer_end_index", -1)
    end = n_layers - 1 if end in (None, -1) else end
    return [i for i in range(n_layers) if start <= i <= end and (i + 1) % interval == 0]


class Ernie45Moe(Adapter):
    model_types = ("ernie4_5_moe",)
    tiny_models = {"ernie4_5_moe": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.ERNIE4_5_MOE
    gguf_leading_dense = True  # leading_dense_block_count, the shared experts' count and the gating function
    gguf_rope_interleaved = True
    router_bias_leaf = "moe_statics.e_score_correction_bias"

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn = require(hf, ("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok"),
                                     "moe_intermediate_size")
        if hf.get("use_bias"):
            raise ConfigError("config.json: use_bias true (colibri runs ERNIE-4.5 without projection biases)")
        fields = common_fields(hf, "ernie4_5_moe", self.gguf_arch)
        n_shared = hf.get("moe_num_shared_experts") or 0
        return ModelConfig(
            **fields,
            rope_interleaved=True,  # transformers' "glm rope style" over the whole head
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=moe_layers(hf, fields["n_layers"]),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=True,
            router_bias=True,
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
        )

    def router_tensors(self, c: ModelConfig, p: str) -> dict[str, tuple]:
        tensors = super().router_tensors(c, p)
        tensors[f"{p}.mlp.{self.router_bias_leaf}"] = (1, c.n_experts)  # one group's bias, stored 2-D
        return tensors

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        views = super().resident_views(name, shape, c)
        return [v._replace(shape=(c.n_experts,)) for v in views] if name.endswith(self.router_bias_leaf) else views

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_interleave_moe_layer_step(1)
        if c.n_shared_experts:
            writer.add_expert_shared_feed_forward_length(c.shared_expert_ffn)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        first_moe = fields["moe_layers"][0] if fields["moe_layers"] else 0
        shared_ffn = meta.get(K.EXPERT_SHARED_FEED_FORWARD_LENGTH) or shapes.get(f"blk.{first_moe}.ffn_up_shexp.weight", (0,))[0]
        return {"n_shared_experts": shared_ffn // fields["expert_ffn"] if shared_ffn else 0, "shared_expert_ffn": shared_ffn,
                "router_norm_topk": True}
