"""What every architecture adapter shares: the expected tensors of a decoder layer.

An adapter maps one checkpoint family onto the normalized `ModelConfig` and says which
tensors (Hugging Face names and shapes) the checkpoint must hold. Canonical names come
from the `gguf` package's tensor name map, never from a table of our own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import gguf

from colibri.formats.model_config import ModelConfig

EXPERT_MATRICES = ("gate", "up", "down")


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


def common_fields(hf: dict, architecture: str, gguf_arch: gguf.MODEL_ARCH) -> dict:
    """The ModelConfig fields every architecture reads the same way."""
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


@dataclass(frozen=True)
class ExpertNames:
    """Where a layer's routed experts live in the checkpoint."""

    prefix: str  # e.g. "model.layers.3.block_sparse_moe.experts"
    per_expert: tuple[str, str, str]  # gate, up, down leaf names, e.g. ("w1", "w3", "w2")

    def per_expert_names(self, expert: int) -> tuple[str, str, str]:
        return tuple(f"{self.prefix}.{expert}.{leaf}.weight" for leaf in self.per_expert)

    @property
    def fused_names(self) -> tuple[str, str]:
        return f"{self.prefix}.gate_up_proj", f"{self.prefix}.down_proj"


class Adapter:
    """Base of the architecture adapters; subclasses set the names and `normalize`."""

    model_types: tuple[str, ...] = ()
    gguf_arch: gguf.MODEL_ARCH
    moe_block = "mlp"  # module holding router and experts
    expert_leaves = ("gate_proj", "up_proj", "down_proj")
    shared_block = "shared_experts"

    def normalize(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

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
        tensors.update(self.mla_tensors(c, p) if c.attention == "mla" else self.attention_tensors(c, p))
        if c.is_moe_layer(layer):
            tensors.update(self.router_tensors(c, p))
        else:
            tensors.update(self.mlp_tensors(f"{p}.mlp", c.dense_ffn, c.hidden_size))
        return tensors

    def attention_tensors(self, c: ModelConfig, p: str) -> dict[str, tuple]:
        q, kv, d = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.hidden_size
        a = f"{p}.self_attn"
        t = {f"{a}.q_proj.weight": (q, d), f"{a}.k_proj.weight": (kv, d), f"{a}.v_proj.weight": (kv, d), f"{a}.o_proj.weight": (d, c.n_heads * c.v_head_dim)}
        if c.attn_bias:
            t.update({f"{a}.q_proj.bias": (q,), f"{a}.k_proj.bias": (kv,), f"{a}.v_proj.bias": (kv,)})
        if c.qk_norm == "head":
            t.update({f"{a}.q_norm.weight": (c.head_dim,), f"{a}.k_norm.weight": (c.head_dim,)})
        elif c.qk_norm == "full":
            t.update({f"{a}.q_norm.weight": (q,), f"{a}.k_norm.weight": (kv,)})
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
        t = {f"{m}.gate.weight": (c.n_experts, c.hidden_size)}
        if c.router_bias:
            t[f"{m}.gate.e_score_correction_bias"] = (c.n_experts,)
        if c.n_shared_experts:
            t.update(self.mlp_tensors(f"{m}.{self.shared_block}", c.shared_expert_ffn, c.hidden_size))
        if c.shared_expert_gate:
            t[f"{m}.shared_expert_gate.weight"] = (1, c.hidden_size)
        return t

    def experts(self, layer: int) -> ExpertNames:
        return ExpertNames(f"model.layers.{layer}.{self.moe_block}.experts", self.expert_leaves)

    def expert_shapes(self, c: ModelConfig) -> dict[str, tuple[int, int]]:
        return {"gate": (c.expert_ffn, c.hidden_size), "up": (c.expert_ffn, c.hidden_size), "down": (c.hidden_size, c.expert_ffn)}

    # --- names ------------------------------------------------------------------------

    def canonical_name(self, hf_name: str, n_layers: int) -> str | None:
        """gguf's canonical name (`blk.3.attn_q.weight`) for a Hugging Face tensor name."""
        for suffix, canonical_suffix in ((".weight", ".weight"), (".bias", ".bias"), ("_bias", ".bias")):
            if hf_name.endswith(suffix):
                base = _name_map(self.gguf_arch, n_layers).get_name(hf_name[: -len(suffix)])
                if base is not None:
                    return base + canonical_suffix
        return None
