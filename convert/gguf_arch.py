"""GGUF ↔ colibri: llama.cpp's architectures, metadata keys and tensor names.

The generic part; what is particular to one architecture its adapter declares
(`convert.arch`: `gguf_*` attributes, `from_gguf`, `to_gguf`, `gguf_problems`). Our
resident tensors carry gguf's canonical names, so nearly every tensor is its own GGUF
name (GLM-4.5's pre-FFN norm is `post_attention_norm` in llama.cpp, `ffn_norm` in
colibri). What differs, as llama.cpp's converter (`convert_hf_to_gguf.py`, each
model's `set_gguf_parameters` / `modify_tensors`) writes it and its loader
(`src/models/<arch>.cpp`) reads it:

- `general.architecture` and the `{arch}.*` keys ↔ the normalized `ModelConfig`, both
  ways, with llama.cpp's defaults where a key is optional or a behaviour is hard-coded
  (Mixtral renormalises its top-k, Qwen2-MoE does not, ...), so a GGUF made by llama.cpp
  and one made by `colibri export-gguf` both import;
- routed experts stacked per layer, `blk.N.ffn_{gate,up,down}_exps.weight` with shape
  [experts, rows, cols] (expert e is one contiguous slice);
- for `llama` (Mixtral), Q and K rows permuted within each head (`LlamaModel.permute`):
  llama.cpp's rope rotates pairs (2i, 2i+1), transformers' rotates the two halves;
- DeepSeek's `attn_kv_b`, which recent converters store as `attn_k_b` (transposed per
  head) and `attn_v_b`;
- GLM-4.5's multi-token-prediction layers, counted in `block_count` (`nextn_predict_layers`);
- a llama3 rope scaling, which llama.cpp reads as a `rope_freqs` tensor of divisors (imported
  as a `factors` scaling).

GGUF stores float metadata as float32; `f32_value` turns it back into the short decimal a
config.json holds, so a round trip gives the same config.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

import gguf
import numpy as np

from colibri.convert.arch import ADAPTERS, GGUF_ADAPTERS
from colibri.convert.arch.base import Adapter
from colibri.convert.arch.mimo_v2 import VALUE_SCALE
from colibri.convert.gguf_source import ByteReader, GGUFError
from colibri.formats.config_check import MAX_EXPERTS, MAX_LAYERS, config_problems
from colibri.formats.model_config import ModelConfig

K, A, R, T = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.Tokenizer

CHUNK_BYTES = 32 << 20
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors of a llama3 rope scaling
FACTOR_SCALINGS = ("llama3", "factors")  # the rope scalings a rope_freqs tensor carries
_LAYER = re.compile(r"^blk\.(\d+)\.")
_QK = re.compile(r"^blk\.\d+\.attn_(q|k)\.(weight|bias)$")


def f32_value(x: float) -> float:
    """The shortest decimal that is the same float32 (GGUF keeps float metadata as float32)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def expert_tensor_name(layer: int, matrix: str) -> str:
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


def gguf_arch_name(config: ModelConfig) -> str:
    """llama.cpp's `general.architecture` for `config`."""
    return ADAPTERS[config.architecture].gguf_arch_name


def gguf_tensor_name(config: ModelConfig, name: str) -> str:
    """llama.cpp's name for colibri's resident tensor `name`."""
    return ADAPTERS[config.architecture].gguf_name(name)


# --- metadata → ModelConfig -----------------------------------------------------------


# The type each key must have, as llama.cpp's loader checks it (a key of another type is refused,
# not reinterpreted); a key not named here holds whole numbers.
KEY_TYPES = {key: float for key in (A.CLAMP_KQV, A.LAYERNORM_RMS_EPS, K.EXPERT_WEIGHTS_SCALE, R.FREQ_BASE,
                                    R.SCALING_FACTOR, R.SCALING_YARN_LOG_MUL, R.SCALING_YARN_BETA_FAST,
                                    R.SCALING_YARN_BETA_SLOW, R.SCALING_YARN_ATTN_FACTOR)}
KEY_TYPES |= {K.EXPERT_WEIGHTS_NORM: bool, R.SCALING_TYPE: str, A.SLIDING_WINDOW_PATTERN: bool, R.FREQ_BASE_SWA: float,
              VALUE_SCALE: float}
