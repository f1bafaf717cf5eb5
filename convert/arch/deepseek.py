"""DeepSeek-V2/V3 and Kimi-K2: MLA attention, group-limited routing, shared experts,
dense first layers; V3/K2 add sigmoid scores with a correction bias."""

import gguf

from colibri.convert.arch.base import Adapter, common_fields, require
from colibri.formats.model_config import ModelConfig


class Deepseek(Adapter):
    model_types = ("deepseek_v2", "deepseek_v3", "kimi_k2")
    gguf_arch = gguf.MODEL_ARCH.DEEPSEEK2

    def normalize(self, hf: dict) -> ModelConfig:
        kv_rank, nope, rope, v_dim = require(hf, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        experts, used, ffn = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        model_type = hf["model_type"]
        fields = common_fields(hf, model_type, self.gguf_arch)
        n_layers = fields["n_layers"]
        first_dense, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        fields.update(n_kv_heads=fields["n_heads"], head_dim=nope + rope, v_head_dim=v_dim, rope_dim=rope)
        method = hf.get("topk_method", "noaux_tc" if model_type != "deepseek_v2" else "greedy")
        grouped = method in ("noaux_tc", "group_limited_greedy")
        n_shared = hf.get("n_shared_experts") or 0
        return ModelConfig(
            **fields,
            attention="mla",
            attn_bias=False,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=kv_rank,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            rope_interleaved=bool(hf.get("rope_interleave", True)),
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=[i for i in range(n_layers) if i >= first_dense and i % freq == 0],
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router=hf.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax"),
            # transformers' DeepSeek-V2 never renormalises (its configs say norm_topk_prob: false anyway)
            router_norm_topk=model_type != "deepseek_v2" and bool(hf.get("norm_topk_prob", False)),
            router_bias=method == "noaux_tc",
            router_groups=(hf.get("n_group") or 1) if grouped else 1,
            router_topk_groups=(hf.get("topk_group") or 1) if grouped else 1,
            router_group_score="top2_sum" if method == "noaux_tc" else "max",
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
            mtp_layers_skipped=self.mtp_layers(hf),
        )
