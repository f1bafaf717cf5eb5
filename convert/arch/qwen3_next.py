"""Qwen3-Next and Qwen3.5-MoE: gated DeltaNet layers between gated full-attention ones.

A DeltaNet layer's token mixer is a linear recurrence (`runtime.deltanet`); an attention
layer's query projection also gives a sigmoid gate per head over its output. Their RMSNorms
are zero-centred (the weight applied is 1 + w): conversion stores 1 + w, as llama.cpp does,
except for the DeltaNet's own gated norm. Qwen3-Next fuses q, k, v and z (and b and a) in one
projection grouped by key head; conversion splits them into Qwen3.5's four, which is how
colibri stores both (llama.cpp's Qwen3.5 names).
"""

import numpy as np

import gguf

from colibri.convert.arch.base import ConfigError, ResidentView, TinyModel, common_fields, require
from colibri.convert.arch.qwen_moe import Qwen2Moe, sparse_layers
from colibri.convert.gguf_source import GGUFError
from colibri.formats.model_config import ModelConfig

TINY_NEXT = {  # Qwen/Qwen3-Next-80B-A3B-Instruct (one attention layer in two, not in four)
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 256,
    "tie_word_embeddings": False,
    "vocab_size": 512,
}
TINY_35 = {  # Qwen/Qwen3.5-35B-A3B's text_config (its model_type qwen3_5_moe_text, an alias)
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_moe",
    "moe_intermediate_size": 256,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "shared_expert_intermediate_size": 256,
    "tie_word_embeddings": False,
    "vocab_size": 512,
}
LAYER_TYPES = ("linear_attention", "full_attention")
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # newer than gguf 0.19's Keys
SSM = gguf.Keys.SSM
MROPE_SECTIONS = [11, 11, 10, 0]  # Qwen3.5's, which llama.cpp's loader requires
LINEAR = "linear_attn"  # the DeltaNet module of a decoder layer
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")


def layer_kinds(hf: dict, layers: int) -> list[str]:
    """Each layer's token mixer: `layer_types`, or every `full_attention_interval`-th full."""
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval", 4)
        if not (isinstance(interval, int) and 0 < interval):
            raise ConfigError(f"config.json: full_attention_interval {interval!r} is not a positive whole number")
        kinds = [LAYER_TYPES[(i + 1) % interval == 0] for i in range(layers)]
    if not (isinstance(kinds, list) and len(kinds) == layers and all(k in LAYER_TYPES for k in kinds)):
        raise ConfigError(f"config.json: layer_types is not {layers} of {', '.join(LAYER_TYPES)}")
    return kinds


