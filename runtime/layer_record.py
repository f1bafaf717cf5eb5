"""Each layer described once, at load: what its kernels take, for prompts and for decoding alike.

`describe_layer` reads a layer's tensors and the config's scalars for it into one
`LayerRecord`. Its parts are named tuples numba takes whole, one per step of the layer:

- `GQAInput` / `LatentInput`: the attention norm and what turns its output into queries, keys
  and values (GQA: q, k, v, their bias, q/k norms, clip and rotation; MLA: q or q_a → q_b,
  kv_a, the latent norms, the rotation, the absorbed keys); `QueryLoRA` is MLA's q_a → q_b;
- `LayerOutput`: the output projection and its bias, the FFN norm; `PerHead`: MLA's kv_b
  slice of each head, which first turns each head's context into its output;
- `RouterInput`: the router's matrix, biases and `RouteRule`;
- `FFNWeights`: a dense FFN's (or an ungated shared expert's) gate, up and down;
- `ExpertKernel`'s `ExpertsRule` (the routed experts, their biases and GLU).

Absent parts are empty arrays (no bias, no norm) or None (no LoRA, no router). The prompt
path (`runtime.model`) and the fused decode path (`runtime.fused`) both build on the record,
so a new scalar or tensor of a layer is read here once and reaches both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import gguf
import numpy as np

from colibri.formats.encodings import FLOAT_DTYPES
from colibri.formats.model_config import ModelConfig
from colibri.runtime import kernels
from colibri.runtime.kernels.attention import Scoring
from colibri.runtime.kernels.routing import SCORINGS, RouteRule
from colibri.runtime.kernels.rows import Product
from colibri.runtime.rope import Rope, RopeTable, yarn_mscale

F32 = np.float32
NONE = np.empty(0, F32)  # an absent bias or norm
QK_NORMS = {"none": 0, "full": 1, "head": 2, "weightless": 2}  # weightless: per head, weights of ones
# MLA's q_a and kv_a RMSNorms keep their default epsilon whatever rms_norm_eps says, in
# transformers and in DeepSeek's own code (GLM-5's rms_norm_eps is 1e-5)


class GQAInput(NamedTuple):
    """A GQA / MHA layer's attention input: x's norm, then q, k, v with their biases, v's
    scale, q/k norms (`QK_NORMS`: over the whole projection or per head; after the rotation
    when `norm_after_rope`), clip (0: none), rotation (none when its dim is 0) and q's
    temperature at each position (`temperature_scale` 0: none)."""

    norm: np.ndarray
    eps: np.float32
    q: Product
    k: Product
    v: Product
    q_bias: np.ndarray
    k_bias: np.ndarray
    v_bias: np.ndarray
    v_scale: np.float32
    q_norm: np.ndarray
    k_norm: np.ndarray
    qk_norm: int
    norm_after_rope: bool
    clip: np.float32
    rope: RopeTable
    temperature_scale: np.float32
    temperature_floor: np.float32
    heads: int
    kv_heads: int


class LatentInput(NamedTuple):
    """An MLA layer's attention input: x's norm; `first` (q_a with a query LoRA, else q) and
    kv_a of it; the latent norm (with `latent_eps`) and the rotation; the absorbed keys
    [heads * rank, nope] that take each head's query into the latent space."""

    norm: np.ndarray
    eps: np.float32
    latent_eps: np.float32
    first: Product
    kv_a: Product
    kv_a_norm: np.ndarray
    rope: RopeTable
    absorb: Product
    heads: int
    nope: int
    rank: int


class QueryLoRA(NamedTuple):
    """MLA's query LoRA: q_a's output normalized (the latent eps), then q_b."""

    q_a_norm: np.ndarray
    q_b: Product


class LayerOutput(NamedTuple):
    """After the token mixer: the output projection (+ bias, unless empty), the residual,
    then the FFN norm."""

    o: Product
    o_bias: np.ndarray
    ffn_norm: np.ndarray
    eps: np.float32


