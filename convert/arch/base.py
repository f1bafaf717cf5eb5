"""What every architecture adapter shares.

An adapter is everything colibri knows about one checkpoint family: how its config.json
maps onto the normalized `ModelConfig`, which tensors (Hugging Face names and shapes) the
checkpoint must hold, how llama.cpp stores it as GGUF, and a tiny synthetic model of it.
Canonical names come from the `gguf` package's tensor name map, never from a table of our
own; `gguf_names` renames the few where colibri uses one name for all architectures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import gguf
import numpy as np

from colibri.formats.config_check import MAX_EXPERTS, MAX_LAYERS, config_problems
from colibri.formats.model_config import ModelConfig
from colibri.formats.safe_json import is_int

FFN_ACTIVATIONS = ("silu", "swish")  # the runtime's FFNs apply SiLU (= swish) and nothing else


@lru_cache(maxsize=8)
def _name_map(arch: gguf.MODEL_ARCH, n_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(arch, n_layers)


class ConfigError(ValueError):
    """config.json lacks or contradicts what the adapter needs."""


def rope_settings(hf: dict) -> tuple[float, dict | None, float]:
    """(theta, scaling dict or None, partial rotary factor) from old- or new-style configs."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    partial = float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    return theta, scaling, partial


def eos_ids(hf: dict) -> list[int]:
    eos = hf.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def require(hf: dict, *keys):
    """The values of `keys`; a key may be a tuple of alternative names (old, new config style)."""
    values, missing = [], []
    for key in keys:
        names = key if isinstance(key, tuple) else (key,)
        value = next((hf[n] for n in names if hf.get(n) is not None), None)
        if value is None:
            missing.append(" or ".join(names))
        values.append(value)
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    return values


def check_activation(hf: dict) -> None:
    """Refuse an FFN activation the runtime does not compute (transformers' default is SiLU)."""
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key) is not None and hf[key] not in FFN_ACTIVATIONS:
            raise ConfigError(f"config.json: {key} {hf[key]!r} is not supported (colibri computes {', '.join(FFN_ACTIVATIONS)})")


def check_features(hf: dict, windows: bool = False) -> None:
    """Refuse config.json features the runtime does not implement, naming the key. A sliding
    window is refused unless the adapter maps it onto its layers (`windows`: gpt-oss's
    `layer_types`); the runtime keeps a window per layer (`ModelConfig.sliding_layers`)."""
    window = hf.get("sliding_window")
    slides = hf.get("use_sliding_window") or (hf.get("use_sliding_window") is None and window is not None
                                              and window < hf.get("max_position_embeddings", 0))
    if slides and not windows:
        raise ConfigError(f"config.json: sliding_window {window!r} is not supported for this "
                          "architecture (colibri keeps windows only on the layers an adapter names)")
    partial = rope_settings(hf)[2]
    if not 0 < partial <= 1:
        raise ConfigError(f"config.json: partial_rotary_factor {partial!r} is not in (0, 1]")


def common_fields(hf: dict, architecture: str, gguf_arch: gguf.MODEL_ARCH, windows: bool = False) -> dict:
    """The ModelConfig fields every architecture reads the same way (`windows`: the adapter
    maps config.json's sliding window onto its layers itself)."""
    check_activation(hf)
    check_features(hf, windows)
    vocab, hidden, layers, heads = require(hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    head_dim = hf.get("head_dim") or hidden // heads
    theta, scaling, partial = rope_settings(hf)
    return dict(
        architecture=architecture,
        gguf_architecture=gguf_arch.name,
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_dim=int(head_dim * partial),
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )


def sigmoid_routing(hf: dict, norm_topk: bool = True) -> dict:
    """The ModelConfig fields of DeepSeek-V3's routing as config.json gives it: sigmoid scores, a
    correction bias for the choice only, expert groups, the chosen weights renormalized
    (`norm_topk_prob`, default `norm_topk`) and scaled."""
    return dict(router="sigmoid", router_norm_topk=bool(hf.get("norm_topk_prob", norm_topk)), router_bias=True,
                router_groups=hf.get("n_group") or 1, router_topk_groups=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))


# config.json keys that size the loops and tables a plan builds: checked before normalizing
SIZING_KEYS = {
    **dict.fromkeys(("num_hidden_layers", "num_nextn_predict_layers", "first_k_dense_replace", "decoder_sparse_step",
                     "moe_layer_freq"), MAX_LAYERS),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
                     "n_group", "topk_group"), MAX_EXPERTS),
}
MAX_JSON_INT = 1 << 53  # beyond this no config value is meant as an integer


