"""gpt-oss: attention sinks, sliding-window layers between full ones, biases on q/k/v/o, a
router with its own bias and a softmax over the chosen experts, experts with biases and a
clamped SwiGLU, their gate and up interleaved column by column in one transposed tensor."""

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, ExpertNames, ResidentView, TinyModel, common_fields, require
from colibri.formats.model_config import ModelConfig

TINY = {  # openai/gpt-oss-20b (a window its prompts pass)
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initial_context_length": 4096,
    "intermediate_size": 256,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 512,
}
LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU = 1.702, 7.0  # alpha and limit: transformers' defaults, and what llama.cpp's gpt-oss graph hard-codes


class GptOss(Adapter):
    model_types = ("gpt_oss",)
    tiny_models = {"gpt_oss": TinyModel(TINY, "harmony")}
    gguf_arch = gguf.MODEL_ARCH.GPT_OSS
    o_proj_bias = True
    fused_expert_layout = "gpt_oss"
    gguf_names = {"ffn_norm": "post_attention_norm"}
    gguf_ffn_is_expert = True
    gguf_norm_topk = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, layers = require(hf, "num_local_experts", ("num_experts_per_tok", "experts_per_token"),
                                             "intermediate_size", "num_hidden_layers")
        fields = common_fields(hf, "gpt_oss", self.gguf_arch, windows=True)  # on the layers `layer_types` names
        kinds = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]
        if not (isinstance(kinds, list) and len(kinds) == layers and all(k in LAYER_TYPES for k in kinds)):
            raise ConfigError(f"config.json: layer_types is not {layers} of {', '.join(LAYER_TYPES)}")
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        window = hf.get("sliding_window") or 0
        if sliding and not (isinstance(window, int) and window > 0):
            raise ConfigError(f"config.json: sliding_window {hf.get('sliding_window')!r} is not a positive whole number")
        bias = bool(hf.get("attention_bias", True))
        return ModelConfig(
            **fields,
            attn_bias=bias,
            attn_output_bias=bias,
            attn_sinks=True,
            sliding_window=window if sliding else 0,
            sliding_layers=sliding,
            moe_layers=list(range(layers)),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=True,  # the softmax over the chosen k is the renormalized softmax of all
            router_logit_bias=True,
            expert_glu="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", SWIGLU[0])),
            swiglu_limit=float(hf.get("swiglu_limit", SWIGLU[1])),
            expert_bias=True,
        )

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        p = f"model.layers.{layer}"
        tensors = super().layer_tensors(c, layer)
        tensors[f"{p}.self_attn.sinks"] = (c.n_heads,)
        if c.attn_output_bias:
            tensors[f"{p}.self_attn.o_proj.bias"] = (c.hidden_size,)
        tensors[f"{p}.mlp.experts.gate_up_proj_bias"] = (c.n_experts, 2 * c.expert_ffn)
        tensors[f"{p}.mlp.experts.down_proj_bias"] = (c.n_experts, c.hidden_size)
        return tensors

    def router_tensors(self, c: ModelConfig, p: str) -> dict[str, tuple]:
        return {f"{p}.mlp.router.weight": (c.n_experts, c.hidden_size), f"{p}.mlp.router.bias": (c.n_experts,)}

    def experts(self, layer: int, packed: bool = False) -> ExpertNames:
        # the hub's MXFP4 blocks are rows [E, 2I, D / 32] (gate and up interleaved), not transposed
        return ExpertNames(f"model.layers.{layer}.mlp.experts", self.expert_leaves,
                           "interleaved" if packed else self.fused_expert_layout)

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".self_attn.sinks"):
            return [ResidentView(f"blk.{layer}.attn_sinks.weight", None, shape)]
        if name.endswith(".mlp.experts.gate_up_proj_bias"):  # gate and up interleaved, column by column
            half = (shape[0], shape[1] // 2)
            return [ResidentView(f"blk.{layer}.ffn_gate_exps.bias", tuple(range(0, shape[1], 2)), half),
                    ResidentView(f"blk.{layer}.ffn_up_exps.bias", tuple(range(1, shape[1], 2)), half)]
        if name.endswith(".mlp.experts.down_proj_bias"):
            return [ResidentView(f"blk.{layer}.ffn_down_exps.bias", None, shape)]
        return super().resident_views(name, shape, c)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        window = int(meta.get("{arch}.attention.sliding_window", 0) or 0)
        scaling = fields.get("rope_scaling")
        # gpt-oss's YaRN ramp is not rounded to whole dimensions (llama.cpp rounds it); llama.cpp's
        # graph slides the even layers, the odd ones see everything
        return {"rope_scaling": scaling and {**scaling, "truncate": False}, "attn_bias": True, "attn_output_bias": True,
                "attn_sinks": True, "sliding_window": window,
                "sliding_layers": list(range(0, fields["n_layers"], 2)) if window else [], "router": "softmax",
                "router_norm_topk": True, "router_logit_bias": True, "expert_glu": "clamped_swiglu",
                "swiglu_alpha": SWIGLU[0], "swiglu_limit": SWIGLU[1], "expert_bias": True}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_sliding_window(c.sliding_window)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if c.sliding_layers != list(range(0, c.n_layers, 2)):
            problems.append(f"llama.cpp's gpt-oss slides the even layers, not layers {c.sliding_layers}")
        if (c.swiglu_alpha, c.swiglu_limit) != SWIGLU:
            problems.append(f"llama.cpp's gpt-oss has swiglu alpha {SWIGLU[0]} and limit {SWIGLU[1]}, not "
                            f"{c.swiglu_alpha} and {c.swiglu_limit}")
        return problems
