"""MiniMax-M3: MiniMax-M2's GQA (partial rotary, sigmoid router with a selection bias) with
block-sparse attention on the layers after the first few, which are dense: an indexer per layer
(one key head, one query head a key-value group) chooses each group's blocks of positions
(`runtime.indexer.BlockIndexer`). Per-head q/k norms; every RMSNorm applies 1 + w; every FFN
(dense, shared expert, routed experts) is gpt-oss's clamped SwiGLU, gate and up not interleaved;
one shared expert, and the routed experts' sum scaled.

The release is multimodal (`MiniMaxM3SparseForConditionalGeneration`): the text model is read
from its `text_config` and `language_model.` tensors (`formats.checkpoint`), per-expert w1/w3/w2
under `block_sparse_moe`, the indexer as `self_attn.index_*`. transformers' text-only class
(`minimax_m3_vl_text`) saves the MoE under `mlp`, experts and the dense and shared FFNs' gate and
up fused, and the indexer as `self_attn.indexer.*`: read under the release's names
(`formats.checkpoint.SAVED_NAMES`, `SAVED_HALVES`). Layer and indexer settings come from the
transformers keys (`layer_types`, `mlp_layer_types`, `index_*`) or the release's
(`sparse_attention_config`, `moe_layer_freq`); the rotated width from `partial_rotary_factor`, as
transformers reads it (a `rotary_dim` beside it is ignored). llama.cpp stores it as `minimax-m3`,
its norms with the 1 added, its layers sparse exactly from the first MoE layer on.
"""

import re

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, ResidentView, TinyModel, common_fields, require
from colibri.convert.gguf_source import GGUFError
from colibri.formats.model_config import ModelConfig

SPARSE, FULL = "minimax_m3_sparse", "full_attention"
SWIGLU = 1.702, 7.0  # alpha and limit: transformers' defaults, and what llama.cpp's minimax-m3 graph hard-codes
TINY = {  # MiniMaxAI/MiniMax-M3's text_config, as the release writes it, at tiny widths; blocks of 4
    # positions, so that a prompt is sparse past 12
    "architectures": ["MiniMaxM3VLForCausalLM"],
    "dense_intermediate_size": 512,
    "head_dim": 64,
    "hidden_act": "swigluoai",
    "hidden_size": 256,
    "intermediate_size": 256,
    "max_position_embeddings": 1048576,
    "model_type": "minimax_m3_vl_text",
    "moe_layer_freq": [0, 1, 1],
    "n_shared_experts": 1,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "partial_rotary_factor": 0.5,
    "qk_norm_type": "per_head",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 32,
    "routed_scaling_factor": 2.0,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 256,
    "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1], "sparse_block_size": 4, "sparse_index_dim": 64,
                                "sparse_local_block": 1, "sparse_num_index_heads": 2, "sparse_topk_blocks": 3,
                                "use_sparse_attention": True},
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 512,
}
# the release's sparse_attention_config keys → transformers' (as its config class reads them)
SPARSE_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
               "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
               "index_local_blocks": "sparse_local_block"}
# the tensors of a layer llama.cpp's minimax-m3 has beyond minimax-m2's map, by their place in it
OWN_NAMES = {
    **{f"block_sparse_moe.shared_experts.{m}_proj.weight": f"ffn_{m}_shexp.weight" for m in ("gate", "up", "down")},
    **{f"mlp.{m}_proj.weight": f"ffn_{m}.weight" for m in ("gate", "up", "down")},
    **{f"self_attn.index_{part}.weight": f"indexer.{part}.weight" for part in ("q_proj", "k_proj", "q_norm", "k_norm")},
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"(^|\.)mtp\.")  # the multi-token-prediction block, which transformers does not load either


def _per_layer(hf: dict, key: str, release_key: str, kinds: tuple[str, str], layers: int) -> list[int]:
    """The layers of the second kind of `kinds`, from transformers' list `key` or the release's
    0/1 flags (`release_key`); every layer of the first when neither is given, as transformers."""
    named = hf.get(key)
    if named is None and hf.get(release_key) is not None:
        flags = hf[release_key]
        named = [kinds[bool(f)] for f in flags] if isinstance(flags, list) else flags
    if named is None:
        named = [kinds[0]] * layers
    if not (isinstance(named, list) and len(named) == layers and set(named) <= set(kinds)):
        raise ConfigError(f"config.json: {key} is not {layers} of {', '.join(map(repr, kinds))}")
    return [i for i, kind in enumerate(named) if kind == kinds[1]]