class PerHead(NamedTuple):
    """MLA's value side: head h's context [rank] times rows first + h * stride.. of kv_b."""

    kv_b: Product
    stride: int
    first: int


class RouterInput(NamedTuple):
    """The router: logits of the FFN norm's output (+ logit_bias, unless empty), then the
    choice (`RouteRule`, with `bias` added to the scores for it)."""

    gate: Product
    logit_bias: np.ndarray
    bias: np.ndarray
    rule: RouteRule


class FFNWeights(NamedTuple):
    """down(glu(gate(h), up(h))): a dense FFN, or a layer's shared expert, with the experts'
    gated activation (`kernels.GLU`: silu(gate) * up, or one clamped)."""

    gate: Product
    up: Product
    down: Product
    glu: kernels.GLU


@dataclass(frozen=True)
class LayerRecord:
    """One layer, as both paths run it. `matrices` holds the same weights by role ("q", "k",
    "v", "o", "gate" for an output gate, "q_a", "q_b", "kv_a", "kv_b", "k_absorb", "router",
    "ffn_gate", "ffn_up", "ffn_down", "shared_gate" for a gated shared expert) as
    `kernels.Matrix`, for the prompt path's many-row products. `mixer` is None for a DeltaNet
    layer (its mixer is `runtime.deltanet`'s) and a DeepSeek-V4 layer (`runtime.compressed_attention`'s);
    `router` and `experts` for a dense FFN."""

    layer: int
    attn_norm: np.ndarray
    matrices: dict
    mixer: GQAInput | LatentInput | None
    lora: QueryLoRA | None
    per_head: PerHead | None
    output: LayerOutput
    router: RouterInput | None
    ffn: FFNWeights | None
    experts: kernels.ExpertKernel | None
    heads: int  # the heads attention (or the DeltaNet) writes: [heads, width]
    width: int
    window: int  # positions a query sees (0: all)
    chunk: int  # a query sees only its own chunk of this many positions (0: no chunks)
    scoring: Scoring  # the scores' scale, and a learned logit per head in each softmax's denominator (sinks)


def route_rule(c: ModelConfig) -> RouteRule:
    """The config's router as the routing kernel takes it."""
    return RouteRule(SCORINGS[c.router], c.router_groups, c.router_topk_groups, c.router_group_score == "top2_sum",
                     c.router_norm_topk, F32(c.routed_scaling_factor))


def describe_layer(c: ModelConfig, w, layer: int, rope: Rope, store) -> LayerRecord:
    """Layer `layer`'s record from the resident weights `w` (`model.Weights`) and the config;
    `store` (an `ExpertStore`) holds a routed layer's experts."""
    p = f"blk.{layer}."
    matrices, mixer, lora, per_head = {}, None, None, None
    attn_norm = w.vector(p + "attn_norm.weight")
    heads, width, scale = c.n_heads, c.v_head_dim, F32(c.head_dim**-0.5)
    if c.is_linear_layer(layer):  # a gated DeltaNet's output projection, or Kimi delta attention's
        matrices["o"] = w.linear(p + ("attn_output.weight" if c.linear_kind == "kda" else "ssm_out.weight"))
        heads, width = c.linear_v_heads, c.linear_v_head_dim
    elif c.attention == "compressed":  # DeepSeek-V4's: the prompt path's own (`runtime.compressed_attention`)
        matrices["o"] = w.linear(p + "attn_output_b.weight")
    elif c.attention == "mla":
        mixer, lora, per_head, scale = _latent(c, w, p, rotation_of(c, layer, rope), attn_norm, matrices)
    else:
        mixer = _gqa(c, w, layer, rope, attn_norm, matrices)
    o_bias = w.vector(p + "attn_output.bias") if c.attn_output_bias and mixer is not None else NONE
    output = LayerOutput(matrices["o"].product, o_bias, w.vector(p + "ffn_norm.weight"), F32(c.norm_eps))
    router = experts = ffn = None
    if c.is_moe_layer(layer):
        matrices["router"] = w.linear(p + "ffn_gate_inp.weight")
        router = RouterInput(matrices["router"].product,
                             w.vector(p + "ffn_gate_inp.bias") if c.router_logit_bias else NONE,
                             w.vector(p + "exp_probs_b.bias") if c.router_bias and layer not in c.hash_layers
                             else np.zeros(matrices["router"].rows, F32),
                             route_rule(c))
        experts = _experts(c, w, layer, store)
        if c.n_shared_experts:
            ffn = _ffn(c, w, layer, "_shexp", matrices)
            if c.shared_expert_gate:
                matrices["shared_gate"] = w.linear(p + "ffn_gate_inp_shexp.weight")
    else:
        ffn = _ffn(c, w, layer, "", matrices)
    sinks = w.vector(p + "attn_sinks.weight") if c.has_sinks(layer) else np.full(heads, kernels.NO_SINK, F32)
    return LayerRecord(layer, attn_norm, matrices, mixer, lora, per_head, output, router, ffn, experts, heads, width,
                       c.window_of(layer), c.chunk_of(layer), Scoring(np.ascontiguousarray(sinks, dtype=F32), scale))


