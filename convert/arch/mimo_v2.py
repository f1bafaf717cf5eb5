"""MiMo-V2-Flash (XiaomiMiMo/MiMo-V2-Flash): GQA whose sliding-window layers have twice the
key-value heads of the full ones, their own RoPE base and attention sinks; query/key heads wider
than value heads, values scaled before they are cached, partial rotation (halves); a dense
first layer, then DeepSeek-V3's sigmoid routing without shared experts. llama.cpp stores it as
`mimo2`.

The hub's config.json names the layers by `hybrid_layer_pattern` (1: sliding) and
`moe_layer_freq`, the sliding layers' heads and base by `swa_*`; a config transformers saved
has `layer_types`, `mlp_layer_types` and `rope_parameters` per layer type. As transformers
reads it, a sliding query sees `sliding_window_size` earlier positions and its own; llama.cpp's
converter writes `sliding_window` (one fewer) and so its `mimo2` sees one position less.
"""

import gguf
import numpy as np

from colibri.convert.arch.base import (
    Adapter, ConfigError, ResidentView, TinyModel, common_fields, require, sigmoid_routing,
)
from colibri.formats.model_config import ModelConfig

VALUE_SCALE = "{arch}.attention.value_scale"  # llama.cpp's key (gguf-py 0.19 has no constant for it)
SINK_LEAVES = ("attention_sink_bias", "sinks")  # the hub's name, and transformers' (a saved checkpoint)
TINY = {  # XiaomiMiMo/MiMo-V2-Flash at tiny widths (the rope bases and factor are transformers' defaults)
    "add_full_attention_sink_bias": False,
    "add_swa_attention_sink_bias": True,
    "architectures": ["MiMoV2FlashForCausalLM"],
    "attention_bias": False,
    "attention_value_scale": 0.707,
    "head_dim": 96,
    "hidden_act": "silu",
    "hidden_size": 256,
    "hybrid_layer_pattern": [0, 1, 1],
    "intermediate_size": 256,
    "layernorm_epsilon": 1e-05,
    "max_position_embeddings": 262144,
    "model_type": "mimo_v2_flash",
    "moe_intermediate_size": 256,
    "moe_layer_freq": [0, 1, 1],
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": None,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 1,
    "partial_rotary_factor": 0.334,
    "rope_theta": 5000000,
    "routed_scaling_factor": None,
    "scoring_func": "sigmoid",
    "sliding_window": 8,
    "sliding_window_size": 8,
    "swa_head_dim": 96,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_rope_theta": 10000,
    "swa_v_head_dim": 64,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "v_head_dim": 64,
    "vocab_size": 512,
}


def _per_layer(hf: dict, spellings: tuple, layers: int, default) -> list[bool]:
    """Which layers are of a kind, by the first of `spellings` ((key, {value: of the kind?}), the
    hub's then transformers') config.json has; else `default(layer)`."""
    for key, kinds in spellings:
        values = hf.get(key)
        if values is None:
            continue
        if not (isinstance(values, list) and len(values) == layers and all(v in kinds for v in values)):
            raise ConfigError(f"config.json: {key} is not {layers} of {', '.join(map(repr, kinds))}")
        return [kinds[v] for v in values]
    return [default(i) for i in range(layers)]


