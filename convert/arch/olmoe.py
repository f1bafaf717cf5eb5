"""OLMoE: q/k RMSNorm over the whole projection, softmax router without renormalisation."""

import gguf

from colibri.convert.arch.base import Adapter, common_fields, require
from colibri.formats.model_config import ModelConfig


class Olmoe(Adapter):
    model_types = ("olmoe",)
    gguf_arch = gguf.MODEL_ARCH.OLMOE

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