_TYPE_NAMES = {float: "a float", bool: "a bool", str: "a string", int: "an integer"}


def _of_kind(value, kind: type) -> bool:
    """Whether a metadata value is of `kind`, as llama.cpp's loader checks it (a bool is no integer)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


class GGUFMetadata:
    """The `{arch}.*` keys of a GGUF, read with the architecture filled in and each checked for
    its type."""

    def __init__(self, source):
        self.source, self.file = source, source.name
        self.arch = source.get(gguf.Keys.General.ARCHITECTURE)
        if self.arch not in GGUF_ADAPTERS:
            raise GGUFError(f"{self.file}: unsupported architecture {self.arch!r} (supported: {', '.join(GGUF_ADAPTERS)})")
        self.adapter = GGUF_ADAPTERS[self.arch]

    def get(self, template: str, default=None):
        key = template.format(arch=self.arch)
        value = self.source.get(key)
        if value is None:
            return default
        if isinstance(value, list):  # a per-layer array; colibri needs one value for all layers
            if len(set(value)) != 1:
                raise GGUFError(f"{self.file}: {key} differs between layers ({value[:4]}...), not supported")
            value = value[0]
        kind = KEY_TYPES.get(template, int)
        if not _of_kind(value, kind):
            raise GGUFError(f"{self.file}: metadata {key} is {type(value).__name__} {value!r:.40}, not {_TYPE_NAMES[kind]}")
        return value

    def per_layer(self, template: str, layers: int, default) -> list:
        """A key llama.cpp reads per layer: its first `layers` values (one value: for every layer)."""
        key = template.format(arch=self.arch)
        value = self.source.get(key, default)
        values = value if isinstance(value, list) else [value] * layers
        kind = KEY_TYPES.get(template, int)
        if len(values) < layers or not all(_of_kind(v, kind) for v in values):
            raise GGUFError(f"{self.file}: metadata {key} is not {_TYPE_NAMES[kind]} or {layers} of them")
        return values[:layers]

    def require(self, template: str):
        value = self.get(template)
        if value is None:
            raise GGUFError(f"{self.file}: lacks metadata key {template.format(arch=self.arch)}")
        return value


def config_from_gguf(meta: GGUFMetadata, shapes: dict[str, tuple]) -> ModelConfig:
    """The normalized config of a GGUF model from its metadata and which tensors it has."""
    a, file, adapter = meta.arch, meta.file, meta.adapter
    if "token_embd.weight" not in shapes:
        raise GGUFError(f"{file}: lacks tensor token_embd.weight")
    n_experts = meta.get(K.EXPERT_COUNT, 0)
    if not n_experts:
        raise GGUFError(f"{file}: {a} without experts ({a}.expert_count is {n_experts}) is a dense model; colibri runs Mixture-of-Experts models")
    n_layers = meta.require(K.BLOCK_COUNT) - meta.get(K.NEXTN_PREDICT_LAYERS, 0)
    for what, value, limit in (("block_count", n_layers, MAX_LAYERS), ("expert_count", n_experts, MAX_EXPERTS)):
        if not isinstance(value, int) or not 0 < value <= limit:  # they size the tables built below
            raise GGUFError(f"{file}: {a}.{what} gives {value!r}, not a whole number in 1..{limit}")
    hidden, heads = meta.require(K.EMBEDDING_LENGTH), meta.require(A.HEAD_COUNT)
    ffn = meta.get(K.FEED_FORWARD_LENGTH, 0)
    expert_ffn = meta.get(K.EXPERT_FEED_FORWARD_LENGTH) or (ffn if adapter.gguf_ffn_is_expert else None)
    if not expert_ffn:
        raise GGUFError(f"{file}: lacks metadata key {K.EXPERT_FEED_FORWARD_LENGTH.format(arch=a)}")
    head_dim = meta.get(A.KEY_LENGTH, hidden // heads)
    kv_heads = meta.per_layer(A.HEAD_COUNT_KV, n_layers, heads)
    n_shared = meta.get(K.EXPERT_SHARED_COUNT, 0)
    q_norm = shapes.get("blk.0.attn_q_norm.weight")
    eos = [meta.source.get(key) for key in (T.EOS_ID, T.EOT_ID, T.EOM_ID)]
    clip = meta.get(A.CLAMP_KQV)
    fields = {
        "architecture": adapter.model_types[0],
        "gguf_architecture": adapter.gguf_arch.name,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads,  # per layer: the adapter's to read
        "head_dim": head_dim,
        "v_head_dim": meta.get(A.VALUE_LENGTH, head_dim),
        "norm_eps": f32_value(meta.require(A.LAYERNORM_RMS_EPS)),
        "max_position_embeddings": meta.require(K.CONTEXT_LENGTH),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attn_bias": "blk.0.attn_q.bias" in shapes,
        "qk_norm": "none" if q_norm is None else "head" if q_norm[-1] == head_dim else "full",
        "clip_qkv": None if clip is None else f32_value(clip),
        "rope_theta": f32_value(meta.get(R.FREQ_BASE, 10000.0)),
        "rope_dim": meta.get(R.DIMENSION_COUNT, head_dim),
        "rope_interleaved": adapter.gguf_rope_interleaved,  # Q/K of llama are un-permuted: halves, as transformers rotates
        "rope_scaling": rope_scaling(meta, shapes),
        "dense_ffn": 0 if adapter.gguf_ffn_is_expert else ffn,
        "moe_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes],
        "n_experts": n_experts,
        "n_experts_used": meta.require(K.EXPERT_USED_COUNT),
        "expert_ffn": expert_ffn,
        "router": "softmax",
        "router_norm_topk": bool(meta.get(K.EXPERT_WEIGHTS_NORM, adapter.gguf_norm_topk)),
        "router_bias": any(n.endswith(".exp_probs_b.bias") for n in shapes),
        "router_groups": meta.get(K.EXPERT_GROUP_COUNT) or 1,
        "router_topk_groups": meta.get(K.EXPERT_GROUP_USED_COUNT) or 1,
        "router_group_score": "top2_sum",
        "routed_scaling_factor": f32_value(meta.get(K.EXPERT_WEIGHTS_SCALE) or 1.0),
        "n_shared_experts": n_shared,
        "shared_expert_ffn": expert_ffn * n_shared,
        "shared_expert_gate": any(n.endswith(".ffn_gate_inp_shexp.weight") for n in shapes),
        "mtp_layers_skipped": meta.get(K.NEXTN_PREDICT_LAYERS, 0),
        "bos_token_id": meta.source.get(T.BOS_ID),
        "eos_token_ids": list(dict.fromkeys(i for i in eos if i is not None)),
    }
    config = ModelConfig(**{**fields, **adapter.from_gguf(meta, shapes, fields)})
    problems = config_problems(config)
    if problems:
        raise GGUFError(f"{file}: metadata gives a config the runtime cannot use: {problems[0]}"
                        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return config


def rope_scaling(meta: GGUFMetadata, shapes: dict[str, tuple]) -> dict | None:
    """The rope scaling dict (as a config.json has it) from the `rope.scaling.*` keys, or from
    the `rope_freqs` tensor of an architecture whose llama.cpp loader reads one."""
    if ROPE_FREQS in shapes and meta.adapter.gguf_rope_freqs:
        head_dim = meta.get(A.KEY_LENGTH, meta.require(K.EMBEDDING_LENGTH) // meta.require(A.HEAD_COUNT))
        with ByteReader() as reader:
            return rope_scaling_of_factors(meta, meta.source.tensors[ROPE_FREQS], reader,
                                           meta.get(R.DIMENSION_COUNT, head_dim))
    kind = meta.get(R.SCALING_TYPE)
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise GGUFError(f"{meta.file}: rope scaling {kind!r} is not supported (supported: none, yarn)")
    scaling = {"type": "yarn", "factor": f32_value(meta.require(R.SCALING_FACTOR)),
               "original_max_position_embeddings": meta.require(R.SCALING_ORIG_CTX_LEN)}
    for name, key in (("beta_fast", R.SCALING_YARN_BETA_FAST), ("beta_slow", R.SCALING_YARN_BETA_SLOW), ("attention_factor", R.SCALING_YARN_ATTN_FACTOR)):
        if (value := meta.get(key)) is not None:
            scaling[name] = f32_value(value)
    return scaling


# --- ModelConfig → metadata ---------------------------------------------------------


def write_arch_metadata(writer: gguf.GGUFWriter, c: ModelConfig) -> None:
    """Add the `{arch}.*` keys llama.cpp's loader reads for `c` (GGUFError when llama.cpp cannot run `c`)."""
    adapter = ADAPTERS[c.architecture]
    check_expressible(c, adapter)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_vocab_size(c.vocab_size)
    writer.add_feed_forward_length(c.expert_ffn if adapter.gguf_ffn_is_expert else c.dense_ffn)
    writer.add_head_count(c.n_heads)
    if c.attention == "mla" and adapter.gguf_split_kv_b:  # as llama.cpp's converter writes MLA now
        writer.add_head_count_kv([0 if c.is_linear_layer(i) else 1 for i in range(c.n_layers)]
                                 if adapter.gguf_linear_kv_zero else 1)
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.head_dim)
        writer.add_value_length_mla(c.v_head_dim)
    else:  # MLA: llama.cpp's legacy layout, attn_kv_b unsplit (no key_length_mla)
        per_layer = [c.kv_heads_of(i) for i in range(c.n_layers)]
        writer.add_head_count_kv(c.n_heads if c.attention == "mla" else per_layer if c.sliding_kv_heads else c.n_kv_heads)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.v_head_dim)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.rope_dim)
    write_rope_scaling(writer, c)
    if c.clip_qkv is not None:
        writer.add_clamp_kqv(c.clip_qkv)
    writer.add_expert_count(c.n_experts)
    writer.add_expert_used_count(c.n_experts_used)
    writer.add_expert_feed_forward_length(c.expert_ffn)
    writer.add_expert_weights_norm(c.router_norm_topk)
    if c.routed_scaling_factor != 1.0:
        writer.add_expert_weights_scale(c.routed_scaling_factor)
    if c.router_groups > 1:
        writer.add_expert_group_count(c.router_groups)
        writer.add_expert_group_used_count(c.router_topk_groups)
    if adapter.gguf_leading_dense:
        writer.add_leading_dense_block_count(c.moe_layers[0])
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if c.router == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX)
    if adapter.gguf_keeps_mtp:
        writer.add_nextn_predict_layers(0)  # MTP layers were dropped on conversion
    adapter.to_gguf(writer, c)


