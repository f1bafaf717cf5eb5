"""One validation of a normalized config, and of the tensors it implies, for every reader.

The converter, `colibri verify` and `open_model` all call `config_problems` and
`tensor_problems`: every dimension, count, enum and float of a `ModelConfig` is checked for
type and range, for agreement with the others (heads and KV heads, rotary width and head width,
top-k and experts), and the stored tensor shapes against the shapes the config implies, so no
value in a manifest or a config.json can make a kernel index outside its arrays. The shapes are
named as the runtime reads them (gguf's canonical names, `blk.3.attn_q.weight`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import gguf

from colibri.formats.messages import some
from colibri.formats.model_config import ModelConfig
from colibri.formats.safe_json import is_int

__all__ = ["IMPLEMENTED", "MAX_DIM", "MAX_EXPERTS", "MAX_LAYERS", "config_problems", "expected_expert_shapes", "expected_tensors",
           "tensor_problems"]

MAX_DIM = 1 << 24  # no width or vocabulary of a real model comes near this
MAX_POSITIONS = 1 << 26
MAX_LAYERS = 1 << 12  # layers and experts size the tables a reader builds: bounded tighter
MAX_EXPERTS = 1 << 14
EXPERT_ID_TABLE = "ffn_gate_tid2eid.weight"  # a hash layer's token → experts table (DeepSeek-V4), float32 ids
IMPLEMENTED = {  # what the runtime computes; anything else is refused naming the key
    "attention": ("gqa", "mla", "compressed"),
    "qk_norm": ("none", "head", "full", "weightless"),
    "linear_kind": ("gated_deltanet", "kda"),
    "hidden_act": ("silu",),
    "router": ("softmax", "sigmoid", "sqrtsoftplus"),
    "router_group_score": ("top2_sum", "max"),
    "expert_glu": ("silu", "clamped_swiglu", "clamped_silu"),
    "rope_scaling": ("default", "yarn", "llama3", "factors"),
}
_YARN_NUMBERS = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_LLAMA3_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an architecture's name, as transformers and gguf spell them
MAX_LIST = MAX_LAYERS  # per-layer lists and token-id lists are no longer than this


def _is_finite(value) -> bool:
    """A JSON number a float can hold (an integer of 10**400 digits is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value.bit_length() < 1024 if isinstance(value, int) else math.isfinite(value)


def _field_problem(name: str, kind: str, value) -> str | None:
    """What is wrong with one field's value for its declared type, whatever the architecture."""
    if kind == "str":
        ok = isinstance(value, str) and _NAME.fullmatch(value) is not None
        return None if ok else f"{name} is {_shown(value)}, not a name of 1 to 64 letters, digits or _.-"
    if kind.endswith(" | None") and value is None:
        return None
    kind = kind.removesuffix(" | None")
    if kind == "int":
        ok = is_int(value) and 0 <= value <= MAX_POSITIONS
        return None if ok else f"{name} is {_shown(value)}, not a whole number in 0..{MAX_POSITIONS}"
    if kind == "float":
        return None if _is_finite(value) else f"{name} is {_shown(value)}, not a finite number"
    if kind == "bool":
        return None if isinstance(value, bool) else f"{name} is {_shown(value)}, not true or false"
    if kind == "list[int]":
        ok = isinstance(value, list) and len(value) <= MAX_LIST and all(is_int(i) and 0 <= i <= MAX_POSITIONS for i in value)
        return None if ok else f"{name} is {_shown(value)}, not a list of at most {MAX_LIST} whole numbers in 0..{MAX_POSITIONS}"
    if kind == "dict":
        return None if isinstance(value, dict) else f"{name} is {_shown(value)}, not an object"
    raise TypeError(f"ModelConfig.{name}: no check for its type {kind!r}")


def _are_layers(layers, n_layers: int) -> bool:
    """Whether `layers` is a list of distinct layer indices below `n_layers`, in increasing order."""
    return isinstance(layers, list) and all(is_int(i) for i in layers) and layers == sorted(set(layers)) \
        and all(0 <= i < n_layers for i in layers)


def _shown(value) -> str:
    """A value as an error names it: at most 40 characters of its repr."""
    text = repr(value) if not (is_int(value) and value.bit_length() > 128) else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."


def config_problems(c: ModelConfig) -> list[str]:
    """Everything wrong with `c` on its own, one phrase each naming the field ([] when sound).

    Every field is first checked for its declared type and a range, whether or not the
    architecture uses it; then the fields are checked against each other."""
    problems = [p for f in dataclasses.fields(ModelConfig) if (p := _field_problem(f.name, f.type, getattr(c, f.name)))]
    if isinstance(c.gguf_architecture, str) and _NAME.fullmatch(c.gguf_architecture) \
            and c.gguf_architecture not in gguf.MODEL_ARCH.__members__:
        problems.append(f"gguf_architecture {_shown(c.gguf_architecture)} is not one of gguf's architectures")
    if problems:
        return problems

    def need(ok: bool, text: str) -> bool:
        if not ok:
            problems.append(text)
        return ok

    def dim(name: str, low: int = 1, high: int = MAX_DIM) -> bool:
        value = getattr(c, name)
        return need(is_int(value) and low <= value <= high, f"{name} is {value!r}, not a whole number in {low}..{high}")

    for name in ("vocab_size", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "v_head_dim"):
        dim(name)
    dim("n_layers", 1, MAX_LAYERS)
    dim("max_position_embeddings", 1, MAX_POSITIONS)
    dim("mtp_layers_skipped", 0)
    for name, kinds in IMPLEMENTED.items():
        if name != "rope_scaling":
            value = getattr(c, name)
            need(isinstance(value, str) and value in kinds,
                 f"{name} {value!r} is not implemented (the runtime has {', '.join(kinds)})")
    for name in ("norm_eps", "latent_norm_eps"):
        value = getattr(c, name)
        need(_is_finite(value) and 0 < value < 1, f"{name} is {value!r}, not a number in (0, 1)")
    need(_is_finite(c.rope_theta) and c.rope_theta > 0, f"rope_theta is {c.rope_theta!r}, not a positive number")
    need(c.clip_qkv is None or (_is_finite(c.clip_qkv) and c.clip_qkv > 0), f"clip_qkv is {c.clip_qkv!r}, not a positive number")
    if problems:  # the checks below combine the fields above
        return problems
    need(c.n_heads % c.n_kv_heads == 0, f"n_heads {c.n_heads} is not a multiple of n_kv_heads {c.n_kv_heads}")
    width = c.qk_rope_head_dim if c.attention == "mla" else c.head_dim
    if c.attention == "compressed" and c.index_topk:
        width = min(width, c.index_head_dim) if is_int(c.index_head_dim) else 0
    unrotated = c.attention == "mla" and c.qk_rope_head_dim == 0 and c.rope_dim == 0  # GLM-5-Next's MLA rotates nothing
    need(unrotated or (is_int(c.rope_dim) and 2 <= c.rope_dim <= (width if is_int(width) else 0) and c.rope_dim % 2 == 0),
         f"rope_dim is {c.rope_dim!r}, not an even number of rotated features within the head's {width}")
    if c.attention == "mla":
        for name in ("kv_lora_rank", "qk_nope_head_dim"):
            dim(name)
        dim("qk_rope_head_dim", 0)
        if c.q_lora_rank is not None:
            dim("q_lora_rank")
        if not problems:
            need(c.head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim,
                 f"head_dim {c.head_dim} is not qk_nope_head_dim + qk_rope_head_dim")
            need(c.n_kv_heads == c.n_heads, f"n_kv_heads {c.n_kv_heads} differs from n_heads {c.n_heads} in MLA")
    _check_indexer(c, dim, need)
    _check_compressed(c, dim, need)
    dim("sliding_window", 0, MAX_POSITIONS)
    layers = c.sliding_layers
    need(_are_layers(layers, c.n_layers) and (not layers or c.sliding_window),
         f"sliding_layers {layers!r} are not distinct increasing layers of the {c.n_layers} (with a sliding_window)")
    _check_sliding(c, dim, need)
    _check_chunks(c, dim, need)
    problems += _rope_scaling_problems(c.rope_scaling, c.rope_dim // 2)
    _check_linear(c, dim, need)
    need(not c.attn_output_gate or (c.attention == "gqa" and not c.attn_bias),
         "attn_output_gate needs GQA attention without q/k/v biases")
    _check_moe(c, dim, need)
    for name, ids in (("bos_token_id", [] if c.bos_token_id is None else [c.bos_token_id]), ("eos_token_ids", c.eos_token_ids)):
        need(isinstance(ids, list) and all(is_int(i) and 0 <= i < c.vocab_size for i in ids),
             f"{name} {ids!r} is not a token of the {c.vocab_size}-token vocabulary")
    return problems


def _check_sliding(c: ModelConfig, dim, need) -> None:
    """What the sliding layers have of their own (MiMo-V2-Flash), through `config_problems`' `dim` and `need`."""
    own = c.sliding_kv_heads or c.sliding_rope_theta or c.sinks_sliding_only
    need(not own or (c.attention == "gqa" and bool(c.sliding_layers)),
         "sliding_kv_heads, sliding_rope_theta and sinks_sliding_only need GQA attention with sliding_layers")
    if dim("sliding_kv_heads", 0) and c.sliding_kv_heads:
        need(c.n_heads % c.sliding_kv_heads == 0,
             f"n_heads {c.n_heads} is not a multiple of sliding_kv_heads {c.sliding_kv_heads}")
    need(_is_finite(c.sliding_rope_theta) and c.sliding_rope_theta >= 0,
         f"sliding_rope_theta is {c.sliding_rope_theta!r}, not 0 or a positive number")
    need(not c.sinks_sliding_only or c.attn_sinks, "sinks_sliding_only without attn_sinks")
    need(_is_finite(c.value_scale) and c.value_scale > 0, f"value_scale is {c.value_scale!r}, not a positive number")


def _check_chunks(c: ModelConfig, dim, need) -> None:
    """Llama 4's chunked and position-free layers, its temperature tuning and its weightless q/k
    norms, through `config_problems`' `dim` and `need`."""
    for name in ("chunked_layers", "nope_layers"):
        layers = getattr(c, name)
        need(_are_layers(layers, c.n_layers), f"{name} {layers!r} are not distinct increasing layers of the {c.n_layers}")
    dim("attention_chunk", 0, MAX_POSITIONS)
    need(bool(c.chunked_layers) == bool(c.attention_chunk), "attention_chunk and chunked_layers come together")
    need(not set(c.chunked_layers) & set(c.sliding_layers), "a layer is both in chunked_layers and in sliding_layers")
    need(not c.chunked_layers or c.attention == "gqa", "chunked_layers need GQA attention")
    need(not c.nope_layers or c.attention in ("gqa", "mla"), "nope_layers need GQA or MLA attention")
    dim("attn_temperature_floor", 0, MAX_POSITIONS)
    need(_is_finite(c.attn_temperature_scale) and c.attn_temperature_scale >= 0,
         f"attn_temperature_scale is {c.attn_temperature_scale!r}, not 0 or a positive number")
    need(not c.attn_temperature_scale or (c.attn_temperature_floor > 0 and bool(c.nope_layers)),
         "attn_temperature_scale needs an attn_temperature_floor and nope_layers")
    need(c.qk_norm != "weightless" or c.qk_norm_after_rope, "weightless q/k norms apply after the rotation")
    need(not c.expert_input_scaled or c.n_experts_used == 1,
         f"expert_input_scaled needs one expert a token, not n_experts_used {c.n_experts_used}")


def _check_indexer(c: ModelConfig, dim, need) -> None:
    """DeepSeek sparse attention's fields, through `config_problems`' `dim` and `need`."""
    blocks = dim("index_block", 0, MAX_POSITIONS) and c.index_block
    if not dim("index_topk", 0, MAX_POSITIONS) or not c.index_topk:
        need(c.index_layers == [] and not blocks and not c.index_local_blocks,
             f"index_layers {c.index_layers!r}, index_block or index_local_blocks without an index_topk")
        return
    if blocks:
        _check_block_indexer(c, dim, need)
        return
    need(not c.index_local_blocks, "index_local_blocks without an index_block")
    need(c.attention in ("mla", "compressed") and bool(c.q_lora_rank),
         "an indexer (index_topk) needs MLA or compressed attention with a query LoRA")
    if dim("index_kpool", 0, MAX_POSITIONS) and c.index_kpool:
        need(c.attention == "mla" and c.index_kpool >= 2 and c.index_topk % c.index_kpool == 0,
             f"index_kpool {c.index_kpool} needs MLA and an index_topk {c.index_topk} of whole pools of 2 or more")
    dim("index_heads")
    if dim("index_head_dim") and is_int(c.qk_rope_head_dim):
        need(c.qk_rope_head_dim <= c.index_head_dim and c.qk_rope_head_dim % 2 == 0,
             f"index_head_dim {c.index_head_dim} is narrower than the rotated {c.qk_rope_head_dim}")
    layers = c.index_layers
    if c.attention == "compressed":  # the layers that compress by OVERLAPPING_RATIO
        ratios = c.compress_ratios if isinstance(c.compress_ratios, list) else []
        need(layers == [i for i, ratio in enumerate(ratios) if ratio == OVERLAPPING_RATIO],
             f"index_layers {layers!r} are not the layers of compress ratio {OVERLAPPING_RATIO}")
        return
    attended = [i for i in range(c.n_layers) if i not in c.linear_layers] if isinstance(c.linear_layers, list) else []
    need(isinstance(layers, list) and all(is_int(i) for i in layers) and layers == sorted(set(layers))
         and set(layers) <= set(attended) and layers[:1] == attended[:1],
         f"index_layers {layers!r} are not distinct increasing attention layers of the {c.n_layers}, from the first")


def _check_block_indexer(c: ModelConfig, dim, need) -> None:
    """MiniMax-M3's indexer of blocks, through `config_problems`' `dim` and `need`."""
    need(c.attention == "gqa", "an indexer of blocks (index_block) needs GQA attention")
    need(c.index_heads == c.n_kv_heads, f"index_heads {c.index_heads!r} is not one a key-value head ({c.n_kv_heads})")
    dim("index_local_blocks", 0, c.index_topk)
    if dim("index_head_dim"):
        need(c.rope_dim <= c.index_head_dim, f"index_head_dim {c.index_head_dim} is narrower than the rotated {c.rope_dim}")
    need(_are_layers(c.index_layers, c.n_layers) and not set(c.index_layers) & {*c.sliding_layers, *c.chunked_layers},
         f"index_layers {c.index_layers!r} are not distinct increasing layers of the {c.n_layers}, none windowed")


OVERLAPPING_RATIO = 4  # DeepSeek-V4's compress ratio whose windows overlap and whose layers have an indexer
MAX_SINKHORN_ITERS = 1000


def _check_compressed(c: ModelConfig, dim, need) -> None:
    """DeepSeek-V4's compressed attention, hyper-connections and hash routing, through
    `config_problems`' `dim` and `need`."""
    need(not c.hyper_streams or c.attention in ("mla", "compressed"), "hyper_streams need MLA or compressed attention")
    if c.hyper_streams:
        dim("hyper_streams")
        dim("hyper_sinkhorn_iters", 1, MAX_SINKHORN_ITERS)
        need(_is_finite(c.hyper_eps) and 0 <= c.hyper_eps < 1, f"hyper_eps is {c.hyper_eps!r}, not a number in [0, 1)")
    need(not c.hyper_head_mean or bool(c.hyper_streams), "hyper_head_mean without hyper_streams")
    if c.attention != "compressed":
        need(not c.compress_ratios and not c.hash_layers, "compress_ratios and hash_layers need compressed attention")
        return
    ratios = c.compress_ratios
    if not need(len(ratios) == c.n_layers and all(r <= MAX_DIM for r in ratios),
                f"compress_ratios {ratios!r} are not one ratio per layer"):
        return
    need(c.n_kv_heads == 1 and c.v_head_dim == c.head_dim, "compressed attention has one key-value head, K = V")
    dim("q_lora_rank")
    if dim("output_groups") and is_int(c.n_heads):
        need(c.n_heads % c.output_groups == 0, f"n_heads {c.n_heads} is not a multiple of output_groups {c.output_groups}")
    dim("output_lora_rank")
    need(c.sliding_layers == list(range(c.n_layers)), "compressed attention keeps a window in every layer")
    dim("sliding_window", 1, MAX_POSITIONS)
    need(_is_finite(c.compress_rope_theta) and c.compress_rope_theta > 0,
         f"compress_rope_theta is {c.compress_rope_theta!r}, not a positive number")
    need(not _rope_scaling_problems(c.compress_rope_scaling), f"compress_rope_scaling {c.compress_rope_scaling!r} is unsound")
    need(bool(c.hyper_streams), "compressed attention has hyper_streams")
    hashed = c.hash_layers
    need(all(i in c.moe_layers for i in hashed) and hashed == sorted(set(hashed)),
         f"hash_layers {hashed!r} are not distinct increasing MoE layers")


MAX_CONV_KERNEL = 64  # the DeltaNet convolution's width (4 in every release)


def _check_linear(c: ModelConfig, dim, need) -> None:
    """The gated DeltaNet fields, through `config_problems`' `dim` and `need`."""
    layers = c.linear_layers
    if not need(_are_layers(layers, c.n_layers),
                f"linear_layers {layers!r} are not distinct increasing layers of the {c.n_layers}") or not layers:
        return
    need(c.attention in ("gqa", "mla") and not c.sliding_layers and (not c.index_topk or c.attention == "mla"),
         "linear_layers need GQA or MLA attention without sliding layers, GQA without an indexer")
    dim("linear_conv_kernel", 1, MAX_CONV_KERNEL)
    for name in ("linear_k_heads", "linear_v_heads", "linear_k_head_dim", "linear_v_head_dim"):
        dim(name)
    if is_int(c.linear_k_heads) and is_int(c.linear_v_heads) and c.linear_k_heads > 0:
        need(c.linear_v_heads % c.linear_k_heads == 0,
             f"linear_v_heads {c.linear_v_heads} is not a multiple of linear_k_heads {c.linear_k_heads}")
    if c.linear_kind == "kda":
        need(c.linear_k_heads == c.linear_v_heads and c.linear_k_head_dim == c.linear_v_head_dim,
             "Kimi delta attention has as many value heads as key heads, of one width")
    need(_is_finite(c.linear_gate_lower_bound) and -MAX_DIM <= c.linear_gate_lower_bound <= 0
         and (c.linear_kind == "kda" or not c.linear_gate_lower_bound),
         f"linear_gate_lower_bound is {c.linear_gate_lower_bound!r}, not 0 or a negative number (of Kimi delta attention)")


def _linear_tensors(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A linear layer's token mixer, by canonical name (llama.cpp's Qwen3.5 and kimi-linear names)."""
    d, heads, values = c.hidden_size, c.linear_v_heads, c.linear_v_heads * c.linear_v_head_dim
    if c.linear_kind == "kda":
        width = c.linear_k_head_dim
        return {**{p + f"attn_{x}.weight": (values, d) for x in "qkv"},
                **{p + f"ssm_conv1d_{x}.weight": (values, c.linear_conv_kernel) for x in "qkv"},
                p + "ssm_f_a.weight": (width, d), p + "ssm_f_b.weight": (values, width), p + "ssm_beta.weight": (heads, d),
                p + "ssm_a": (heads,), p + "ssm_dt.bias": (values,), p + "ssm_g_a.weight": (width, d),
                p + "ssm_g_b.weight": (values, width), p + "ssm_norm.weight": (width,), p + "attn_output.weight": (d, values)}
    return {p + "attn_qkv.weight": (c.linear_conv_channels, d), p + "attn_gate.weight": (values, d),
            p + "ssm_beta.weight": (heads, d), p + "ssm_alpha.weight": (heads, d),
            p + "ssm_conv1d.weight": (c.linear_conv_channels, c.linear_conv_kernel), p + "ssm_a": (heads,),
            p + "ssm_dt.bias": (heads,), p + "ssm_norm.weight": (c.linear_v_head_dim,), p + "ssm_out.weight": (d, values)}


def _rope_scaling_problems(scaling, pairs: int = 0) -> list[str]:
    """What is wrong with a rope scaling dict; `pairs`, the rotated pairs a `factors` list has one of each."""
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"rope_scaling is {scaling!r}, not an object"]
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in IMPLEMENTED["rope_scaling"]:
        return [f"rope_scaling type {kind!r} is not implemented (the runtime has {', '.join(IMPLEMENTED['rope_scaling'])})"]
    if kind == "default":
        return []
    if kind == "factors":  # llama.cpp's rope_freqs, as a GGUF import reads it
        factors = scaling.get("factors")
        ok = isinstance(factors, list) and len(factors) == pairs and all(_is_finite(f) and f > 0 for f in factors)
        return [] if ok else [f"rope_scaling factors are not {pairs} positive numbers, one per rotated pair"]
    numbers = _LLAMA3_NUMBERS if kind == "llama3" else _YARN_NUMBERS
    problems = [f"rope_scaling {key} is {scaling[key]!r}, not a finite number"
                for key in numbers if scaling.get(key) is not None and not _is_finite(scaling[key])]
    original = scaling.get("original_max_position_embeddings")
    if not (is_int(original) and 1 <= original <= MAX_POSITIONS):
        problems.append(f"rope_scaling original_max_position_embeddings is {original!r}, not a positive whole number")
    factor = scaling.get("factor")
    if factor is not None and _is_finite(factor) and factor <= 0:
        problems.append(f"rope_scaling factor is {factor!r}, not positive")
    if kind == "llama3":
        low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
        if not (factor is not None and _is_finite(low) and _is_finite(high) and 0 < low <= high):
            problems.append(f"rope_scaling llama3 needs a factor and 0 < low_freq_factor <= high_freq_factor, "
                            f"not {low!r} and {high!r}")
    return problems


def _check_moe(c: ModelConfig, dim, need) -> None:
    """The MoE fields, through `config_problems`' own `dim` and `need`, which record what fails."""
    layers = c.moe_layers
    if not need(_are_layers(layers, c.n_layers), f"moe_layers {layers!r} are not distinct increasing layers of the {c.n_layers}"):
        return
    if len(layers) < c.n_layers:
        dim("dense_ffn")
    if not layers:
        return
    dim("n_experts", 1, MAX_EXPERTS)
    dim("expert_ffn")
    dim("n_experts_used", 1, c.n_experts if is_int(c.n_experts) else 1)
    dim("router_groups", 1, c.n_experts if is_int(c.n_experts) else 1)
    dim("n_shared_experts", 0)
    if is_int(c.n_shared_experts) and c.n_shared_experts:
        dim("shared_expert_ffn")
    if c.expert_glu in ("clamped_swiglu", "clamped_silu"):
        for name in ("swiglu_alpha", "swiglu_limit"):
            need(_is_finite(getattr(c, name)) and getattr(c, name) > 0, f"{name} is {getattr(c, name)!r}, not a positive number")
    need(_is_finite(c.routed_scaling_factor) and c.routed_scaling_factor > 0,
         f"routed_scaling_factor is {c.routed_scaling_factor!r}, not a positive number")
    if all(is_int(v) and v > 0 for v in (c.n_experts, c.router_groups, c.n_experts_used)) and c.router_groups <= c.n_experts:
        if need(c.n_experts % c.router_groups == 0, f"n_experts {c.n_experts} is not a multiple of router_groups {c.router_groups}"):
            if dim("router_topk_groups", 1, c.router_groups):
                kept = c.router_topk_groups * (c.n_experts // c.router_groups)
                need(c.n_experts_used <= kept, f"n_experts_used {c.n_experts_used} is more than the {kept} experts "
                                               f"of router_topk_groups {c.router_topk_groups} groups")


def expected_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor the runtime reads for `c`, by canonical name, with its shape."""
    d = c.hidden_size
    tensors = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,)}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = (c.vocab_size, d)
    if c.hyper_streams and not c.hyper_head_mean:
        s = c.hyper_streams
        tensors.update({"output_hc_fn.weight": (s, s * d), "output_hc_base.weight": (s,), "output_hc_scale.weight": (1,)})
    for layer in range(c.n_layers):
        tensors.update(layer_tensors(c, layer))
    return tensors


def layer_tensors(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The non-expert tensors of decoder layer `layer`, by canonical name, with their shapes."""
    d, p = c.hidden_size, f"blk.{layer}."
    tensors = {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
    if layer in c.linear_layers:
        tensors.update(_linear_tensors(c, p))
    elif c.attention == "compressed":
        tensors.update(_compressed_tensors(c, p, layer))
    else:
        tensors.update(_attention_tensors(c, p, layer))
    if c.hyper_streams and c.attention != "compressed":
        tensors.update(_hyper_tensors(c, p))
    if layer in c.moe_layers:
        tensors[p + "ffn_gate_inp.weight"] = (c.n_experts, d)
        if layer in c.hash_layers:  # expert ids, stored as float32
            tensors[p + EXPERT_ID_TABLE] = (c.vocab_size, c.n_experts_used)
        elif c.router_bias:
            tensors[p + "exp_probs_b.bias"] = (c.n_experts,)
        if c.router_logit_bias:
            tensors[p + "ffn_gate_inp.bias"] = (c.n_experts,)
        if c.expert_bias:  # resident beside the router: a few KB an expert
            tensors.update({p + f"ffn_{m}_exps.bias": (c.n_experts, width)
                            for m, width in (("gate", c.expert_ffn), ("up", c.expert_ffn), ("down", d))})
        if c.n_shared_experts:
            tensors.update(_mlp(p + "ffn_{}_shexp.weight", c.shared_expert_ffn, d))
        if c.shared_expert_gate:
            tensors[p + "ffn_gate_inp_shexp.weight"] = (1, d)
    else:
        tensors.update(_mlp(p + "ffn_{}.weight", c.dense_ffn, d))
    return tensors


def _compressed_tensors(c: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """A DeepSeek-V4 layer's attention and hyper-connections, by llama.cpp's names."""
    d, h, hd = c.hidden_size, c.n_heads, c.head_dim
    tensors = {p + "attn_q_a.weight": (c.q_lora_rank, d), p + "attn_q_a_norm.weight": (c.q_lora_rank,),
               p + "attn_q_b.weight": (h * hd, c.q_lora_rank), p + "attn_kv.weight": (hd, d),
               p + "attn_kv_a_norm.weight": (hd,), p + "attn_sinks.weight": (h,),
               p + "attn_output_a.weight": (c.output_groups * c.output_lora_rank, h * hd // c.output_groups),
               p + "attn_output_b.weight": (d, c.output_groups * c.output_lora_rank)}
    tensors.update(_hyper_tensors(c, p))
    ratio = c.compress_ratios[layer]
    if ratio:
        width = (2 if ratio == OVERLAPPING_RATIO else 1) * hd
        tensors.update(_compressor(p + "attn_compressor_", ratio, width, hd, d))
    if layer in c.index_layers:
        i, w = c.index_heads, c.index_head_dim
        tensors.update(_compressor(p + "indexer_compressor_", OVERLAPPING_RATIO, 2 * w, w, d))
        tensors.update({p + "indexer.attn_q_b.weight": (i * w, c.q_lora_rank), p + "indexer.proj.weight": (i, d)})
    return tensors


def _hyper_tensors(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's hyper-connection weights (attention's, FFN's)."""
    streams = c.hyper_streams
    mixes = (2 + streams) * streams
    return {p + f"hc_{site}_{part}.weight": shape for site in ("attn", "ffn")
            for part, shape in (("fn", (mixes, streams * c.hidden_size)), ("base", (mixes,)), ("scale", (3,)))}


def _compressor(prefix: str, ratio: int, width: int, entry: int, d: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "kv.weight": (width, d), prefix + "gate.weight": (width, d), prefix + "ape.weight": (ratio, width),
            prefix + "norm.weight": (entry,)}


def _attention_tensors(c: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """An attention layer's tensors, by canonical name."""
    d, h = c.hidden_size, c.n_heads
    tensors = {p + "attn_output.weight": (d, h * c.v_head_dim)}
    if c.attn_output_bias:
        tensors[p + "attn_output.bias"] = (d,)
    if c.has_sinks(layer):
        tensors[p + "attn_sinks.weight"] = (h,)
    if c.attention == "mla":
        tensors.update({p + "attn_kv_a_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
                        p + "attn_kv_a_norm.weight": (c.kv_lora_rank,),
                        p + "attn_kv_b.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)})
        if c.q_lora_rank:
            tensors.update({p + "attn_q_a.weight": (c.q_lora_rank, d), p + "attn_q_a_norm.weight": (c.q_lora_rank,),
                            p + "attn_q_b.weight": (h * c.head_dim, c.q_lora_rank)})
        else:
            tensors[p + "attn_q.weight"] = (h * c.head_dim, d)
        if layer in c.index_layers:
            i, w = c.index_heads, c.index_head_dim
            tensors.update({p + "indexer.attn_q_b.weight": (i * w, c.q_lora_rank), p + "indexer.attn_k.weight": (w, d),
                            p + "indexer.k_norm.weight": (w,), p + "indexer.k_norm.bias": (w,),
                            p + "indexer.proj.weight": (i, d)})
            if c.index_kpool:  # the pools' softmax weights: a gate projection and a bias per place in a pool
                tensors.update({p + "indexer_compressor_gate.weight": (w, d),
                                p + "indexer_compressor_ape.weight": (c.index_kpool, w)})
    else:
        kv_heads = c.kv_heads_of(layer)
        q, k, v = h * c.head_dim, kv_heads * c.head_dim, kv_heads * c.v_head_dim
        gated = 2 if c.attn_output_gate else 1  # the gate's rows beside each head's query rows
        tensors.update({p + "attn_q.weight": (gated * q, d), p + "attn_k.weight": (k, d), p + "attn_v.weight": (v, d)})
        if c.attn_bias:
            tensors.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (k,), p + "attn_v.bias": (v,)})
        norms = {"head": (c.head_dim, c.head_dim), "full": (q, k)}.get(c.qk_norm)
        if norms:
            tensors.update({p + "attn_q_norm.weight": (norms[0],), p + "attn_k_norm.weight": (norms[1],)})
        if layer in c.index_layers:  # an indexer of blocks
            i, w = c.index_heads, c.index_head_dim
            tensors.update({p + "indexer.q_proj.weight": (i * w, d), p + "indexer.k_proj.weight": (w, d),
                            p + "indexer.q_norm.weight": (w,), p + "indexer.k_norm.weight": (w,)})
    return tensors


def _mlp(pattern: str, ffn: int, d: int) -> dict[str, tuple[int, int]]:
    return {pattern.format("gate"): (ffn, d), pattern.format("up"): (ffn, d), pattern.format("down"): (d, ffn)}


def expected_expert_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """The shape of each matrix of one routed expert."""
    return {"gate": (c.expert_ffn, c.hidden_size), "up": (c.expert_ffn, c.hidden_size), "down": (c.hidden_size, c.expert_ffn)}


def tensor_problems(c: ModelConfig, shapes: dict[str, tuple], expert_shapes: dict[int, dict[str, tuple]]) -> list[str]:
    """Stored tensors (`shapes`: canonical name → shape; `expert_shapes`: MoE layer → matrix →
    shape) against what the sound config `c` implies."""
    expected = expected_tensors(c)
    problems = []
    missing = [n for n in expected if n not in shapes]
    unexpected = [n for n in shapes if n not in expected]
    misshapen = [f"{n} {list(shapes[n])} (the config implies {list(s)})"
                 for n, s in expected.items() if n in shapes and tuple(shapes[n]) != s]
    for problem, names in (("lacks tensor", missing), ("has unexpected tensor", unexpected), ("has misshapen tensor", misshapen)):
        if names:
            problems.append(f"{problem} {some(names)}")
    if sorted(expert_shapes) != list(c.moe_layers):
        problems.append(f"expert layers {sorted(expert_shapes)}, the config's MoE layers are {list(c.moe_layers)}")
    want = expected_expert_shapes(c)
    for layer, matrices in sorted(expert_shapes.items()):
        wrong = [f"{m} {list(matrices.get(m, ()))}" for m in want if tuple(matrices.get(m, ())) != want[m]]
        if wrong:
            problems.append(f"layer {layer} experts have {', '.join(wrong)}, the config implies "
                            + ", ".join(f"{m} {list(s)}" for m, s in want.items()))
            break
    return problems
