"""Synthetic Mixture-of-Experts checkpoints in the exact Hugging Face hub layout.

``write_checkpoint`` writes a folder that looks like a hub repository of a real MoE
architecture (config.json, sharded safetensors + index, tokenizer.json,
tokenizer_config.json, generation_config.json) filled with deterministic random
weights.  Tensor names, shapes and the set of tensors follow what the real hub
checkpoints hold, which is also what ``transformers`` ``save_pretrained`` writes for
the model type (per-expert tensors, Mixtral's ``block_sparse_moe`` prefix, ...).

Only numpy, safetensors' *format* (written by hand, tensor by tensor, so multi-GB
checkpoints need little memory) and the ``tokenizers`` library are used: no torch and
no transformers, so this module ships in the package (``colibri demo``, fast tests,
benchmarks).

Value definition (stable, tests rely on it): the float32 value stream of a tensor part
named ``n`` is the concatenation over ``k = 0, 1, ...`` of
``Generator(PCG64(SeedSequence([seed, *blake2b(n), k]))).standard_normal(CHUNK)``
scaled by the tensor's ``std`` and shifted by its ``mean``.  A fused expert tensor is
the concatenation of the per-expert parts (``experts.E.gate_proj``/``up_proj`` rows,
or ``w1``/``w3`` for Mixtral), so fused and per-expert checkpoints written with the same
seed hold the same expert weights.

Storage: bf16 values are float32 rounded to nearest-even on the high 16 bits; fp8
weights are DeepSeek-V3 style block-quantised e4m3 (128x128 blocks, ``scale_inv =
amax / 448`` stored as F32 in ``<weight>_scale_inv``; dequantised value = e4m3 value
x scale_inv).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pathlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from colibri.formats.checkpoint import E4M3_TO_F32, FP8_BLOCK

__all__ = [
    "ARCHITECTURES",
    "TensorSpec",
    "tiny_config",
    "checkpoint_plan",
    "write_checkpoint",
    "tensor_values",
    "stored_values",
    "build_tokenizer",
    "write_tokenizer_files",
    "fp8_e4m3_to_float32",
    "float32_to_bf16_bits",
    "bf16_bits_to_float32",
    "mtp_layer_indices",
    "GENERATOR_VERSION",
]

ARCHITECTURES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
)

#: bumped whenever the generated values or the file layout change (benchmark stamps)
GENERATOR_VERSION = 1
#: elements per independently seeded random sub-stream (part of the value definition)
CHUNK = 1 << 20
#: default cap of one safetensors shard when a checkpoint is too big for ``shards`` files
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
#: std of the noise added to 1.0 for RMSNorm weights
NORM_NOISE_STD = 0.1
#: std of DeepSeek-V3/GLM ``e_score_correction_bias``
SCORE_BIAS_STD = 0.05
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}

_DTYPES = {
    # name: (safetensors dtype of the weights, bytes per element, config torch_dtype)
    "f32": ("F32", 4, "float32"),
    "f16": ("F16", 2, "float16"),
    "bf16": ("BF16", 2, "bfloat16"),
    "fp8": ("F8_E4M3", 1, "bfloat16"),
}
_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}


# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------

_YARN_DEEPSEEK_V2 = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_YARN_DEEPSEEK_V3 = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_YARN_KIMI_K2 = {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_DEEPSEEK_AUTO_MAP = {
    "v2": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "v3": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
}


def _base_config(arch: str) -> dict:
    """Tiny config with the field names and conventions of the real hub config.json."""
    if arch == "mixtral":  # mistralai/Mixtral-8x7B-v0.1
        return {
            "architectures": ["MixtralForCausalLM"],
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": 256,
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "max_position_embeddings": 32768,
            "model_type": "mixtral",
            "num_attention_heads": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 512,
        }
    if arch == "qwen2_moe":  # Qwen/Qwen1.5-MoE-A2.7B
        return {
            "architectures": ["Qwen2MoeForCausalLM"],
            "attention_dropout": 0.0,
            "decoder_sparse_step": 1,
            "hidden_act": "silu",
            "hidden_size": 256,
            "initializer_range": 0.02,
            "intermediate_size": 512,
            "max_position_embeddings": 8192,
            "max_window_layers": 2,
            "model_type": "qwen2_moe",
            "moe_intermediate_size": 256,
            "norm_topk_prob": False,
            "num_attention_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 512,
        }
    if arch == "qwen3_moe":  # Qwen/Qwen3-30B-A3B (head_dim != hidden/heads, like the real one)
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 256,
            "initializer_range": 0.02,
            "intermediate_size": 512,
            "max_position_embeddings": 40960,
            "max_window_layers": 2,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 512,
        }
    if arch == "olmoe":  # allenai/OLMoE-1B-7B-0924
        return {
            "architectures": ["OlmoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "clip_qkv": None,
            "hidden_act": "silu",
            "hidden_size": 256,
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            "model_type": "olmoe",
            "norm_topk_prob": False,
            "num_attention_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 512,
        }
    if arch == "deepseek_v2":  # deepseek-ai/DeepSeek-V2-Lite (q_lora_rank null -> q_proj)
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": dict(_DEEPSEEK_AUTO_MAP["v2"]),
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
            "rope_scaling": dict(_YARN_DEEPSEEK_V2),
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
    if arch in ("deepseek_v3", "kimi_k2"):  # deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": dict(_DEEPSEEK_AUTO_MAP["v3"]),
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
            "rope_scaling": dict(_YARN_DEEPSEEK_V3),
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
        if arch == "kimi_k2":
            cfg.update(
                {
                    "model_type": "kimi_k2",
                    "max_position_embeddings": 131072,
                    "n_group": 1,
                    "topk_group": 1,
                    "num_nextn_predict_layers": 0,
                    "rope_scaling": dict(_YARN_KIMI_K2),
                    "rope_theta": 50000.0,
                    "routed_scaling_factor": 2.827,
                }
            )
            del cfg["ep_size"]
        return cfg
    if arch == "glm4_moe":  # zai-org/GLM-4.5 (partial rotary, qkv bias, qk-norm, MTP layer)
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "first_k_dense_replace": 1,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 256,
            "initializer_range": 0.02,
            "intermediate_size": 512,
            "max_position_embeddings": 131072,
            "model_type": "glm4_moe",
            "moe_intermediate_size": 256,
            "n_group": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "num_nextn_predict_layers": 1,
            "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "routed_scaling_factor": 2.5,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "use_cache": True,
            "use_qk_norm": True,
            "vocab_size": 512,
        }
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")


def _check_arch(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")


def tiny_config(arch: str, **overrides) -> dict:
    """A complete hub-style ``config.json`` dict for a tiny model of ``arch``.

    Every weight matrix's input dimension is a multiple of 256 (K-quant friendly).
    ``overrides`` replace top-level keys; the special-token ids are derived from the
    synthetic tokenizer for the final ``vocab_size`` unless overridden explicitly.
    """
    _check_arch(arch)
    cfg = _base_config(arch)
    cfg.update(copy.deepcopy(overrides))
    ids = _special_token_config_ids(arch, int(cfg["vocab_size"]))
    for key, value in ids.items():
        if key not in overrides:
            cfg[key] = value
    if "torch_dtype" not in overrides and "dtype" not in overrides:
        cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("transformers_version", "4.57.1")
    return dict(sorted(cfg.items()))


# --------------------------------------------------------------------------------------
# tensor plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint.

    ``parts`` are the value-stream names concatenated (in row-major order) to form the
    tensor; ``kind`` is one of ``linear`` (2-D projection weight, FP8-eligible),
    ``experts`` (fused 3-D expert weight, FP8-eligible), ``embed``, ``head``, ``norm``,
    ``router``, ``gate`` (other tiny gating projections), ``mtp_proj`` (MTP ``eh_proj``),
    ``bias``, ``score_bias`` and ``scale_inv`` (FP8 block scales of ``source``).
    """

    name: str
    shape: tuple
    kind: str
    dtype: str  # safetensors dtype: F32, F16, BF16, F8_E4M3
    std: float = 0.0
    mean: float = 0.0
    parts: tuple = ()
    source: str | None = None  # for scale_inv: the weight tensor name

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * _ST_ITEMSIZE[self.dtype]


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def mtp_layer_indices(config: dict) -> list[int]:
    """Layer indices of the multi-token-prediction layers a checkpoint of ``config`` holds."""
    if config.get("model_type") not in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        return []
    n = int(config.get("num_nextn_predict_layers") or 0)
    base = int(config["num_hidden_layers"])
    return list(range(base, base + n))


