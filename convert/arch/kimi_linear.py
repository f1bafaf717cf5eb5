"""Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B): Kimi delta attention (KDA) layers between
position-free MLA ones. A KDA layer is a gated delta rule whose decay is per key channel
(`runtime.deltanet.KimiDeltaAttention`): q, k and v each through a short causal convolution,
a low-rank forget gate, a per-head write strength, a low-rank sigmoid output gate over each
head's normalized output. The MLA layers rotate nothing: their "rope" part of the key is
shared by the heads as is. DeepSeek-V3's sigmoid routing with a correction bias, one shared
expert, a dense first layer. llama.cpp stores it as `kimi-linear`.

The release names the layers in `linear_attn_config` (1-based `kda_layers` and
`full_attn_layers`) and its MoE `block_sparse_moe` (experts `w1`, `w3`, `w2`); a checkpoint
transformers saved names the dense first layer's FFN `block_sparse_moe` too, which
`formats.checkpoint` reads as the release's `mlp`.
"""

import gguf

from colibri.convert.arch.base import (
    Adapter, ConfigError, ResidentView, TinyModel, common_fields, require, sigmoid_routing,
)
from colibri.formats.model_config import ModelConfig

SSM, A = gguf.Keys.SSM, gguf.Keys.Attention
LINEAR = "self_attn"  # a KDA layer's module, where the MLA layers keep theirs
TINY = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct at tiny widths (two KDA layers, then MLA; KDA heads of
    # 256, so that the low-rank gates' second products have K-quant rows, as many as the attention's,
    # as llama.cpp's kimi-linear assumes)
    "architectures": ["KimiLinearForCausalLM"],
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "linear_attn_config": {"full_attn_layers": [3], "head_dim": 256, "kda_layers": [1, 2], "num_heads": 4,
                           "short_conv_kernel_size": 4},
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 4,
    "num_expert_group": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "pad_token_id": None,  # the release's is its last token id, beyond this vocabulary
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_grouped_topk": True,
    "v_head_dim": 64,
    "vocab_size": 512,
}


def _linear_layers(hf: dict, layers: int) -> list[int]:
    """The KDA layers: `layer_types` (as transformers saves it), else the release's 1-based lists."""
    kinds = hf.get("layer_types")
    if kinds is not None:
        if not (isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {"linear_attention", "full_attention"}):
            raise ConfigError(f"config.json: layer_types is not {layers} of 'linear_attention', 'full_attention'")
        return [i for i in range(layers) if kinds[i] == "linear_attention"]
    spec = hf.get("linear_attn_config") or {}
    kda, full = spec.get("kda_layers"), spec.get("full_attn_layers")
    if not (isinstance(kda, list) and isinstance(full, list) and sorted(kda + full) == list(range(1, layers + 1))):
        raise ConfigError(f"config.json: linear_attn_config kda_layers and full_attn_layers do not number the "
                          f"{layers} layers from 1 once each")
    return sorted(i - 1 for i in kda)


def kda_fields(hf: dict, heads: int, width: int) -> dict:
    """The ModelConfig fields of Kimi delta attention layers, from the release's
    `linear_attn_config` or transformers' `linear_*` keys (`heads` and `width`: the defaults)."""
    spec = hf.get("linear_attn_config") or {}
    heads = spec.get("num_heads", hf.get("linear_num_heads", heads))
    width = spec.get("head_dim", hf.get("linear_head_dim", width))
    return dict(linear_kind="kda", linear_conv_kernel=spec.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
                linear_k_heads=heads, linear_v_heads=heads, linear_k_head_dim=width, linear_v_head_dim=width)


