"""HunYuan MoE (tencent/Hunyuan-A13B): GQA whose per-head q/k RMSNorm comes after the rotation,
NTK-alpha RoPE (a fixed alpha stretches the base: theta × alpha^(d / (d − 2))), softmax routing
renormalized over the chosen, one shared MLP. llama.cpp stores it as `hunyuan-moe`."""

import gguf
import numpy as np

from colibri.convert.arch.base import Adapter, ConfigError, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

TINY = {  # tencent/Hunyuan-A13B-Instruct at tiny widths
    "architectures": ["HunYuanMoEV1ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 256,
    "max_position_embeddings": 32768,
    "model_type": "hunyuan_v1_moe",
    "moe_intermediate_size": [256, 256],
    "moe_topk": [2, 2],
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_shared_expert": [1, 1],
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "use_cla": False,
    "use_qk_norm": True,
    "vocab_size": 512,
}


def one_value(hf: dict, key: str, default=None):
    """A per-layer list's one value (transformers reads the first layer's), or the number itself."""
    value = hf.get(key, default)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ConfigError(f"config.json: {key} differs between layers ({value[:4]}...), not supported")
        return value[0]
    return value


def ntk_alpha_theta(hf: dict, head_dim: int) -> float:
    """The rotation base: theta stretched by a "dynamic" scaling's fixed alpha (transformers'
    compute_ntk_alpha_rope_parameters, llama.cpp's converter), else theta."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if params.get("rope_type", params.get("type")) == "dynamic" and params.get("alpha"):
        theta *= float(params["alpha"]) ** (head_dim / (head_dim - 2))
    return float(np.float32(theta))  # the float32 both implementations compute with, and GGUF keeps


class HunyuanMoe(Adapter):
    model_types = ("hunyuan_v1_moe",)
    tiny_models = {"hunyuan_v1_moe": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.HUNYUAN_MOE
    shared_block = "shared_mlp"
    router_leaf = "gate.wg.weight"
    qk_norm_leaves = ("query_layernorm", "key_layernorm")
    gguf_ffn_is_expert = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, ffn = require(hf, "num_experts", "intermediate_size")
        for key, refused in (("use_cla", True), ("use_qk_norm", False)):
            if hf.get(key, not refused) == refused:
                raise ConfigError(f"config.json: {key} {refused} is not supported (colibri runs Hunyuan-A13B's attention)")
        if one_value(hf, "moe_intermediate_size", ffn) != ffn or one_value(hf, "num_shared_expert", 1) != 1:
            raise ConfigError("config.json: moe_intermediate_size or num_shared_expert differ from transformers' "
                              "(experts as wide as intermediate_size, one shared MLP)")
        params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        dynamic = params.get("rope_type", params.get("type")) == "dynamic"  # its alpha is folded into the base
        fields = common_fields({**hf, "rope_scaling": None, "rope_parameters": None} if dynamic else hf, "hunyuan_v1_moe",
                               self.gguf_arch)
        fields["rope_theta"] = ntk_alpha_theta(hf, fields["head_dim"])
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            qk_norm="head",
            qk_norm_after_rope=True,
            moe_layers=list(range(fields["n_layers"])),
            n_experts=experts,
            n_experts_used=one_value(hf, "moe_topk"),
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=True,
            n_shared_experts=1,
            shared_expert_ffn=ffn,
        )

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_ffn)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        return {"qk_norm_after_rope": True, "router_norm_topk": True, "shared_expert_ffn": fields["expert_ffn"]}