def check_sizes(hf: dict) -> None:
    """Refuse a count that would make planning build tables without end (a layer count of 2**40)."""
    for key, limit in SIZING_KEYS.items():
        value = hf.get(key)
        values = value if isinstance(value, list) and len(value) <= MAX_LAYERS else [value]  # or one per layer
        if value is not None and not all(is_int(v) and 0 <= v <= limit for v in values):
            raise ConfigError(f"config.json: {key} is {value!r}, not a whole number in 0..{limit} (or one per layer)")
    for key, value in hf.items():
        if isinstance(value, int) and abs(value) > MAX_JSON_INT:
            raise ConfigError(f"config.json: {key} is {value}, larger than any config value")


def normalized_config(adapter, hf: dict) -> ModelConfig:
    """`adapter.normalize(hf)`, then formats' one validation of the result: a config.json whose
    values have the wrong type or range is a ConfigError naming the key, never a traceback."""
    check_sizes(hf)
    try:
        config = adapter.normalize(hf)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"config.json: a value of the wrong type or range ({type(e).__name__}: {e})") from None
    problems = config_problems(config)
    if problems:
        raise ConfigError(f"config.json: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return config


@dataclass(frozen=True)
class ExpertNames:
    """Where a layer's routed experts live in the checkpoint."""

    prefix: str  # e.g. "model.layers.3.block_sparse_moe.experts"
    per_expert: tuple[str, str, str]  # gate, up, down leaf names, e.g. ("w1", "w3", "w2")
    # the fused tensors' layout: "halves" (gate_up_proj [E, 2I, D], gate rows then up rows;
    # down_proj [E, D, I]), "gpt_oss" (gate_up_proj [E, D, 2I], gate and up columns
    # interleaved; down_proj [E, I, D]: both transposed), "transposed_halves" (the same, gate
    # columns then up columns: Llama 4) or "interleaved" (gate_up_proj [E, 2I, D], gate and up
    # rows interleaved; down_proj [E, D, I]: gpt-oss's MXFP4 blocks)
    fused_layout: str = "halves"

    def per_expert_names(self, expert: int) -> tuple[str, str, str]:
        return tuple(f"{self.prefix}.{expert}.{leaf}.weight" for leaf in self.per_expert)

    @property
    def transposed(self) -> bool:
        """The fused tensors hold columns, not rows, of each matrix."""
        return self.fused_layout in ("gpt_oss", "transposed_halves")

    @property
    def fused_names(self) -> tuple[str, str]:
        return f"{self.prefix}.gate_up_proj", f"{self.prefix}.down_proj"

    def fused_shapes(self, count: int, ffn: int, hidden: int) -> tuple[tuple, tuple]:
        if self.transposed:
            return (count, hidden, 2 * ffn), (count, ffn, hidden)
        return (count, 2 * ffn, hidden), (count, hidden, ffn)

    def split_fused(self, gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One expert's (gate [I, D], up [I, D], down [D, I]) from its slices of the fused tensors
        (values, or rows of encoded blocks for the layouts that are not transposed)."""
        if self.fused_layout == "gpt_oss":
            return (np.ascontiguousarray(gate_up[:, 0::2].T), np.ascontiguousarray(gate_up[:, 1::2].T),
                    np.ascontiguousarray(down.T))
        if self.fused_layout == "transposed_halves":
            ffn = gate_up.shape[1] // 2
            return (np.ascontiguousarray(gate_up[:, :ffn].T), np.ascontiguousarray(gate_up[:, ffn:].T),
                    np.ascontiguousarray(down.T))
        if self.fused_layout == "interleaved":
            return np.ascontiguousarray(gate_up[0::2]), np.ascontiguousarray(gate_up[1::2]), down
        rows = gate_up.shape[0] // 2
        return gate_up[:rows], gate_up[rows:], down


class ResidentView(NamedTuple):
    """One resident tensor a checkpoint tensor becomes: its canonical name, the source's columns
    it takes, in order (None for all), its shape; the source's rows it takes, in order (None
    for all); a `transform` of the values ("plus_one": a zero-centred norm's weight, 1 + w;
    "neg_exp": -exp(x))."""

    name: str
    columns: tuple[int, ...] | None
    shape: tuple
    rows: tuple[int, ...] | None = None
    transform: str | None = None


@dataclass(frozen=True)
class TinyModel:
    """A tiny model of one model type: its config.json, keys named as the real hub config
    names them, and its tokenizer family (a key of convert.synthetic.tokenizer.FAMILIES)."""

    config: dict
    tokenizer: str


class Adapter:
    """Base of the architecture adapters; subclasses set the names, data and `normalize`."""

    model_types: tuple[str, ...] = ()
    model_type_aliases: tuple[str, ...] = ()  # model types read as the first of `model_types`
    tiny_models: dict[str, TinyModel] = {}  # model type → its tiny synthetic model
    gguf_arch: gguf.MODEL_ARCH
    moe_block = "mlp"  # module holding router and experts
    dense_block = "mlp"  # module holding a dense layer's FFN
    linear_block = "linear_attn"  # module holding a linear layer's token mixer
    expert_leaves = ("gate_proj", "up_proj", "down_proj")
    shared_block = "shared_experts"
    fused_expert_layout = "halves"  # ExpertNames.fused_layout
    router_bias_leaf = "gate.e_score_correction_bias"  # the selection bias, within moe_block
    router_leaf = "gate.weight"  # the router's matrix, within moe_block
    qk_norm_leaves = ("q_norm", "k_norm")  # the q/k RMSNorms, within self_attn
    sinks_leaf = "sinks"  # the attention sinks, within self_attn
    o_proj_bias = False  # the hub's o_proj has a bias too when attention_bias is set
    # llama.cpp's `gguf_arch`, as its converter writes it and its loader reads it
    gguf_names: dict[str, str] = {}  # colibri's tensor name part → llama.cpp's, where they differ
    gguf_ffn_is_expert = False  # feed_forward_length is the routed experts' width (no dense layers)
    gguf_leading_dense = False  # dense layers only before the MoE ones (leading_dense_block_count)
    gguf_interleaved_moe = False  # MoE layers every n-th (interleave_moe_layer_step; the adapter checks them)
    gguf_norm_topk = False  # top-k renormalisation where llama.cpp's graph hard-codes it
    gguf_rope_interleaved = False  # llama.cpp's rope rotates pairs (2i, 2i+1), not halves
    gguf_permuted_qk = False  # Q/K rows permuted per head (LlamaModel.permute)
    gguf_rope_freqs = False  # a llama3 rope scaling is llama.cpp's `rope_freqs` tensor
    gguf_keeps_mtp = False  # multi-token-prediction layers kept, counted in block_count
    gguf_split_kv_b = False  # MLA's attn_kv_b exported split into attn_k_b and attn_v_b (llama.cpp needs it)
    gguf_linear_kv_zero = False  # head_count_kv per layer, 0 on the linear layers (llama.cpp's kimi-linear)
    zero_centred_norms = False  # the checkpoint's RMSNorm weights are w where 1 + w is applied
    skipped_prefixes: tuple[str, ...] = ()  # checkpoint tensors no conversion reads (a separate MTP head)
    integer_tensors: tuple[str, ...] = ()  # name endings of integer tables (stored as float32, whole numbers below 2**24)

    @property
    def gguf_arch_name(self) -> str:
        """llama.cpp's name of `gguf_arch`, e.g. "qwen3moe"."""
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]

    def normalize(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def skips(self, name: str, c: ModelConfig) -> bool:
        """Whether checkpoint tensor `name` is one no conversion reads (`skipped_prefixes`)."""
        return name.startswith(self.skipped_prefixes)

    def mtp_layers(self, hf: dict) -> int:
        """Multi-token-prediction layers stored after the decoder layers (skipped)."""
        return int(hf.get("num_nextn_predict_layers") or 0)

    # --- expected tensors -------------------------------------------------------------

    def global_tensors(self, c: ModelConfig) -> dict[str, tuple]:
        tensors = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            tensors["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        return tensors

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        """Every non-expert tensor of decoder layer `layer`, with its shape."""
        p = f"model.layers.{layer}"
        tensors = {f"{p}.input_layernorm.weight": (c.hidden_size,), f"{p}.post_attention_layernorm.weight": (c.hidden_size,)}
        tensors.update(self.mla_tensors(c, p) if c.attention == "mla" else self.attention_tensors(c, p, layer))
        if c.is_moe_layer(layer):
            tensors.update(self.router_tensors(c, p))
        else:
            tensors.update(self.mlp_tensors(f"{p}.{self.dense_block}", c.dense_ffn, c.hidden_size))
        return tensors

    def attention_tensors(self, c: ModelConfig, p: str, layer: int) -> dict[str, tuple]:
        kv_heads, d = c.kv_heads_of(layer), c.hidden_size
        q, k, v = c.n_heads * c.head_dim, kv_heads * c.head_dim, kv_heads * c.v_head_dim
        a = f"{p}.self_attn"
        t = {f"{a}.q_proj.weight": (q, d), f"{a}.k_proj.weight": (k, d), f"{a}.v_proj.weight": (v, d), f"{a}.o_proj.weight": (d, c.n_heads * c.v_head_dim)}
        if c.attn_bias:
            t.update({f"{a}.q_proj.bias": (q,), f"{a}.k_proj.bias": (k,), f"{a}.v_proj.bias": (v,)})
        q_norm, k_norm = (f"{a}.{leaf}.weight" for leaf in self.qk_norm_leaves)
        if c.qk_norm == "head":
            t.update({q_norm: (c.head_dim,), k_norm: (c.head_dim,)})
        elif c.qk_norm == "full":
            t.update({q_norm: (q,), k_norm: (k,)})
        return t

    def mla_tensors(self, c: ModelConfig, p: str) -> dict[str, tuple]:
        a, d, h = f"{p}.self_attn", c.hidden_size, c.n_heads
        t = {
            f"{a}.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
            f"{a}.kv_a_layernorm.weight": (c.kv_lora_rank,),
            f"{a}.kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            f"{a}.o_proj.weight": (d, h * c.v_head_dim),
        }
        if c.q_lora_rank:
            t.update({
                f"{a}.q_a_proj.weight": (c.q_lora_rank, d),
                f"{a}.q_a_layernorm.weight": (c.q_lora_rank,),
                f"{a}.q_b_proj.weight": (h * c.head_dim, c.q_lora_rank),
            })
        else:
            t[f"{a}.q_proj.weight"] = (h * c.head_dim, d)
        return t

    @staticmethod
    def mlp_tensors(prefix: str, ffn: int, hidden: int) -> dict[str, tuple]:
        return {f"{prefix}.gate_proj.weight": (ffn, hidden), f"{prefix}.up_proj.weight": (ffn, hidden), f"{prefix}.down_proj.weight": (hidden, ffn)}

    def router_tensors(self, c: ModelConfig, p: str) -> dict[str, tuple]:
        m = f"{p}.{self.moe_block}"
        t = {f"{m}.{self.router_leaf}": (c.n_experts, c.hidden_size)}
        if c.router_bias:
            t[f"{m}.{self.router_bias_leaf}"] = (c.n_experts,)
        if c.n_shared_experts:
            t.update(self.mlp_tensors(f"{m}.{self.shared_block}", c.shared_expert_ffn, c.hidden_size))
        if c.shared_expert_gate:
            t[f"{m}.shared_expert_gate.weight"] = (1, c.hidden_size)
        return t

    def experts(self, layer: int, packed: bool = False) -> ExpertNames:
        """Where layer `layer`'s experts are; `packed`: its fused tensors are packed blocks (MXFP4)."""
        return ExpertNames(f"model.layers.{layer}.{self.moe_block}.experts", self.expert_leaves, self.fused_expert_layout)

    def expert_shapes(self, c: ModelConfig) -> dict[str, tuple[int, int]]:
        return {"gate": (c.expert_ffn, c.hidden_size), "up": (c.expert_ffn, c.hidden_size), "down": (c.hidden_size, c.expert_ffn)}

    # --- names ------------------------------------------------------------------------

    def canonical_name(self, hf_name: str, n_layers: int) -> str | None:
        """gguf's canonical name (`blk.3.attn_q.weight`) for a Hugging Face tensor name."""
        for suffix, canonical_suffix in ((".weight", ".weight"), (".bias", ".bias"), ("_bias", ".bias")):
            if hf_name.endswith(suffix):
                base = _name_map(self.gguf_arch, n_layers).get_name(hf_name[: -len(suffix)])
                if base is not None:
                    return self.colibri_name(base + canonical_suffix)
        return None

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        """The resident tensors Hugging Face tensor `name` of a model of config `c` becomes
        ([] when it has no canonical name)."""
        canonical = self.canonical_name(name, c.n_layers)
        return [] if canonical is None else [ResidentView(canonical, None, shape)]

    def gguf_name(self, name: str) -> str:
        """llama.cpp's name for the colibri tensor `name`."""
        return _renamed(name, self.gguf_names)

    def colibri_name(self, gguf_name: str) -> str:
        """colibri's name for llama.cpp's tensor `gguf_name`."""
        return _renamed(gguf_name, {theirs: ours for ours, theirs in self.gguf_names.items()})

    # --- GGUF metadata ----------------------------------------------------------------

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        """The ModelConfig fields this architecture's GGUF gives otherwise than `fields`, the
        generic reading (`meta`: convert.gguf_arch.GGUFMetadata; `shapes`: its tensors)."""
        return {}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        """Add the `{arch}.*` keys only this architecture's llama.cpp loader reads."""

    def gguf_joined(self, c: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
        """llama.cpp's tensors that join rows of several of colibri's: GGUF name → its rows as
        (colibri tensor, first row, rows) pieces, in order."""
        return {}

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        """Why llama.cpp's `gguf_arch` cannot run `c` as colibri does, beyond the generic checks."""
        return []

    def gguf_shape(self, name: str, shape: tuple) -> tuple:
        """The shape llama.cpp's loader reads GGUF tensor `name` (colibri's `shape`) in: the same
        values, with unit dimensions where it wants them."""
        return shape


def _renamed(name: str, parts: dict[str, str]) -> str:
    """`blk.N.part.weight` with `part` replaced as `parts` says."""
    pieces = name.split(".")
    if len(pieces) == 4 and pieces[2] in parts:
        pieces[2] = parts[pieces[2]]
    return ".".join(pieces)