def rotation_of(c: ModelConfig, layer: int, rope: Rope) -> RopeTable:
    """The rotation layer `layer`'s queries and keys take: `rope`'s, or one of width 0 in a
    position-free layer (Llama 4's; Kimi-Linear's MLA)."""
    return rope.table if c.is_rotated(layer) else rope.table._replace(dim=0)


def _gqa(c: ModelConfig, w, layer: int, rope: Rope, attn_norm: np.ndarray, matrices: dict) -> GQAInput:
    p = f"blk.{layer}."
    q, k, v = (w.linear(p + f"attn_{x}.weight") for x in "qkv")
    if c.attn_output_gate:  # Qwen3-Next's output gate: its rows of attn_q, held apart from the query's
        q, matrices["gate"] = query_and_gate(q, c.n_heads, c.head_dim)
        w.matrices[p + "attn_q.weight"] = q  # what an importance matrix observes of attn_q (its input)
    matrices.update(q=q, k=k, v=v, o=w.linear(p + "attn_output.weight"))
    biases = [w.vector(p + f"attn_{x}.bias") for x in "qkv"] if c.attn_bias else [NONE] * 3
    qk_norm, rotated = c.qk_norm, c.is_rotated(layer)
    if qk_norm == "weightless":  # Llama 4's, in the rotated layers only: per-head weights of ones (times 1.0 is exact)
        qk_norm = qk_norm if rotated else "none"
        norms = [np.ones(c.head_dim, F32)] * 2 if rotated else [NONE] * 2
    else:
        norms = [w.vector(p + f"attn_{x}_norm.weight") for x in "qk"] if qk_norm != "none" else [NONE] * 2
    table = rotation_of(c, layer, rope)
    temperature = (F32(0), F32(1)) if rotated else (F32(c.attn_temperature_scale), F32(max(c.attn_temperature_floor, 1)))
    return GQAInput(attn_norm, F32(c.norm_eps), q.product, k.product, v.product, *biases, F32(c.value_scale), *norms,
                    QK_NORMS[qk_norm], c.qk_norm_after_rope, F32(c.clip_qkv or 0), table, *temperature, c.n_heads,
                    c.kv_heads_of(layer))