class Qwen3Next(Qwen2Moe):
    """Qwen2-MoE's gated shared expert and GGUF keys for it, the rest its own."""

    model_types = ("qwen3_next",)
    tiny_models = {"qwen3_next": TinyModel(TINY_NEXT, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.QWEN3NEXT
    gguf_names = {"ffn_norm": "post_attention_norm"}
    gguf_norm_topk = True
    zero_centred_norms = True  # but the DeltaNet's gated norm's
    skipped_prefixes = ("mtp.",)  # the multi-token-prediction head

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, layers = require(hf, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                             "num_hidden_layers")
        k_heads, v_heads, k_dim, v_dim, kernel = require(hf, "linear_num_key_heads", "linear_num_value_heads",
                                                         "linear_key_head_dim", "linear_value_head_dim",
                                                         "linear_conv_kernel_dim")
        fields = common_fields(hf, self.model_types[0], self.gguf_arch)
        if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
            fields["rope_dim"] = fields["head_dim"] // 4  # transformers' default for these models
        shared = hf.get("shared_expert_intermediate_size") or 0
        kinds = layer_kinds(hf, layers)
        return ModelConfig(
            **fields,
            attn_bias=bool(hf.get("attention_bias", False)),
            attn_output_gate=True,
            qk_norm="head",
            linear_layers=[i for i, kind in enumerate(kinds) if kind == "linear_attention"],
            linear_conv_kernel=kernel,
            linear_k_heads=k_heads,
            linear_v_heads=v_heads,
            linear_k_head_dim=k_dim,
            linear_v_head_dim=v_dim,
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=sparse_layers(hf, layers),
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            router="softmax",
            router_norm_topk=bool(hf.get("norm_topk_prob", True)),
            n_shared_experts=1 if shared else 0,
            shared_expert_ffn=shared,
            shared_expert_gate=bool(shared),
        )

    # --- tensors ----------------------------------------------------------------------

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        tensors = super().layer_tensors(c, layer)
        if c.is_linear_layer(layer):
            p = f"model.layers.{layer}"
            tensors = {n: s for n, s in tensors.items() if ".self_attn." not in n}
            tensors.update(self.linear_attention_tensors(c, f"{p}.{LINEAR}"))
        return tensors

    def attention_tensors(self, c: ModelConfig, p: str, layer: int) -> dict[str, tuple]:
        tensors = super().attention_tensors(c, p, layer)
        tensors[f"{p}.self_attn.q_proj.weight"] = (2 * c.n_heads * c.head_dim, c.hidden_size)  # [query | gate] per head
        return tensors

    def linear_attention_tensors(self, c: ModelConfig, a: str) -> dict[str, tuple]:
        """The DeltaNet module's tensors, `a` its prefix."""
        d, heads, values = c.hidden_size, c.linear_v_heads, c.linear_v_heads * c.linear_v_head_dim
        return {f"{a}.in_proj_qkvz.weight": (c.linear_conv_channels + values, d), f"{a}.in_proj_ba.weight": (2 * heads, d),
                **self.common_linear_tensors(c, a)}

    @staticmethod
    def common_linear_tensors(c: ModelConfig, a: str) -> dict[str, tuple]:
        heads, values = c.linear_v_heads, c.linear_v_heads * c.linear_v_head_dim
        return {f"{a}.conv1d.weight": (c.linear_conv_channels, 1, c.linear_conv_kernel), f"{a}.dt_bias": (heads,),
                f"{a}.A_log": (heads,), f"{a}.norm.weight": (c.linear_v_head_dim,),
                f"{a}.out_proj.weight": (c.hidden_size, values)}

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        p = f"blk.{name.split('.')[2]}." if name.startswith("model.layers.") else ""
        split = self.split_projection(name, shape, c)
        if split is not None:
            return split
        if name.endswith(f".{LINEAR}.A_log"):  # stored as llama.cpp does: A = -exp(A_log)
            return [ResidentView(p + "ssm_a", None, shape, transform="neg_exp")]
        if name.endswith(f".{LINEAR}.dt_bias"):
            return [ResidentView(p + "ssm_dt.bias", None, shape)]
        if name.endswith(f".{LINEAR}.conv1d.weight"):
            return [ResidentView(p + "ssm_conv1d.weight", None, (shape[0], shape[2]))]
        views = super().resident_views(name, shape, c)
        if name.endswith(ZERO_CENTRED) or name == "model.norm.weight":
            return [view._replace(transform="plus_one") for view in views]
        return views

    # --- GGUF ---------------------------------------------------------------------------

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        n, file = fields["n_layers"], meta.file
        recurrent = meta.source.get(RECURRENT_LAYERS.format(arch=meta.arch))
        if recurrent is None:
            interval = meta.get(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL, 4)
            if not (isinstance(interval, int) and interval > 0):
                raise GGUFError(f"{file}: {meta.arch}.full_attention_interval is {interval!r}, not a positive whole number")
            linear = [i for i in range(n) if (i + 1) % interval]
        elif isinstance(recurrent, list) and len(recurrent) >= n and all(isinstance(r, bool) for r in recurrent):
            linear = [i for i in range(n) if recurrent[i]]
        else:
            raise GGUFError(f"{file}: {RECURRENT_LAYERS.format(arch=meta.arch)} is not a true or false for each of {n} layers")
        v_heads, inner = meta.require(SSM.TIME_STEP_RANK), meta.require(SSM.INNER_SIZE)
        if not (isinstance(v_heads, int) and isinstance(inner, int) and v_heads > 0 and inner % v_heads == 0):
            raise GGUFError(f"{file}: {meta.arch}.ssm.inner_size {inner!r} is not a multiple of ssm.time_step_rank {v_heads!r}")
        shared = super().from_gguf(meta, shapes, fields)
        return {**shared, "shared_expert_gate": bool(shared["n_shared_experts"]),
                "qk_norm": "head", "attn_output_gate": True, "linear_layers": linear,
                "linear_conv_kernel": meta.require(SSM.CONV_KERNEL), "linear_k_heads": meta.require(SSM.GROUP_COUNT),
                "linear_v_heads": v_heads, "linear_k_head_dim": meta.require(SSM.STATE_SIZE),
                "linear_v_head_dim": inner // v_heads, "linear_v_tiled": self.gguf_arch == gguf.MODEL_ARCH.QWEN35MOE}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        super().to_gguf(writer, c)
        writer.add_ssm_conv_kernel(c.linear_conv_kernel)
        writer.add_ssm_state_size(c.linear_k_head_dim)
        writer.add_ssm_group_count(c.linear_k_heads)
        writer.add_ssm_time_step_rank(c.linear_v_heads)
        writer.add_ssm_inner_size(c.linear_v_heads * c.linear_v_head_dim)
        writer.add_array(RECURRENT_LAYERS.format(arch=self.gguf_arch_name), [c.is_linear_layer(i) for i in range(c.n_layers)])

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if c.linear_k_head_dim != c.linear_v_head_dim:
            problems.append(f"llama.cpp's {self.gguf_arch_name} has DeltaNet keys and values of one width, not "
                            f"{c.linear_k_head_dim} and {c.linear_v_head_dim}")
        if c.linear_v_tiled != (self.gguf_arch == gguf.MODEL_ARCH.QWEN35MOE) and c.linear_k_heads != c.linear_v_heads:
            problems.append(f"its value heads are not in llama.cpp's {self.gguf_arch_name} order")
        if not c.shared_expert_gate:
            problems.append(f"llama.cpp's {self.gguf_arch_name} has a gated shared expert")
        return problems

    def gguf_joined(self, c: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
        """llama.cpp's Qwen3-Next keeps b and a in one ssm_ba, [b (r rows), a (r rows)] per key head."""
        ratio = c.linear_v_heads // c.linear_k_heads
        return {f"blk.{i}.ssm_ba.weight": [(f"blk.{i}.ssm_{part}.weight", g * ratio, ratio)
                                           for g in range(c.linear_k_heads) for part in ("beta", "alpha")]
                for i in c.linear_layers}

    @staticmethod
    def split_projection(name: str, shape: tuple, config: ModelConfig) -> list[ResidentView] | None:
        """Qwen3-Next's fused projections as Qwen3.5's: [q k v z] and [b a] per key head become
        attn_qkv (all q, all k, all v), attn_gate (z), ssm_beta (b) and ssm_alpha (a)."""
        if not name.endswith((f".{LINEAR}.in_proj_qkvz.weight", f".{LINEAR}.in_proj_ba.weight")):
            return None
        p = f"blk.{name.split('.')[2]}."
        k_heads, ratio = config.linear_k_heads, config.linear_v_heads // config.linear_k_heads
        if name.endswith(f".{LINEAR}.in_proj_qkvz.weight"):
            widths = [config.linear_k_head_dim] * 2 + [ratio * config.linear_v_head_dim] * 2
            group = sum(widths)
            starts = np.cumsum([0] + widths)
            part = [np.concatenate([g * group + np.arange(starts[i], starts[i + 1]) for g in range(k_heads)])
                    for i in range(4)]
            qkv = np.concatenate(part[:3])
            return [ResidentView(p + "attn_qkv.weight", None, (qkv.size, shape[1]), rows=tuple(qkv.tolist())),
                    ResidentView(p + "attn_gate.weight", None, (part[3].size, shape[1]), rows=tuple(part[3].tolist()))]
        if name.endswith(f".{LINEAR}.in_proj_ba.weight"):
            beta = np.concatenate([g * 2 * ratio + np.arange(ratio) for g in range(k_heads)])
            return [ResidentView(p + "ssm_beta.weight", None, (beta.size, shape[1]), rows=tuple(beta.tolist())),
                    ResidentView(p + "ssm_alpha.weight", None, (beta.size, shape[1]), rows=tuple((beta + ratio).tolist()))]
        return None


class Qwen35Moe(Qwen3Next):
    """Qwen3.5-MoE: Qwen3-Next's layers with the DeltaNet projections already split, every
    layer MoE; released as a multimodal checkpoint whose text model is read (a vision tower
    beside it is skipped)."""

    model_types = ("qwen3_5_moe",)
    model_type_aliases = ("qwen3_5_moe_text",)  # the released checkpoints' text_config
    tiny_models = {"qwen3_5_moe": TinyModel(TINY_35, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.QWEN35MOE

    def normalize(self, hf: dict) -> ModelConfig:
        config = super().normalize({**hf, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True})
        config.linear_v_tiled = True  # stored in llama.cpp's order
        return config

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        super().to_gguf(writer, c)
        writer.add_rope_dimension_sections(MROPE_SECTIONS)  # a text's positions are the same in each section

    def gguf_joined(self, c: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
        return {}

    def linear_attention_tensors(self, c: ModelConfig, a: str) -> dict[str, tuple]:
        d, heads, values = c.hidden_size, c.linear_v_heads, c.linear_v_heads * c.linear_v_head_dim
        return {f"{a}.in_proj_qkv.weight": (c.linear_conv_channels, d), f"{a}.in_proj_z.weight": (values, d),
                f"{a}.in_proj_b.weight": (heads, d), f"{a}.in_proj_a.weight": (heads, d), **self.common_linear_tensors(c, a)}

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        """Value heads reordered from transformers' (grouped by key head) to llama.cpp's (tiled:
        value head j·K + g is transformers' g·r + j), wherever a tensor has one part per value head."""
        p = f"blk.{name.split('.')[2]}." if name.startswith("model.layers.") else ""
        keys, dv = 2 * c.linear_k_heads * c.linear_k_head_dim, c.linear_v_head_dim
        for leaf, canonical in (("in_proj_b", "ssm_beta"), ("in_proj_a", "ssm_alpha")):
            if name.endswith(f".{LINEAR}.{leaf}.weight"):
                return [ResidentView(p + canonical + ".weight", None, shape, rows=tiled(c, 1))]
        views = super().resident_views(name, shape, c)
        if name.endswith((f".{LINEAR}.in_proj_qkv.weight", f".{LINEAR}.conv1d.weight")):
            rows = tuple(range(keys)) + tuple(keys + i for i in tiled(c, dv))
        elif name.endswith(f".{LINEAR}.in_proj_z.weight"):
            rows = tiled(c, dv)
        elif name.endswith((f".{LINEAR}.A_log", f".{LINEAR}.dt_bias")):
            rows = tiled(c, 1)
        elif name.endswith(f".{LINEAR}.out_proj.weight"):
            return [view._replace(columns=tiled(c, dv)) for view in views]
        else:
            return views
        return [view._replace(rows=rows) for view in views]


def tiled(c: ModelConfig, width: int) -> tuple[int, ...]:
    """Transformers' index of each of llama.cpp's value-head parts of `width` values, in order."""
    k_heads, ratio = c.linear_k_heads, c.linear_v_heads // c.linear_k_heads
    heads = [g * ratio + j for j in range(ratio) for g in range(k_heads)]
    return tuple(h * width + i for h in heads for i in range(width))