class MiniMaxM3(Adapter):
    model_types = ("minimax_m3_vl_text",)
    model_type_aliases = ("minimax_m3_vl",)
    tiny_models = {"minimax_m3_vl_text": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.MINIMAXM2  # the tensor names M3 shares with M2
    moe_block = "block_sparse_moe"
    expert_leaves = ("w1", "w3", "w2")
    router_bias_leaf = "e_score_correction_bias"  # beside the router, not in it
    zero_centred_norms = True
    gguf_leading_dense = True
    gguf_norm_topk = True

    @property
    def gguf_arch_name(self) -> str:
        return "minimax-m3"

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, dense, shared, layers = require(
            hf, "num_local_experts", "num_experts_per_tok", "intermediate_size", "dense_intermediate_size",
            "shared_intermediate_size", "num_hidden_layers")
        sparse = hf.get("sparse_attention_config") or {}
        index = {key: hf.get(key, sparse.get(release)) for key, release in SPARSE_KEYS.items()}
        if not isinstance(sparse, dict) or any(v is None for v in index.values()):
            raise ConfigError(f"config.json lacks {', '.join(k for k, v in index.items() if v is None)} "
                              "(or sparse_attention_config's)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("qk_norm_type", "per_head") != "per_head" \
                or not hf.get("use_qk_norm", True):
            raise ConfigError(f"config.json: scoring_func {hf.get('scoring_func')!r}, qk_norm_type {hf.get('qk_norm_type')!r}"
                              f", use_qk_norm {hf.get('use_qk_norm')!r}: MiniMax-M3 routes by sigmoid and normalizes "
                              "q and k per head")
        if hf.get("hidden_act") == "swigluoai":  # the release's name for the GLU every FFN applies
            hf = {**hf, "hidden_act": "silu"}
        fields = common_fields(hf, "minimax_m3_vl_text", self.gguf_arch)
        indexed = _per_layer({**hf, "sparse_attention_freq": sparse.get("sparse_attention_freq")}, "layer_types",
                             "sparse_attention_freq", (FULL, SPARSE), layers)
        moe = _per_layer(hf, "mlp_layer_types", "moe_layer_freq", ("dense", "sparse"), layers)
        return ModelConfig(
            **fields,
            qk_norm="head",
            index_topk=index["index_topk_blocks"],
            index_heads=index["index_n_heads"],
            index_head_dim=index["index_head_dim"],
            index_layers=indexed if index["index_topk_blocks"] else [],
            index_block=index["index_block_size"],
            index_local_blocks=index["index_local_blocks"],
            dense_ffn=dense,
            moe_layers=moe,
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            expert_glu="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", SWIGLU[0])),
            swiglu_limit=float(hf.get("swiglu_limit", SWIGLU[1])),
            router="sigmoid",
            router_norm_topk=True,
            router_bias=True,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            n_shared_experts=1,  # transformers builds one, whatever n_shared_experts says
            shared_expert_ffn=shared,
        )

    def skips(self, name: str, c: ModelConfig) -> bool:
        return bool(_MTP.search(name))

    def mtp_layers(self, hf: dict) -> int:
        return 0  # not among the decoder layers: the release keeps them under `mtp.`

    def attention_tensors(self, c: ModelConfig, p: str, layer: int) -> dict[str, tuple]:
        tensors = super().attention_tensors(c, p, layer)
        if layer in c.index_layers:
            a, i, w = f"{p}.self_attn", c.index_heads, c.index_head_dim
            tensors.update({f"{a}.index_q_proj.weight": (i * w, c.hidden_size), f"{a}.index_k_proj.weight": (w, c.hidden_size),
                            f"{a}.index_q_norm.weight": (w,), f"{a}.index_k_norm.weight": (w,)})
        return tensors

    def canonical_name(self, hf_name: str, n_layers: int) -> str | None:
        match = _LAYER.fullmatch(hf_name)
        if match and match.group(2) in OWN_NAMES:
            return f"blk.{match.group(1)}.{OWN_NAMES[match.group(2)]}"
        return super().canonical_name(hf_name, n_layers)

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        views = super().resident_views(name, shape, c)
        if name.endswith("norm.weight"):  # every RMSNorm applies 1 + w
            return [view._replace(transform="plus_one") for view in views]
        return views

    # --- GGUF: llama.cpp's minimax-m3 --------------------------------------------------

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        arch = self.gguf_arch_name
        for key, value in (("head_count", c.index_heads), ("key_length", c.index_head_dim), ("top_k", c.index_topk),
                           ("block_size", c.index_block), ("local_blocks", c.index_local_blocks)):
            writer.add_uint32(f"{arch}.attention.indexer.{key}", value)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        arch, index = meta.arch, {}
        for field, key in (("index_heads", "head_count"), ("index_head_dim", "key_length"), ("index_topk", "top_k"),
                           ("index_block", "block_size"), ("index_local_blocks", "local_blocks")):
            value = meta.source.get(f"{arch}.attention.indexer.{key}")
            if not (isinstance(value, int) and not isinstance(value, bool)):
                raise GGUFError(f"{meta.file}: {arch}.attention.indexer.{key} is {value!r:.40}, not a whole number")
            index[field] = value
        # llama.cpp's graph: every layer from the first MoE one on is sparse
        return {**index, "index_layers": fields["moe_layers"], "router": "sigmoid", "expert_glu": "clamped_swiglu",
                "swiglu_alpha": SWIGLU[0], "swiglu_limit": SWIGLU[1]}

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if c.index_layers != c.moe_layers:
            problems.append(f"llama.cpp's minimax-m3 makes the MoE layers {c.moe_layers} sparse, not {c.index_layers}")
        if (c.swiglu_alpha, c.swiglu_limit) != SWIGLU:
            problems.append(f"llama.cpp's minimax-m3 has swiglu alpha {SWIGLU[0]} and limit {SWIGLU[1]}, not "
                            f"{c.swiglu_alpha} and {c.swiglu_limit}")
        if c.shared_expert_ffn != c.expert_ffn * c.n_shared_experts:
            problems.append(f"llama.cpp's minimax-m3 sizes the shared expert as the routed ones ({c.expert_ffn}), "
                            f"not {c.shared_expert_ffn}")
        return problems
