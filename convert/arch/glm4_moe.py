"""GLM-4.5 / 4.5-Air / 4.6: partial rotary, attention bias, DeepSeek-V3-style routing."""

import gguf

from colibri.convert.arch.base import Adapter, common_fields, require
from colibri.formats.model_config import ModelConfig


class Glm4Moe(Adapter):
    model_types = ("glm4_moe",)
    gguf_arch = gguf.MODEL_ARCH.GLM4_MOE

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
            router="sigmoid",
            router_norm_topk=bool(hf.get("norm_topk_prob", True)),
            router_bias=True,
            router_groups=hf.get("n_group") or 1,
            router_topk_groups=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
            mtp_layers_skipped=self.mtp_layers(hf),
        )