def check_expressible(c: ModelConfig, adapter: Adapter) -> None:
    """Refuse a config llama.cpp's architecture cannot run as colibri does (one line)."""
    a, problems = adapter.gguf_arch_name, []
    if adapter.gguf_leading_dense:
        if c.moe_layers != list(range(c.moe_layers[0] if c.moe_layers else c.n_layers, c.n_layers)):
            problems.append(f"MoE layers {c.moe_layers} are not all layers after the dense ones")
    elif not adapter.gguf_interleaved_moe and c.moe_layers != list(range(c.n_layers)):
        problems.append(f"llama.cpp's {a} has routed experts in every layer, this model only in {c.moe_layers}")
    if c.rope_interleaved != adapter.gguf_rope_interleaved:
        problems.append(f"its rope {'rotates pairs' if c.rope_interleaved else 'rotates halves'}, llama.cpp's {a} does not")
    scaling = c.rope_scaling or {}
    if scaling.get("mscale") and scaling.get("mscale_all_dim") and scaling["mscale"] != scaling["mscale_all_dim"]:
        problems.append("YaRN mscale differs from mscale_all_dim (GGUF has one yarn_log_multiplier)")
    problems += adapter.gguf_problems(c)
    if problems:
        raise GGUFError(f"{c.architecture} cannot be exported as GGUF {a}: {'; '.join(problems)}")


