"""The normalized hyper-parameters every architecture is mapped to.

The runtime knows only this form; `convert/` adapters fill it from a checkpoint's
`config.json`. Field meanings and units are documented in `formats/spec.md` §4.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str  # source model_type, e.g. "mixtral", "deepseek_v3", "kimi_k2"
    gguf_architecture: str  # gguf.MODEL_ARCH name whose tensor names we use, e.g. "LLAMA"
    vocab_size: int
    hidden_size: int
    n_layers: int  # decoder layers kept (multi-token-prediction layers are dropped)
    n_heads: int
    n_kv_heads: int
    head_dim: int  # query/key width per head (MLA: qk_nope_head_dim + qk_rope_head_dim)
    v_head_dim: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention
    attention: str = "gqa"  # "gqa" (MHA is n_kv_heads == n_heads) or "mla"
    attn_bias: bool = False  # q/k/v projections carry a bias
    attn_output_bias: bool = False  # the output projection carries a bias (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    sliding_window: int = 0  # positions a query of a `sliding_layers` layer sees, its own the last
    sliding_layers: list[int] = field(default_factory=list)
    sliding_kv_heads: int = 0  # key-value heads of the sliding layers (0: n_kv_heads) (MiMo-V2-Flash)
    sliding_rope_theta: float = 0.0  # the rotation base of the sliding layers (0: rope_theta)
    sinks_sliding_only: bool = False  # attn_sinks in the sliding layers only
    value_scale: float = 1.0  # values are multiplied by this before they are cached (MiMo-V2-Flash)
    qk_norm: str = "none"  # "none", "head" (RMSNorm per head), "full" (over the whole projection),
    # "weightless" (per head without a weight, after the rotation, in the rotated layers only: Llama 4's)
    qk_norm_after_rope: bool = False  # the q/k norms apply to the rotated q and k (HunYuan)
    attention_chunk: int = 0  # a query of a `chunked_layers` layer sees only its own chunk: positions
    # p - p % attention_chunk .. p (Llama 4)
    chunked_layers: list[int] = field(default_factory=list)
    nope_layers: list[int] = field(default_factory=list)  # layers whose q and k are not rotated (Llama 4)
    # in `nope_layers`, q is multiplied by 1 + attn_temperature_scale * ln(1 + floor((p + 1) /
    # attn_temperature_floor)) at position p (Llama 4's temperature tuning; 0: none)
    attn_temperature_scale: float = 0.0
    attn_temperature_floor: int = 0
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    q_lora_rank: int | None = None  # MLA; None when q is projected directly
    kv_lora_rank: int | None = None  # MLA compressed latent width
    latent_norm_eps: float = 1e-6  # the epsilon of MLA's q_a and kv_a RMSNorms (DeepSeek's; GLM-5-Next: norm_eps)
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    # DeepSeek sparse attention (MLA only): each query attends to the index_topk positions its
    # layer's indexer scores best (all of them while there are no more)
    index_topk: int = 0  # 0: no indexer
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleaved: bool = False  # the indexer rotates pairs (GLM-5), not halves (DeepSeek-V3.2)
    index_layers: list[int] = field(default_factory=list)  # layers with an indexer; the others reuse the one before
    # MiniMax-M3's block-sparse attention (GQA): with index_block > 0, the indexer chooses blocks of
    # that many positions, not positions: each of its heads (one per key-value head) scores a block
    # by its best position, and the queries of that head's group attend to the index_topk best blocks,
    # the `index_local_blocks` up to their own always among them; the layers not in index_layers are dense
    index_block: int = 0
    index_local_blocks: int = 0
    # GLM-5-Next's indexer of pools (MLA): with index_kpool > 0, it scores pools of that many
    # consecutive positions (from position 0) by one key each, a softmax-weighted sum of its
    # positions' keys; a query attends to the index_topk / index_kpool best complete pools it sees
    # and to the positions after the last complete one
    index_kpool: int = 0
    attn_output_gate: bool = False  # q's projection gives [query | gate] per head; the output is times sigmoid(gate)
    # DeepSeek-V4's compressed attention: one shared key-value head (K = V) over a window of
    # `sliding_window` positions in every layer, plus, where `compress_ratios[layer]` is m > 0,
    # one compressed entry per m positions (m = 4: overlapping windows of 2m, chosen by an indexer
    # of `index_heads` x `index_head_dim`; otherwise all of them); output through `output_groups`
    # low-rank groups of `output_lora_rank`
    compress_ratios: list[int] = field(default_factory=list)  # per layer; 0: the window only
    compress_rope_theta: float = 0.0  # the rotation of compressed layers (with `compress_rope_scaling`)
    compress_rope_scaling: dict | None = None
    output_groups: int = 0
    output_lora_rank: int = 0
    # manifold-constrained hyper-connections (DeepSeek-V4): `hyper_streams` residual streams mixed
    # around each block, the mixing matrix made doubly stochastic by `hyper_sinkhorn_iters` rounds
    hyper_streams: int = 0  # 0: one ordinary residual stream
    hyper_sinkhorn_iters: int = 0
    hyper_eps: float = 0.0
    hyper_head_mean: bool = False  # the head collapses the streams by their plain mean (GLM-5-Next), not by
    # weights of its own (DeepSeek-V4)
    # gated DeltaNet (Qwen3-Next, Qwen3.5): layers whose token mixer is a linear recurrence, not
    # attention, with a fixed-size state per sequence instead of a KV cache
    linear_layers: list[int] = field(default_factory=list)
    linear_kind: str = "gated_deltanet"  # or "kda": Kimi delta attention (Kimi-Linear), a decay per key
    # channel from a low-rank forget gate, separate q/k/v projections and convolutions, a low-rank
    # sigmoid output gate
    linear_gate_lower_bound: float = 0.0  # KDA's "safe gate" when < 0: the decay is exp(bound * sigmoid(-A
    # * (f + dt_bias))) (GLM-5-Next), not exp(A * softplus(f + dt_bias)) (Kimi-Linear)
    linear_conv_kernel: int = 0  # width of the causal depthwise convolution over the q/k/v channels
    linear_k_heads: int = 0
    linear_v_heads: int = 0  # a multiple of linear_k_heads (r times as many)
    linear_v_tiled: bool = False  # value head h is served by q/k head h % linear_k_heads (llama.cpp's
    # order for Qwen3.5), not by h // r (transformers')
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    # rotary position embedding
    rope_theta: float = 10000.0
    rope_dim: int = 0  # rotated dimensions per head (partial rotary when < head width)
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1) instead of halves
    rope_scaling: dict | None = None  # as in config.json, e.g. {"type": "yarn", "factor": 40, ...}
    # feed-forward and mixture of experts
    hidden_act: str = "silu"
    dense_ffn: int = 0  # intermediate size of dense (non-MoE) layers
    moe_layers: list[int] = field(default_factory=list)  # indices of layers with routed experts
    n_experts: int = 0
    n_experts_used: int = 0  # top-k
    expert_ffn: int = 0  # intermediate size of one routed expert
    expert_glu: str = "silu"  # "silu": silu(gate) * up; "clamped_swiglu": gpt-oss's, with alpha and limit;
    # "clamped_silu": silu(min(gate, limit)) * clip(up, -limit, limit) (DeepSeek-V4); the dense FFNs and
    # shared experts apply the same
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    expert_input_scaled: bool = False  # the router's weight multiplies the routed expert's input, not
    # its output (Llama 4; one expert a token)
    expert_bias: bool = False  # each routed expert's gate, up and down products carry a bias
    router: str = "softmax"  # "softmax", "sigmoid" or "sqrtsoftplus" (sqrt(softplus), DeepSeek-V4) scores
    hash_layers: list[int] = field(default_factory=list)  # MoE layers whose experts a token-id table chooses
    router_norm_topk: bool = False  # renormalise the chosen k weights to sum to 1
    router_bias: bool = False  # a score-correction bias used for the choice only (DeepSeek-V3)
    router_logit_bias: bool = False  # the router's own bias, added to its logits (gpt-oss)
    router_groups: int = 1  # group-limited routing: number of expert groups
    router_topk_groups: int = 1  # groups kept before the final top-k
    router_group_score: str = "top2_sum"  # how a group is scored: "top2_sum" (V3) or "max" (V2)
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_ffn: int = 0  # intermediate size of the (merged) shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    # bookkeeping
    mtp_layers_skipped: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config fields: {', '.join(unknown)}")
        return cls(**data)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear_layer(self, layer: int) -> bool:
        return layer in self.linear_layers

    def linear_key_heads_of(self) -> list[int]:
        """The q/k head that serves each value head of a DeltaNet layer."""
        r = self.linear_v_heads // max(self.linear_k_heads, 1)
        return [h % self.linear_k_heads if self.linear_v_tiled else h // r for h in range(self.linear_v_heads)]

    @property
    def linear_conv_channels(self) -> int:
        """The channels the DeltaNet convolution runs over: q and k of every key head, v of every value head."""
        return 2 * self.linear_k_heads * self.linear_k_head_dim + self.linear_v_heads * self.linear_v_head_dim

    def window_of(self, layer: int) -> int:
        """The positions a query of `layer` sees (0: all of them)."""
        if layer in self.chunked_layers:
            return self.attention_chunk
        return self.sliding_window if layer in self.sliding_layers else 0

    def chunk_of(self, layer: int) -> int:
        """The chunk a query of `layer` keeps to (0: none)."""
        return self.attention_chunk if layer in self.chunked_layers else 0

    def is_rotated(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def kv_heads_of(self, layer: int) -> int:
        return self.sliding_kv_heads if self.sliding_kv_heads and layer in self.sliding_layers else self.n_kv_heads

    def rope_theta_of(self, layer: int) -> float:
        return self.sliding_rope_theta if self.sliding_rope_theta and layer in self.sliding_layers else self.rope_theta

    def has_sinks(self, layer: int) -> bool:
        return self.attn_sinks and (not self.sinks_sliding_only or layer in self.sliding_layers)