def _is_moe_layer(arch: str, cfg: dict, i: int) -> bool:
    if arch in ("mixtral", "olmoe"):
        return True
    if arch in ("qwen2_moe", "qwen3_moe"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        return (
            i not in (cfg.get("mlp_only_layers") or [])
            and int(cfg.get("num_experts") or 0) > 0
            and (i + 1) % step == 0
        )
    # deepseek_v2 / deepseek_v3 / kimi_k2 / glm4_moe
    freq = int(cfg.get("moe_layer_freq") or 1)
    return i >= int(cfg.get("first_k_dense_replace") or 0) and i % freq == 0


class _Planner:
    def __init__(self, arch, cfg, dtype, fused, init_std, router_std):
        self.arch = arch
        self.cfg = cfg
        self.wdt = _DTYPES[dtype][0]
        self.fp8 = dtype == "fp8"
        # tensors that are never FP8 are bf16 in an FP8 checkpoint
        self.odt = "BF16" if self.fp8 else self.wdt
        self.fused = fused
        self.std = float(init_std)
        D = int(cfg["hidden_size"])
        self.router_std = float(router_std) if router_std is not None else 2.0 / math.sqrt(D)
        self.specs: list[TensorSpec] = []

    # -- primitives --------------------------------------------------------------------
    def _add(self, spec: TensorSpec) -> None:
        self.specs.append(spec)

    def linear(self, name, rows, cols, bias=False):
        shape = (int(rows), int(cols))
        if self.fp8:
            self._add(TensorSpec(name + ".weight", shape, "linear", "F8_E4M3", self.std, parts=(name + ".weight",)))
            self._add(
                TensorSpec(
                    name + ".weight_scale_inv",
                    (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)),
                    "scale_inv",
                    "F32",
                    source=name + ".weight",
                )
            )
        else:
            self._add(TensorSpec(name + ".weight", shape, "linear", self.wdt, self.std, parts=(name + ".weight",)))
        if bias:
            self._add(TensorSpec(name + ".bias", (int(rows),), "bias", self.odt, self.std, parts=(name + ".bias",)))

    def plain(self, name, shape, kind, std, mean=0.0, dtype=None):
        self._add(TensorSpec(name, tuple(int(s) for s in shape), kind, dtype or self.odt, std, mean, parts=(name,)))

    def norm(self, name, size):
        self.plain(name + ".weight", (size,), "norm", NORM_NOISE_STD, 1.0)

    # -- blocks ------------------------------------------------------------------------
    def attention(self, p):
        cfg, arch = self.cfg, self.arch
        D = int(cfg["hidden_size"])
        H = int(cfg["num_attention_heads"])
        if arch in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
            nope, rope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
            kv_rank = int(cfg["kv_lora_rank"])
            q_rank = cfg.get("q_lora_rank")
            ab = bool(cfg.get("attention_bias", False))
            if q_rank is None:
                self.linear(p + "self_attn.q_proj", H * (nope + rope), D)
            else:
                self.linear(p + "self_attn.q_a_proj", q_rank, D, bias=ab)
                self.norm(p + "self_attn.q_a_layernorm", q_rank)
                self.linear(p + "self_attn.q_b_proj", H * (nope + rope), q_rank)
            self.linear(p + "self_attn.kv_a_proj_with_mqa", kv_rank + rope, D, bias=ab)
            self.norm(p + "self_attn.kv_a_layernorm", kv_rank)
            self.linear(p + "self_attn.kv_b_proj", H * (nope + vd), kv_rank)
            self.linear(p + "self_attn.o_proj", D, H * vd, bias=ab)
            return
        KV = int(cfg.get("num_key_value_heads") or H)
        hd = _head_dim(cfg)
        if arch == "qwen2_moe":
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        elif arch == "glm4_moe":
            qkv_bias, o_bias = bool(cfg.get("attention_bias", False)), False
        elif arch in ("qwen3_moe", "olmoe"):
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        else:  # mixtral
            qkv_bias = o_bias = False
        self.linear(p + "self_attn.q_proj", H * hd, D, bias=qkv_bias)
        self.linear(p + "self_attn.k_proj", KV * hd, D, bias=qkv_bias)
        self.linear(p + "self_attn.v_proj", KV * hd, D, bias=qkv_bias)
        self.linear(p + "self_attn.o_proj", D, H * hd, bias=o_bias)
        if arch == "qwen3_moe" or (arch == "glm4_moe" and cfg.get("use_qk_norm")):
            self.norm(p + "self_attn.q_norm", hd)
            self.norm(p + "self_attn.k_norm", hd)
        elif arch == "olmoe":
            # OLMoE normalises the whole projection (transformers: hidden_size and
            # hidden_size // heads * kv_heads)
            self.norm(p + "self_attn.q_norm", D)
            self.norm(p + "self_attn.k_norm", D // H * KV)

    def dense_mlp(self, prefix, inter):
        D = int(self.cfg["hidden_size"])
        self.linear(prefix + "gate_proj", inter, D)
        self.linear(prefix + "up_proj", inter, D)
        self.linear(prefix + "down_proj", D, inter)

    def experts(self, prefix, n_exp, inter, mixtral=False):
        D = int(self.cfg["hidden_size"])
        g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        if not self.fused:
            for e in range(n_exp):
                self.linear(f"{prefix}experts.{e}.{g}", inter, D)
                self.linear(f"{prefix}experts.{e}.{u}", inter, D)
                self.linear(f"{prefix}experts.{e}.{d}", D, inter)
            return
        gu_parts = tuple(
            name for e in range(n_exp) for name in (f"{prefix}experts.{e}.{g}.weight", f"{prefix}experts.{e}.{u}.weight")
        )
        dn_parts = tuple(f"{prefix}experts.{e}.{d}.weight" for e in range(n_exp))
        for name, shape, parts in (
            (prefix + "experts.gate_up_proj", (n_exp, 2 * inter, D), gu_parts),
            (prefix + "experts.down_proj", (n_exp, D, inter), dn_parts),
        ):
            self._add(TensorSpec(name, shape, "experts", self.wdt, self.std, parts=parts))
            if self.fp8:
                self._add(
                    TensorSpec(
                        name + "_scale_inv",
                        (shape[0], -(-shape[1] // FP8_BLOCK), -(-shape[2] // FP8_BLOCK)),
                        "scale_inv",
                        "F32",
                        source=name,
                    )
                )

    def mlp(self, p, i):
        cfg, arch = self.cfg, self.arch
        D = int(cfg["hidden_size"])
        if not _is_moe_layer(arch, cfg, i):
            self.dense_mlp(p + "mlp.", int(cfg["intermediate_size"]))
            return
        if arch == "mixtral":
            E = int(cfg["num_local_experts"])
            self.plain(p + "block_sparse_moe.gate.weight", (E, D), "router", self.router_std)
            self.experts(p + "block_sparse_moe.", E, int(cfg["intermediate_size"]), mixtral=True)
            return
        if arch == "olmoe":
            E = int(cfg["num_experts"])
            self.plain(p + "mlp.gate.weight", (E, D), "router", self.router_std)
            self.experts(p + "mlp.", E, int(cfg["intermediate_size"]))
            return
        if arch in ("qwen2_moe", "qwen3_moe"):
            E = int(cfg["num_experts"])
            self.plain(p + "mlp.gate.weight", (E, D), "router", self.router_std)
            self.experts(p + "mlp.", E, int(cfg["moe_intermediate_size"]))
            if arch == "qwen2_moe":
                self.dense_mlp(p + "mlp.shared_expert.", int(cfg["shared_expert_intermediate_size"]))
                self.plain(p + "mlp.shared_expert_gate.weight", (1, D), "gate", self.std)
            return
        # deepseek_v2 / deepseek_v3 / kimi_k2 / glm4_moe
        E = int(cfg["n_routed_experts"])
        inter = int(cfg["moe_intermediate_size"])
        self.plain(p + "mlp.gate.weight", (E, D), "router", self.router_std)
        if arch != "deepseek_v2":
            self.plain(p + "mlp.gate.e_score_correction_bias", (E,), "score_bias", SCORE_BIAS_STD, dtype="F32")
        self.experts(p + "mlp.", E, inter)
        n_shared = int(cfg.get("n_shared_experts") or 0)
        if n_shared:
            self.dense_mlp(p + "mlp.shared_experts.", inter * n_shared)

    def decoder_layer(self, i):
        p = f"model.layers.{i}."
        D = int(self.cfg["hidden_size"])
        self.norm(p + "input_layernorm", D)
        self.attention(p)
        self.norm(p + "post_attention_layernorm", D)
        self.mlp(p, i)

    def build(self) -> list[TensorSpec]:
        cfg = self.cfg
        D, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        self.plain("model.embed_tokens.weight", (V, D), "embed", self.std)
        for i in range(int(cfg["num_hidden_layers"])):
            self.decoder_layer(i)
        self.norm("model.norm", D)
        if not cfg.get("tie_word_embeddings", False):
            self.plain("lm_head.weight", (V, D), "head", self.std)
        for i in mtp_layer_indices(cfg):
            # DeepSeek-V3 / GLM-4.5 multi-token-prediction layer: a full decoder layer plus
            # its own embedding, projections and shared head (eh_proj stays bf16 in the
            # FP8 hub checkpoints, like the embeddings and the head)
            p = f"model.layers.{i}."
            self.plain(p + "embed_tokens.weight", (V, D), "embed", self.std)
            self.norm(p + "enorm", D)
            self.norm(p + "hnorm", D)
            self.plain(p + "eh_proj.weight", (D, 2 * D), "mtp_proj", self.std)
            self.decoder_layer(i)
            self.norm(p + "shared_head.norm", D)
            self.plain(p + "shared_head.head.weight", (V, D), "head", self.std)
        return self.specs


def _resolve_config(arch: str, config: dict | None) -> dict:
    _check_arch(arch)
    cfg = tiny_config(arch) if config is None else copy.deepcopy(config)
    mt = cfg.get("model_type")
    if mt is not None and mt != arch:
        raise ValueError(f"config model_type {mt!r} does not match architecture {arch!r}")
    cfg["model_type"] = arch
    return cfg


def checkpoint_plan(
    arch: str,
    config: dict | None = None,
    *,
    dtype: str = "bf16",
    fused_experts: bool = False,
    init_std: float = 0.02,
    router_std: float | None = None,
) -> list[TensorSpec]:
    """Every tensor ``write_checkpoint`` writes for these arguments, in file order."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    cfg = _resolve_config(arch, config)
    specs = _Planner(arch, cfg, dtype, fused_experts, init_std, router_std).build()
    names = [s.name for s in specs]
    if len(set(names)) != len(names):  # pragma: no cover - planner invariant
        raise AssertionError("duplicate tensor names in plan")
    return specs


# --------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------


def _name_key(seed: int, name: str) -> list[int]:
    h = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    return [int(seed)] + [int.from_bytes(h[i : i + 4], "little") for i in range(0, 16, 4)]


def _normal_chunk(key: list[int], k: int, n: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key + [k])))
    return rng.standard_normal(n, dtype=np.float32)


def _part_range(seed: int, name: str, total: int, start: int, stop: int) -> np.ndarray:
    """Standard normal values [start, stop) of the stream of part ``name`` (``total`` long)."""
    key = _name_key(seed, name)
    out = []
    k0, k1 = start // CHUNK, (stop - 1) // CHUNK
    for k in range(k0, k1 + 1):
        base = k * CHUNK
        z = _normal_chunk(key, k, min(CHUNK, total - base))
        out.append(z[max(start - base, 0) : stop - base])
    return out[0] if len(out) == 1 else np.concatenate(out)


def _affine(z: np.ndarray, spec: TensorSpec) -> np.ndarray:
    if spec.std != 1.0:
        z *= np.float32(spec.std)
    if spec.mean:
        z += np.float32(spec.mean)
    return z


def tensor_values(spec: TensorSpec, seed: int = 0) -> np.ndarray:
    """Float32 values of a (non scale_inv) tensor before storage rounding/quantisation."""
    if spec.kind == "scale_inv":
        raise ValueError("scale_inv tensors are derived from their weight; use stored_values")
    part_len = spec.numel // len(spec.parts)
    z = np.concatenate([_part_range(seed, p, part_len, 0, part_len) for p in spec.parts])
    return _affine(z, spec).reshape(spec.shape)


def stored_values(spec: TensorSpec, seed: int = 0, plan: list[TensorSpec] | None = None) -> np.ndarray:
    """What a correct reader decodes from the file for ``spec`` (float32).

    bf16/f16 rounding and FP8 quantisation applied; for FP8 weights this is the raw e4m3
    value (multiply by the scale_inv blocks to dequantise); for ``scale_inv`` the block
    scales (``plan`` is then needed to find the source weight).
    """
    if spec.kind == "scale_inv":
        if plan is None:
            raise ValueError("stored_values of a scale_inv tensor needs the plan")
        src = next(s for s in plan if s.name == spec.source)
        _, scales = _fp8_quantize_tensor(tensor_values(src, seed))
        return scales
    x = tensor_values(spec, seed)
    if spec.dtype == "F32":
        return x
    if spec.dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    if spec.dtype == "BF16":
        return bf16_bits_to_float32(float32_to_bf16_bits(x))
    codes, _ = _fp8_quantize_tensor(x)
    return fp8_e4m3_to_float32(codes)


# --------------------------------------------------------------------------------------
# number formats
# --------------------------------------------------------------------------------------


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest-even), returned as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).copy()
    _bf16_round_inplace(u)
    return u.astype(np.uint16)


def _bf16_round_inplace(u: np.ndarray) -> None:
    """``u`` (uint32 view of float32) becomes its bf16 bits in the low 16 bits."""
    t = u >> 16
    t &= 1
    t += 0x7FFF
    u += t
    u >>= 16


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp8_e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """Decode float8 e4m3fn byte codes (uint8) to float32 (0x7F/0xFF are NaN)."""
    return E4M3_TO_F32[np.asarray(codes, dtype=np.uint8)]


def _encode_e4m3(q: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] -> e4m3fn codes, round to nearest even (= torch's cast)."""
    a = np.abs(q).astype(np.float32)
    u = a.view(np.uint32).copy()
    t = (u >> 20) & 1  # round the float32 mantissa to 3 bits, ties to even
    t += 0x7FFFF
    u += t
    u >>= 20
    normal = u.astype(np.int32)
    normal -= (127 - 7) << 3  # rebias the exponent: code = (exp - 120) << 3 | mantissa
    np.clip(normal, 0, 0x7E, out=normal)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)  # subnormals: multiples of 2**-9
    codes = np.where(a < np.float32(2.0**-6), sub, normal).astype(np.uint8)
    codes |= np.signbit(q).astype(np.uint8) << 7
    return codes


def _fp8_quantize_2d(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise a [rows, cols] float32 matrix: (e4m3 codes, F32 scale_inv blocks)."""
    rows, cols = x.shape
    R, C = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    xp = np.zeros((R * FP8_BLOCK, C * FP8_BLOCK), dtype=np.float32)
    xp[:rows, :cols] = x
    blocks = xp.reshape(R, FP8_BLOCK, C, FP8_BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = (amax / np.float32(448.0)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = (blocks / scale[:, None, :, None]).reshape(R * FP8_BLOCK, C * FP8_BLOCK)[:rows, :cols]
    return _encode_e4m3(q), scale


def _fp8_quantize_tensor(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim == 2:
        return _fp8_quantize_2d(x)
    pairs = [_fp8_quantize_2d(m) for m in x]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------

_PARAGRAPH = (
    "The river town woke slowly on the first cold morning of autumn. Fishermen pulled their boats "
    "onto the gravel bank, and the baker opened the green shutters of her small shop before the sun "
    "had cleared the hills. Children ran along the stone wall by the water, counting the ducks and the "
    "gulls, while their parents argued gently about the price of apples, the weather, and the new bridge "
    "that the council had promised for many years. An old teacher sat on a wooden bench near the market "
    "and read a thick book about the history of mountains, rivers, forests and the people who had lived "
    "beside them. She liked to say that every valley remembers the names of those who worked in it, and "
    "that a patient listener can still hear those names in the wind. In the afternoon the clouds gathered "
    "over the northern ridge, and a steady rain began to fall on the roofs, the gardens and the empty road. "
    "The shopkeepers brought their tables inside, the cats found dry corners under the stairs, and the "
    "whole town settled into a quiet rhythm of tea, conversation and small chores. A young engineer who had "
    "arrived that week walked across the square with a notebook full of measurements. He was thinking about "
    "numbers, about the weight of steel and the strength of stone, about water moving under a bridge in "
    "spring when the snow melts in the high meadows. He stopped to ask the teacher for directions to the "
    "library, and she told him that the library was closed on Mondays, but that the station master kept a "
    "fine collection of maps and would gladly show them to anyone who asked politely. They talked for an "
    "hour about floods, harvests, trains, music and the strange habits of migrating birds. When the rain "
    "finally stopped, the evening light turned the river into a ribbon of copper and gold, and the engineer "
    "wrote a single sentence at the top of a clean page: build something that will still be useful when "
    "nobody remembers who built it. Later, in the warm kitchen of the inn, travellers shared bread, cheese, "
    "soup and stories. A merchant described the busy harbour cities of the south, where ships arrive every "
    "hour with spices, cloth, timber and machines. A musician tuned an old violin and played three slow "
    "songs and one fast dance, and everyone clapped and laughed. Outside, the stars appeared one by one "
    "above the dark water, and the town fell asleep, waiting for another ordinary, remarkable day."
)
#: at most this many BPE merges (the paragraph supports ~690)
MAX_MERGES = 400

_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TULU_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
_KIMI_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)
_GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# specials: listed in id order; front=True puts them at ids 0.., else after the BPE vocab.
# cfg_*: which token the config's bos/eos/pad ids name (eos may be a list).
# "deepseek_back" (V2) is "deepseek" with the special tokens after the BPE vocab.
_TOKENIZER_FAMILIES = {
    "llama": dict(
        specials=["<unk>", "<s>", "</s>"], front=True, bos="<s>", eos="</s>", pad=None, unk="<unk>",
        add_bos=True, template=_LLAMA_TEMPLATE,
        cfg_bos="<s>", cfg_eos="</s>", cfg_pad=None, gen_eos="</s>",
    ),
    "chatml": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], front=False,
        bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=_CHATML_TEMPLATE,
        cfg_bos="<|endoftext|>", cfg_eos="<|im_end|>", cfg_pad=None, gen_eos=["<|im_end|>", "<|endoftext|>"],
    ),
    "olmoe": dict(
        specials=["<|endoftext|>", "<|padding|>", "<|user|>", "<|assistant|>", "<|system|>"], front=False,
        bos="<|endoftext|>", eos="<|endoftext|>", pad="<|padding|>", unk=None, add_bos=False,
        template=_TULU_TEMPLATE,
        cfg_bos=None, cfg_eos="<|endoftext|>", cfg_pad="<|padding|>", gen_eos="<|endoftext|>",
    ),
    "deepseek": dict(
        specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"], front=True,
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", unk=None,
        add_bos=True, template=_DEEPSEEK_TEMPLATE,
        cfg_bos="<｜begin▁of▁sentence｜>", cfg_eos="<｜end▁of▁sentence｜>", cfg_pad=None,
        gen_eos="<｜end▁of▁sentence｜>",
    ),
    "kimi": dict(
        specials=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                  "<|im_middle|>"],
        front=False, bos="[BOS]", eos="<|im_end|>", pad="[EOS]", unk=None, add_bos=False,
        template=_KIMI_TEMPLATE,
        cfg_bos="[BOS]", cfg_eos="[EOS]", cfg_pad=None, gen_eos="<|im_end|>",
    ),
    "glm": dict(
        specials=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>"],
        front=False, bos="[gMASK]", eos="<|endoftext|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=_GLM_TEMPLATE,
        cfg_bos=None, cfg_eos=["<|endoftext|>", "<|user|>", "<|observation|>"], cfg_pad="<|endoftext|>",
        gen_eos=["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
}
_TOKENIZER_FAMILIES["deepseek_back"] = {**_TOKENIZER_FAMILIES["deepseek"], "front": False}

_ARCH_TOKENIZER = {
    "mixtral": "llama",
    "qwen2_moe": "chatml",
    "qwen3_moe": "chatml",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek_back",
    "deepseek_v3": "deepseek",
    "kimi_k2": "kimi",
    "glm4_moe": "glm",
}


def _tokenizer_layout(arch: str, vocab_size: int) -> tuple[dict, int, dict[str, int]]:
    fam = _TOKENIZER_FAMILIES[_ARCH_TOKENIZER[arch]]
    specials = fam["specials"]
    n_merges = min(MAX_MERGES, vocab_size - 256 - len(specials))
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} too small for 256 byte tokens + {len(specials)} specials")
    first = 0 if fam["front"] else 256 + n_merges
    return fam, n_merges, {tok: first + i for i, tok in enumerate(specials)}


def _special_token_config_ids(arch: str, vocab_size: int) -> dict:
    fam, _, ids = _tokenizer_layout(arch, vocab_size)

    def resolve(v):
        if v is None:
            return None
        if isinstance(v, list):
            return [ids[t] for t in v]
        return ids[v]

    out = {"bos_token_id": resolve(fam["cfg_bos"]), "eos_token_id": resolve(fam["cfg_eos"])}
    if arch in ("olmoe", "glm4_moe") or fam["cfg_pad"] is not None:
        out["pad_token_id"] = resolve(fam["cfg_pad"])
    return out


@lru_cache(maxsize=32)
def _tokenizer_json(arch: str, vocab_size: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    fam, n_merges, ids = _tokenizer_layout(arch, vocab_size)
    specials = fam["specials"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merges + (len(specials) if fam["front"] else 0),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials] if fam["front"] else [],
    )
    tok.train_from_iterator([_PARAGRAPH], trainer=trainer)
    if not fam["front"]:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for t, i in ids.items():
        if tok.token_to_id(t) != i:  # pragma: no cover - layout invariant
            raise AssertionError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    if fam["add_bos"]:
        bos = fam["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() > vocab_size:  # pragma: no cover - layout invariant
        raise AssertionError("tokenizer larger than vocab_size")
    return tok.to_str(pretty=True)


def build_tokenizer(arch: str, vocab_size: int | None = None):
    """The synthetic ``tokenizers.Tokenizer`` for ``arch`` (byte-level BPE, deterministic)."""
    from tokenizers import Tokenizer

    _check_arch(arch)
    if vocab_size is None:
        vocab_size = int(tiny_config(arch)["vocab_size"])
    return Tokenizer.from_str(_tokenizer_json(arch, int(vocab_size)))


def write_tokenizer_files(out_dir, arch: str, config: dict) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    _check_arch(arch)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int(config["vocab_size"])
    fam, _, ids = _tokenizer_layout(arch, vocab_size)
    (out / "tokenizer.json").write_text(_tokenizer_json(arch, vocab_size), encoding="utf-8")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    tok_cfg = {
        "add_bos_token": fam["add_bos"],
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": fam["bos"],
        "chat_template": fam["template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": fam["eos"],
        "model_max_length": int(config.get("max_position_embeddings") or 4096),
        "pad_token": fam["pad"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": fam["unk"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
    gen_eos = fam["gen_eos"]
    gen = {
        "_from_model_config": True,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": [ids[t] for t in gen_eos] if isinstance(gen_eos, list) else ids[gen_eos],
        "transformers_version": config.get("transformers_version", "4.57.1"),
    }
    if config.get("pad_token_id") is not None:
        gen["pad_token_id"] = config["pad_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", "utf-8")


# --------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------


def _assign_shards(specs: list[TensorSpec], shards: int, max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    total = sum(s.nbytes for s in specs)
    cap = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else int(max_shard_bytes)
    n = max(1, min(int(shards), len(specs)))
    if max_shard_bytes is None and total <= n * cap:
        # balanced split into ``shards`` files by cumulative size
        target = total / n
        groups: list[list[TensorSpec]] = [[] for _ in range(n)]
        cum = 0
        for s in specs:
            idx = min(n - 1, int((cum + s.nbytes / 2) / target)) if target else 0
            groups[idx].append(s)
            cum += s.nbytes
        return [g for g in groups if g]
    # greedy, every shard at most ``cap`` bytes (a single larger tensor gets its own)
    groups, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > cap:
            groups.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        groups.append(cur)
    return groups


def _header_bytes(group: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in group:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _encode_plain(z: np.ndarray, spec: TensorSpec) -> np.ndarray:
    z = _affine(z, spec)
    if spec.dtype == "F32":
        return z
    if spec.dtype == "F16":
        return z.astype(np.float16)
    u = z.view(np.uint32)
    _bf16_round_inplace(u)
    return u.astype(np.uint16)


class _Writer:
    def __init__(self, seed: int, workers: int):
        self.seed = int(seed)
        self.workers = max(1, int(workers))
        self.pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None
        self.scales: dict[str, np.ndarray] = {}

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()

    def _map_ordered(self, fn, items):
        """fn over items, results in order; bounded number in flight."""
        if self.pool is None or len(items) <= 1:
            for it in items:
                yield fn(it)
            return
        window: deque = deque()
        it = iter(items)
        for item in it:
            window.append(self.pool.submit(fn, item))
            if len(window) >= 2 * self.workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def write_tensor(self, f, spec: TensorSpec) -> None:
        if spec.kind == "scale_inv":
            scales = self.scales.pop(spec.source)
            assert scales.shape == spec.shape, (scales.shape, spec.shape)
            f.write(np.ascontiguousarray(scales, dtype="<f4").tobytes())
            return
        part_len = spec.numel // len(spec.parts)
        if spec.dtype == "F8_E4M3":
            self._write_fp8(f, spec, part_len)
            return
        jobs = []
        for p in spec.parts:
            key = _name_key(self.seed, p)
            for k in range(-(-part_len // CHUNK)):
                jobs.append((key, k, min(CHUNK, part_len - k * CHUNK)))

        def work(job):
            key, k, n = job
            return _encode_plain(_normal_chunk(key, k, n), spec)

        for arr in self._map_ordered(work, jobs):
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))

    def _write_fp8(self, f, spec: TensorSpec, part_len: int) -> None:
        # matrices: 2-D weight -> itself; fused [E, R, C] -> E matrices, each made of
        # len(parts)/E consecutive parts
        if len(spec.shape) == 2:
            mats, (rows, cols) = 1, spec.shape
        else:
            mats, rows, cols = spec.shape
        parts_per_mat = len(spec.parts) // mats
        rows_per_part = rows // parts_per_mat
        # jobs of whole 128-row blocks, about CHUNK elements each (fewer regenerated chunks)
        step = FP8_BLOCK * max(1, CHUNK // (cols * FP8_BLOCK))
        jobs = []
        for m in range(mats):
            for r0 in range(0, rows, step):
                jobs.append((m, r0, min(rows, r0 + step)))

        def work(job):
            m, r0, r1 = job
            pieces = []
            r = r0
            while r < r1:  # a row block may straddle two parts (e.g. gate/up of one expert)
                pi, pr = divmod(r, rows_per_part)
                take = min(r1 - r, rows_per_part - pr)
                name = spec.parts[m * parts_per_mat + pi]
                pieces.append(_part_range(self.seed, name, part_len, pr * cols, (pr + take) * cols))
                r += take
            x = _affine(pieces[0] if len(pieces) == 1 else np.concatenate(pieces), spec).reshape(r1 - r0, cols)
            return _fp8_quantize_2d(x)

        scale_rows = []
        for codes, scale in self._map_ordered(work, jobs):
            f.write(memoryview(np.ascontiguousarray(codes)).cast("B"))
            scale_rows.append(scale)
        scales = np.concatenate(scale_rows, axis=0)
        if mats > 1:
            scales = scales.reshape(mats, -1, scales.shape[-1])
        self.scales[spec.name] = scales


def _clear_weights(out: pathlib.Path) -> None:
    stale = list(out.glob("model*.safetensors")) + list(out.glob("model*.safetensors.partial"))
    for p in stale + [out / "model.safetensors.index.json"]:
        if p.is_file():
            p.unlink()


def write_checkpoint(
    out_dir,
    arch: str,
    *,
    config: dict | None = None,
    dtype: str = "bf16",
    fused_experts: bool = False,
    shards: int = 2,
    seed: int = 0,
    init_std: float = 0.02,
    router_std: float | None = None,
    max_shard_bytes: int | None = None,
    workers: int | None = None,
) -> pathlib.Path:
    """Write a hub-layout checkpoint of ``arch`` with deterministic random weights.

    ``dtype``: ``f32``, ``f16``, ``bf16`` or ``fp8`` (DeepSeek-V3 style block FP8 for the
    linear weights, bf16 elsewhere, ``quantization_config`` in config.json).
    ``fused_experts``: experts as ``experts.gate_up_proj`` [E, 2I, D] /
    ``experts.down_proj`` [E, D, I] (transformers-v5 in-memory layout) instead of
    per-expert tensors.  ``shards`` files (balanced by size) unless that would exceed
    ``max_shard_bytes`` (default 2 GB) per file, or when ``max_shard_bytes`` is given,
    then greedy packing.  A single shard is written as ``model.safetensors`` without an
    index, like the hub.  Memory stays bounded: tensors are generated and written chunk
    by chunk (``workers`` threads, default min(4, cpu count)).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    if seed < 0:
        raise ValueError("seed must be non-negative")
    cfg = _resolve_config(arch, config)
    torch_dtype = _DTYPES[dtype][2]
    cfg["torch_dtype"] = torch_dtype
    cfg.pop("dtype", None)
    if dtype == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        cfg.pop("quantization_config", None)
    specs = checkpoint_plan(
        arch, cfg, dtype=dtype, fused_experts=fused_experts, init_std=init_std, router_std=router_std
    )

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n", "utf-8")
    write_tokenizer_files(out, arch, cfg)

    groups = _assign_shards(specs, shards, max_shard_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    writer = _Writer(seed, workers)
    weight_map = {}
    try:
        for fname, group in zip(names, groups):
            tmp = out / (fname + ".partial")
            with open(tmp, "wb") as f:
                f.write(_header_bytes(group))
                for s in group:
                    writer.write_tensor(f, s)
                    weight_map[s.name] = fname
            os.replace(tmp, out / fname)
    finally:
        writer.close()
    if n > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", "utf-8")
    return out