def _latent(c: ModelConfig, w, p: str, rope: RopeTable, attn_norm: np.ndarray, matrices: dict):
    """MLA's (LatentInput, QueryLoRA or None, PerHead, the scores' scale)."""
    lora = None
    if c.q_lora_rank:
        matrices.update(q_a=w.linear(p + "attn_q_a.weight"), q_b=w.linear(p + "attn_q_b.weight"))
        lora = QueryLoRA(w.vector(p + "attn_q_a_norm.weight"), matrices["q_b"].product)
    else:
        matrices["q"] = w.linear(p + "attn_q.weight")
    matrices.update(kv_a=w.linear(p + "attn_kv_a_mqa.weight"), kv_b=w.linear(p + "attn_kv_b.weight"),
                    o=w.linear(p + "attn_output.weight"))
    matrices["k_absorb"] = absorbed_keys(matrices["kv_b"], c)
    nope = c.qk_nope_head_dim
    mixer = LatentInput(attn_norm, F32(c.norm_eps), F32(c.latent_norm_eps), matrices["q_a" if lora else "q"].product,
                        matrices["kv_a"].product, w.vector(p + "attn_kv_a_norm.weight"), rope,
                        matrices["k_absorb"].product, c.n_heads, nope, c.kv_lora_rank)
    scale = c.head_dim**-0.5
    scaling = c.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return mixer, lora, PerHead(matrices["kv_b"].product, nope + c.v_head_dim, nope), F32(scale)


def _ffn(c: ModelConfig, w, layer: int, suffix: str, matrices: dict) -> FFNWeights:
    for m in ("gate", "up", "down"):
        matrices[f"ffn_{m}"] = w.linear(f"blk.{layer}.ffn_{m}{suffix}.weight")
    return FFNWeights(*(matrices[f"ffn_{m}"].product for m in ("gate", "up", "down")), kernels.glu_of(c))


def _experts(c: ModelConfig, w, layer: int, store) -> kernels.ExpertKernel:
    table = store.tables[layer]
    stored = [table.matrices[m] for m in ("gate", "up", "down")]
    biases = tuple(w.array(f"blk.{layer}.ffn_{m}_exps.bias") for m in ("gate", "up", "down")) if c.expert_bias else None
    return kernels.ExpertKernel(store.records(layer).shape[1], tuple(m.encoding for m in stored),
                                tuple(m.offset for m in stored), c.expert_ffn, c.hidden_size, glu=c.expert_glu,
                                alpha=c.swiglu_alpha, limit=c.swiglu_limit, biases=biases)


def query_and_gate(q: kernels.Matrix, heads: int, width: int) -> tuple[kernels.Matrix, kernels.Matrix]:
    """attn_q's rows [query | gate] per head as two matrices, each head's `width` rows of each
    in order: whole rows of blocks, moved within q's own memory (the resident bytes stay what
    the budget counted), not re-encoded."""
    data = q.data[:q.rows * q.row_nbytes]
    rows = data.reshape(heads, 2, width, q.row_nbytes)
    data[:] = np.concatenate([rows[:, 0], rows[:, 1]]).reshape(-1)  # every query row, then every gate row
    half = heads * width * q.row_nbytes
    return tuple(kernels.Matrix(part, q.encoding, heads * width, q.cols) for part in (data[:half], data[half:]))


def absorbed_keys(kv_b: kernels.Matrix, c: ModelConfig) -> kernels.Matrix:
    """The key half of MLA's kv_b transposed per head, [heads * kv_lora_rank, qk_nope_head_dim],
    so that absorbing a query into the latent space is a product with stored rows (as
    llama.cpp's attn_k_b). Built once at load: F32 when kv_b is a float encoding, else Q8_0
    (finer than kv_b's own blocks; F32 when the rows do not fill Q8_0 blocks)."""
    heads, nope, rank = c.n_heads, c.qk_nope_head_dim, c.kv_lora_rank
    keys = kv_b.rows_f32(0, kv_b.rows).reshape(heads, nope + c.v_head_dim, rank)[:, :nope]
    transposed = np.ascontiguousarray(keys.transpose(0, 2, 1)).reshape(heads * rank, nope)
    encoding = "F32" if kv_b.encoding in FLOAT_DTYPES or nope % 32 else "Q8_0"
    stored = gguf.quants.quantize(transposed, gguf.GGMLQuantizationType[encoding])
    return kernels.Matrix(stored.reshape(-1).view(np.uint8), encoding, heads * rank, nope)
