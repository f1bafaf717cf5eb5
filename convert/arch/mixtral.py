"""Mixtral: softmax router over all experts, top-k renormalised; experts w1/w3/w2."""

import gguf

from colibri.convert.arch.base import Adapter, common_fields, require
from colibri.formats.model_config import ModelConfig


class Mixtral(Adapter):
    model_types = ("mixtral",)
    gguf_arch = gguf.MODEL_ARCH.LLAMA  # llama.cpp runs Mixtral as `llama` with experts
    moe_block = "block_sparse_moe"
    expert_leaves = ("w1", "w3", "w2")

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
