"""DeepSeek-V2/V3 and Kimi-K2: MLA attention, group-limited routing, shared experts,
dense first layers; V3/K2 add sigmoid scores with a correction bias."""

import gguf

from colibri.convert.arch.base import Adapter, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

K, A, R = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope

TINY_V2 = {  # deepseek-ai/DeepSeek-V2-Lite (q_lora_rank null -> q_proj)
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 512,
}
TINY_V3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 512,
}
TINY_KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's config, one expert group
    **{key: value for key, value in TINY_V3.items() if key != "ep_size"},
    "model_type": "kimi_k2",
    "max_position_embeddings": 131072,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
}


class Deepseek(Adapter):
    model_types = ("deepseek_v2", "deepseek_v3", "kimi_k2")
    tiny_models = {"deepseek_v2": TinyModel(TINY_V2, "deepseek_back"), "deepseek_v3": TinyModel(TINY_V3, "deepseek"),
                   "kimi_k2": TinyModel(TINY_KIMI_K2, "kimi")}
    gguf_arch = gguf.MODEL_ARCH.DEEPSEEK2
    gguf_leading_dense = True
    gguf_rope_interleaved = True

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

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        """MLA's widths; V3 when its gating is sigmoid (transformers' V2 scores a group by its
        best expert); llama.cpp's converter stores 0.1 × mscale_all_dim as yarn_log_multiplier."""
        rope = meta.require(R.DIMENSION_COUNT)
        head_dim = meta.get(A.KEY_LENGTH_MLA) or meta.require(A.KEY_LENGTH)
        sigmoid = meta.get(K.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
        own = dict(
            attention="mla", n_kv_heads=fields["n_heads"], head_dim=head_dim,
            v_head_dim=meta.get(A.VALUE_LENGTH_MLA) or meta.require(A.VALUE_LENGTH),
            q_lora_rank=meta.get(A.Q_LORA_RANK) or None, kv_lora_rank=meta.require(A.KV_LORA_RANK),
            qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope,
            architecture="deepseek_v3" if sigmoid else "deepseek_v2", router="sigmoid" if sigmoid else "softmax",
            router_group_score="top2_sum" if sigmoid else "max",
        )
        log_mul = meta.get(R.SCALING_YARN_LOG_MUL)
        if fields["rope_scaling"] and log_mul is not None:
            mscale = float(f"{log_mul * 10:.6g}")
            own["rope_scaling"] = {**fields["rope_scaling"], "mscale": mscale, "mscale_all_dim": mscale}
        return own

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_kv_lora_rank(c.kv_lora_rank)
        writer.add_q_lora_rank(c.q_lora_rank or 0)  # 0: q projected directly (llama.cpp requires the key unless it guesses "Lite")