def write_rope_scaling(writer: gguf.GGUFWriter, c: ModelConfig) -> None:
    scaling = c.rope_scaling
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in FACTOR_SCALINGS and ADAPTERS[c.architecture].gguf_rope_freqs:
        return  # the rope_freqs tensor carries it (`rope_freq_factors`)
    if kind != "yarn":
        raise GGUFError(f"{c.architecture}: rope scaling {kind!r} has no GGUF form here (supported: yarn"
                        f"{', llama3 as rope_freqs' if ADAPTERS[c.architecture].gguf_rope_freqs else ''})")
    original = scaling["original_max_position_embeddings"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(scaling.get("factor") or c.max_position_embeddings / original)
    writer.add_rope_scaling_orig_ctx_len(original)
    for name, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
                      ("attention_factor", writer.add_rope_scaling_yarn_attn_factor)):
        if scaling.get(name) is not None:
            add(scaling[name])
    if c.attention == "mla" and scaling.get("mscale_all_dim"):
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])


# --- tensors ------------------------------------------------------------------------


def rope_freq_factors(c: ModelConfig) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` [rope_dim / 2] for a llama3 (or imported `factors`) rope
    scaling: each frequency is divided by its factor. llama3's, as llama.cpp's converter
    computes them: wavelengths above original / low_freq_factor slowed `factor` times, those
    below original / high_freq_factor kept, the band between interpolated. None otherwise."""
    scaling = c.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "factors":
        return np.asarray(scaling["factors"], np.float32)
    if kind != "llama3":
        return None
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = float(scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / np.float32(c.rope_theta) ** (np.arange(0, c.rope_dim, 2, dtype=np.float32) / np.float32(c.rope_dim))
    wavelen = 2 * math.pi / inv_freq.astype(np.float64)
    factors = np.where(wavelen > original / low, factor, 1.0)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    if high > low:
        smooth = (original / wavelen[medium] - low) / (high - low)
        factors[medium] = 1 / ((1 - smooth) / factor + smooth)
    return factors.astype(np.float32)


def rope_scaling_of_factors(meta: GGUFMetadata, source_tensor, reader, rope_dim: int) -> dict:
    """The `factors` rope scaling of a GGUF's F32 `rope_freqs` tensor [rope_dim / 2]."""
    if source_tensor.type != "F32" or tuple(source_tensor.shape) != (rope_dim // 2,):
        raise GGUFError(f"{meta.file}: rope_freqs.weight is {source_tensor.type} {list(source_tensor.shape)}, "
                        f"not F32 [{rope_dim // 2}]")
    values = reader.read(source_tensor.file, source_tensor.offset, 4 * (rope_dim // 2)).view("<f4")
    return {"rope_type": "factors", "factors": [float(v) for v in values]}


def resident_shapes(c: ModelConfig) -> dict[str, tuple]:
    """Every resident tensor `c` implies, colibri's name → row-major shape, in the converter's order."""
    adapter = ADAPTERS[c.architecture]
    source = dict(adapter.global_tensors(c))
    for layer in range(c.n_layers):
        source.update(adapter.layer_tensors(c, layer))
    return {view.name: tuple(view.shape) for name, shape in source.items()
            for view in adapter.resident_views(name, tuple(shape), c)}


def expert_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    return ADAPTERS[c.architecture].expert_shapes(c)


def permuted_heads(c: ModelConfig, name: str) -> int:
    """The heads over which llama.cpp's converter permuted the rows of `name` (0: not permuted)."""
    match = _QK.match(name)
    if not ADAPTERS[c.architecture].gguf_permuted_qk or not match:
        return 0
    return c.n_heads if match.group(1) == "q" else c.n_kv_heads


def llama_row_order(head_dim: int) -> np.ndarray:
    """`LlamaModel.permute` within one head: GGUF row i is transformers' row order[i]."""
    return np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)


def tensor_chunks(reader: ByteReader, file, offset: int, nbytes: int, rows: int, heads: int = 0, to_gguf: bool = True) -> Iterator[np.ndarray]:
    """A tensor's bytes in bounded chunks; with `heads`, its rows permuted per head into
    llama.cpp's Q/K order (`to_gguf`) or back. Rows move whole: blocks never straddle rows."""
    if not heads:
        for start in range(0, nbytes, CHUNK_BYTES):
            yield reader.read(file, offset + start, min(CHUNK_BYTES, nbytes - start))
        return
    head_dim, head_bytes = rows // heads, nbytes // heads
    order = llama_row_order(head_dim)
    order = order if to_gguf else np.argsort(order)
    step = max(1, CHUNK_BYTES // head_bytes)
    for first in range(0, heads, step):
        count = min(step, heads - first)
        block = reader.read(file, offset + first * head_bytes, count * head_bytes).reshape(count, head_dim, -1)
        yield np.ascontiguousarray(block[:, order]).reshape(-1)


def kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b [heads·(nope + v), rank] from k_b [heads, rank, nope] (as llama.cpp
    stores it, transposed) and v_b [heads, v, rank]."""
    heads, rank, _ = k_b.shape
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)