def sparse_layers(hf: dict, layers: int, default: list[int]) -> list[int]:
    """The MoE layers: `mlp_layer_types` (as transformers saves it), else `default`."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return default
    if not (isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {"dense", "sparse"}):
        raise ConfigError(f"config.json: mlp_layer_types is not {layers} of 'dense', 'sparse'")
    return [i for i in range(layers) if kinds[i] == "sparse"]


class KimiLinear(Adapter):
    model_types = ("kimi_linear",)
    tiny_models = {"kimi_linear": TinyModel(TINY, "kimi")}
    gguf_arch = gguf.MODEL_ARCH.KIMI_LINEAR
    moe_block = "block_sparse_moe"
    expert_leaves = ("w1", "w3", "w2")
    linear_block = LINEAR
    gguf_leading_dense = True
    gguf_rope_interleaved = True
    gguf_split_kv_b = True
    gguf_norm_topk = True
    gguf_linear_kv_zero = True

    def normalize(self, hf: dict) -> ModelConfig:
        kv_rank, nope, rope, v_dim = require(hf, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        experts, used, ffn, layers = require(hf, ("num_experts", "num_local_experts"), ("num_experts_per_token",
                                             "num_experts_per_tok"), "moe_intermediate_size", "num_hidden_layers")
        if hf.get("mla_use_nope") is False:
            raise ConfigError("config.json: mla_use_nope false (a rotated MLA) is not supported; Kimi-Linear's MLA rotates nothing")
        if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json: moe_router_activation_func {hf['moe_router_activation_func']!r} is not "
                              "supported (Kimi-Linear's is sigmoid)")
        linear = _linear_layers(hf, layers)
        first_dense, freq = hf.get("first_k_dense_replace", 1), hf.get("moe_layer_freq", 1)
        moe = sparse_layers(hf, layers, [i for i in range(layers) if i >= first_dense and i % freq == 0])
        shared = hf.get("num_shared_experts", hf.get("n_shared_experts")) or 0
        plain = {**hf, "max_position_embeddings": hf.get("model_max_length", hf.get("max_position_embeddings", 4096))}
        fields = common_fields(plain, "kimi_linear", self.gguf_arch)
        fields.update(n_kv_heads=fields["n_heads"], head_dim=nope + rope, v_head_dim=v_dim, rope_dim=rope,
                      norm_eps=float(hf.get("rms_norm_eps", 1e-5)))
        routing = {"n_group": hf.get("num_expert_group", hf.get("n_group")), "topk_group": hf.get("topk_group"),
                   "norm_topk_prob": hf.get("moe_renormalize", hf.get("norm_topk_prob", True)),
                   "routed_scaling_factor": hf.get("routed_scaling_factor")}
        return ModelConfig(
            **fields,
            attention="mla",
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=kv_rank,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            rope_interleaved=True,
            nope_layers=[i for i in range(layers) if i not in linear],
            linear_layers=linear,
            **kda_fields(hf, heads=32, width=128),
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=moe,
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            n_shared_experts=shared,
            shared_expert_ffn=ffn * shared,
            **sigmoid_routing(routing),
        )

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        tensors = super().layer_tensors(c, layer)
        if c.is_linear_layer(layer):
            tensors = {n: s for n, s in tensors.items() if ".self_attn." not in n}
            tensors.update(self.linear_attention_tensors(c, f"model.layers.{layer}.{LINEAR}"))
        return tensors

    @staticmethod
    def linear_attention_tensors(c: ModelConfig, a: str) -> dict[str, tuple]:
        """A KDA layer's tensors as the release names them, `a` its module's prefix."""
        d, heads, width = c.hidden_size, c.linear_v_heads, c.linear_v_head_dim
        inner = heads * width
        return {**{f"{a}.{x}_proj.weight": (inner, d) for x in "qkv"},
                **{f"{a}.{x}_conv1d.weight": (inner, 1, c.linear_conv_kernel) for x in "qkv"},
                f"{a}.f_a_proj.weight": (width, d), f"{a}.f_b_proj.weight": (inner, width), f"{a}.b_proj.weight": (heads, d),
                f"{a}.A_log": (1, 1, heads, 1), f"{a}.dt_bias": (inner,), f"{a}.g_a_proj.weight": (width, d),
                f"{a}.g_b_proj.weight": (inner, width), f"{a}.o_norm.weight": (width,), f"{a}.o_proj.weight": (d, inner)}

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        p = f"blk.{name.split('.')[2]}." if name.startswith("model.layers.") else ""
        if name.endswith(f".{LINEAR}.A_log"):  # stored as llama.cpp does: A = -exp(A_log), one per head
            return [ResidentView(p + "ssm_a", None, (shape[2],), transform="neg_exp")]
        if name.endswith(f".{LINEAR}.dt_bias"):
            return [ResidentView(p + "ssm_dt.bias", None, shape)]
        if name.endswith("_conv1d.weight"):
            return [ResidentView(p + f"ssm_conv1d_{name.split('.')[-2][0]}.weight", None, (shape[0], shape[2]))]
        return super().resident_views(name, shape, c)

    # --- GGUF ---------------------------------------------------------------------------

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_kv_lora_rank(c.kv_lora_rank)
        if c.q_lora_rank:
            writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_ssm_conv_kernel(c.linear_conv_kernel)
        writer.add_kda_head_dim(c.linear_k_head_dim)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        layers, heads = fields["n_layers"], fields["n_heads"]
        kv_heads = meta.per_layer(A.HEAD_COUNT_KV, layers, heads)
        rope = meta.require(gguf.Keys.Rope.DIMENSION_COUNT)
        head_dim = meta.require(A.KEY_LENGTH_MLA)
        linear = [i for i in range(layers) if kv_heads[i] == 0]
        width = meta.require(gguf.Keys.KDA.HEAD_DIM)
        return dict(
            attention="mla", n_kv_heads=heads, head_dim=head_dim, v_head_dim=meta.require(A.VALUE_LENGTH_MLA),
            q_lora_rank=meta.get(A.Q_LORA_RANK) or None, kv_lora_rank=meta.require(A.KV_LORA_RANK),
            qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope, nope_layers=[i for i in range(layers) if i not in linear],
            linear_layers=linear, linear_kind="kda", linear_conv_kernel=meta.require(SSM.CONV_KERNEL),
            linear_k_heads=heads, linear_v_heads=heads, linear_k_head_dim=width, linear_v_head_dim=width,
            router="sigmoid" if meta.get(gguf.Keys.LLM.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID else "softmax",
        )

    def gguf_shape(self, name: str, shape: tuple) -> tuple:
        """The shapes llama.cpp's kimi-linear loader reads: convolutions [kernel, 1, channels], A [1, heads]."""
        if ".ssm_conv1d_" in name:
            return (shape[0], 1, shape[1])
        if name.endswith(".ssm_a"):
            return (shape[0], 1)
        return shape

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if c.router != "sigmoid" or not c.router_norm_topk or c.router_groups != 1:
            problems.append("llama.cpp's kimi-linear routes by sigmoid, renormalized, without expert groups")
        if c.nope_layers != [i for i in range(c.n_layers) if not c.is_linear_layer(i)]:
            problems.append("llama.cpp's kimi-linear rotates nothing in its MLA layers")
        return problems