def _rope(hf: dict) -> tuple[float, float, float]:
    """(full layers' base, sliding layers' base, partial rotary factor)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # as transformers saves it
        kinds = [params.get(kind) for kind in ("full_attention", "sliding_attention")]
        if not all(isinstance(p, dict) and p.get("rope_type", "default") == "default" for p in kinds):
            raise ConfigError("config.json: rope_parameters other than the default rotation are not supported")
        full, sliding = kinds
        return float(full["rope_theta"]), float(sliding["rope_theta"]), float(full.get("partial_rotary_factor", 1.0))
    if hf.get("rope_scaling"):
        raise ConfigError("config.json: rope_scaling is not supported for MiMo-V2-Flash")
    theta = float(hf.get("rope_theta", 10000.0))
    return theta, float(hf.get("swa_rope_theta", theta)), float(hf.get("partial_rotary_factor", 1.0))


class MiMoV2(Adapter):
    model_types = ("mimo_v2_flash",)
    tiny_models = {"mimo_v2_flash": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.MIMO2
    sinks_leaf = SINK_LEAVES[0]
    skipped_prefixes = ("model.mtp.",)  # the release's multi-token-prediction layers
    gguf_leading_dense = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, layers = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                             "num_hidden_layers")
        for swa, key in (("swa_head_dim", "head_dim"), ("swa_v_head_dim", "v_head_dim"),
                         ("swa_num_attention_heads", "num_attention_heads")):
            if hf.get(swa) is not None and hf[swa] != hf.get(key):
                raise ConfigError(f"config.json: {swa} {hf[swa]!r} differs from {key} {hf.get(key)!r}, not supported")
        if hf.get("n_shared_experts"):
            raise ConfigError(f"config.json: n_shared_experts {hf['n_shared_experts']!r} is not supported (MiMo-V2-Flash has none)")
        if hf.get("add_full_attention_sink_bias"):
            raise ConfigError("config.json: add_full_attention_sink_bias is not supported (MiMo-V2-Flash's full layers have no sinks)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json: scoring_func {hf['scoring_func']!r} is not supported (MiMo-V2-Flash's is sigmoid)")
        # without either spelling, transformers' defaults: the first layer and every sixth full, the first dense
        kinds = _per_layer(hf, (("hybrid_layer_pattern", {0: False, 1: True}),
                                ("layer_types", {"full_attention": False, "sliding_attention": True})),
                           layers, lambda i: i != 0 and (i + 1) % 6 != 0)
        moe = _per_layer(hf, (("moe_layer_freq", {0: False, 1: True}), ("mlp_layer_types", {"dense": False, "sparse": True})),
                         layers, lambda i: i != 0)
        sliding = [i for i in range(layers) if kinds[i]]
        size = hf.get("sliding_window_size")
        window = size + 1 if isinstance(size, int) and size > 0 else hf.get("sliding_window")
        if sliding and not (isinstance(window, int) and window > 0):
            raise ConfigError(f"config.json: sliding_window {hf.get('sliding_window')!r} is not a positive whole number")
        theta, sliding_theta, partial = _rope(hf)
        plain = {**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta, "partial_rotary_factor": partial}
        fields = common_fields(plain, "mimo_v2_flash", self.gguf_arch, windows=True)
        kv_heads = fields["n_kv_heads"]
        return ModelConfig(
            **{**fields, "v_head_dim": require(hf, "v_head_dim")[0],
               "norm_eps": float(hf.get("layernorm_epsilon", hf.get("rms_norm_eps", 1e-5)))},
            attn_bias=bool(hf.get("attention_bias", False)),
            attn_sinks=bool(sliding) and bool(hf.get("add_swa_attention_sink_bias", True)),
            sinks_sliding_only=bool(sliding) and bool(hf.get("add_swa_attention_sink_bias", True)),
            sliding_window=window if sliding else 0,
            sliding_layers=sliding,
            sliding_kv_heads=(hf.get("swa_num_key_value_heads") or 2 * kv_heads) if sliding else 0,
            sliding_rope_theta=sliding_theta if sliding else 0.0,
            value_scale=float(np.float32(hf.get("attention_value_scale") or 1.0)),  # the float32 GGUF keeps
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=[i for i in range(layers) if moe[i]],
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            **sigmoid_routing(hf),
        )

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        tensors = super().layer_tensors(c, layer)
        if c.has_sinks(layer):
            tensors[f"model.layers.{layer}.self_attn.{self.sinks_leaf}"] = (c.n_heads,)
        return tensors

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        if name.startswith("model.layers.") and name.endswith(tuple(f".self_attn.{leaf}" for leaf in SINK_LEAVES)):
            return [ResidentView(f"blk.{name.split('.')[2]}.attn_sinks.weight", None, shape)]
        return super().resident_views(name, shape, c)

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([i in c.sliding_layers for i in range(c.n_layers)])
        if c.sliding_rope_theta:
            writer.add_rope_freq_base_swa(c.sliding_rope_theta)
        if c.value_scale != 1.0:
            writer.add_float32(VALUE_SCALE.format(arch=self.gguf_arch_name), c.value_scale)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        layers = fields["n_layers"]
        pattern = meta.per_layer(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, layers, False)
        kv_heads = meta.per_layer(gguf.Keys.Attention.HEAD_COUNT_KV, layers, fields["n_heads"])
        sliding = [i for i in range(layers) if pattern[i]]
        full_kv = {kv_heads[i] for i in range(layers) if not pattern[i]}
        sliding_kv = {kv_heads[i] for i in sliding}
        sinks = [i for i in range(layers) if f"blk.{i}.attn_sinks.weight" in shapes]
        scale = meta.get(VALUE_SCALE)
        return {"n_kv_heads": full_kv.pop() if len(full_kv) == 1 else kv_heads,  # several: refused by the config check
                "sliding_window": meta.require(gguf.Keys.Attention.SLIDING_WINDOW) if sliding else 0,
                "sliding_layers": sliding,
                "sliding_kv_heads": (sliding_kv.pop() if len(sliding_kv) == 1 else kv_heads) if sliding else 0,
                "sliding_rope_theta": meta.get(gguf.Keys.Rope.FREQ_BASE_SWA, fields["rope_theta"]) if sliding else 0.0,
                "attn_sinks": bool(sinks), "sinks_sliding_only": bool(sinks) and sinks == sliding,
                "value_scale": 1.0 if scale is None else scale,
                "router": "sigmoid", "router_norm_topk": True}

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        if c.router != "sigmoid" or not c.router_norm_topk or c.routed_scaling_factor != 1.0:
            return ["llama.cpp's mimo2 routes by sigmoid, renormalized, unscaled"]
        return []
