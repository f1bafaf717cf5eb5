"""DeepSeek-V4 (V4-Flash, V4-Pro): compressed attention (a window of one shared key-value head
in every layer, plus compressed entries: CSA layers pool 4 positions in overlapping windows and
choose by a lightning indexer, HCA layers pool 128), hyper-connections (4 residual streams),
hash-routed first layers, sqrt-softplus routing and a clamped SwiGLU. llama.cpp stores it as
`deepseek4`, under tensor names newer than the gguf package's, kept here as strings.

Checkpoints are read as transformers writes them (`model.layers.N.attn.wq_a.weight`, F32, F16 or
BF16) and as the release stores them (no `model.` prefix, read under transformers' names:
`formats.checkpoint.RELEASE_NAMES`): FP8 weights with power-of-two block scales, and routed
experts in FP4 with a power-of-two scale per 32, which become GGML MXFP4 byte for byte.
"""

import dataclasses
import re

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, ExpertNames, TinyModel, common_fields, require
from colibri.convert.gguf_source import GGUFError
from colibri.formats.config_check import OVERLAPPING_RATIO, layer_tensors
from colibri.formats.model_config import ModelConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LLAMA_HCA_RATIO, LLAMA_STREAMS = 128, 4  # what llama.cpp's deepseek4 loader and graph accept
SQRT_SOFTPLUS_GATING = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (newer than the gguf package)
DEFAULT_RATES = {CSA: OVERLAPPING_RATIO, HCA: 128}

TINY = {  # deepseek-ai/DeepSeek-V4-Flash's config.json at tiny widths, each matrix's rows whole K-quant
    # blocks; the window is 16, so that short prompts pass it (HCA pools 128, as llama.cpp requires)
    "architectures": ["DeepseekV4ForCausalLM"],
    "bos_token_id": 0,
    "compress_rates": {CSA: OVERLAPPING_RATIO, HCA: 128},
    "compress_rope_theta": 160000,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 128,
    "index_n_heads": 16,  # relu zeroes a score with 2**-heads odds: fewer ties for the top-k to break
    "index_topk": 4,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 4,
    "o_lora_rank": 64,
    "q_lora_rank": 256,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 16,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "vocab_size": 512,
}

# a layer's tensors: transformers' name after `model.layers.N.` → llama.cpp's after `blk.N.`
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{site}_{part}": f"hc_{site}_{part}.weight" for site in ("attn", "ffn") for part in ("fn", "base", "scale")},
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight", "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight", "attn.wkv.weight": "attn_kv.weight", "attn.norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    **{f"attn.{source}compressor.{leaf}": f"{target}compressor_{part}.weight"
       for source, target in (("", "attn_"), ("indexer.", "indexer_"))
       for leaf, part in (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    **{f"ffn.shared_experts.{leaf}.weight": f"ffn_{m}_shexp.weight" for leaf, m in (("w1", "gate"), ("w3", "up"), ("w2", "down"))},
}
TRANSFORMERS_NAMES = {part: name for name, part in LAYER_NAMES.items()}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
                "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def layer_ratios(hf: dict, n_layers: int) -> list[int]:
    """Each layer's compress ratio: config.json's `layer_types` with `compress_rates`, or the
    release's `compress_ratios` (one per layer, then the MTP layers'). CSA pools 4, HCA not 4."""
    kinds = hf.get("layer_types")
    if kinds is None:
        ratios = hf.get("compress_ratios")
        if not (isinstance(ratios, list) and len(ratios) >= n_layers):
            raise ConfigError(f"config.json: neither layer_types nor {n_layers} compress_ratios")
        return [int(r) for r in ratios[:n_layers]]
    rates = {**DEFAULT_RATES, **(hf.get("compress_rates") or {})}
    if not (isinstance(kinds, list) and len(kinds) == n_layers and set(kinds) <= {SLIDING, CSA, HCA}):
        raise ConfigError(f"config.json: layer_types is not {n_layers} of {SLIDING}, {CSA}, {HCA}")
    if rates[CSA] != OVERLAPPING_RATIO or rates[HCA] in (0, OVERLAPPING_RATIO):
        raise ConfigError(f"config.json: compress_rates {rates} (colibri, like llama.cpp, pools 4 in CSA, more in HCA)")
    return [0 if kind == SLIDING else int(rates[kind]) for kind in kinds]


def rope_parts(hf: dict) -> tuple[float, float, dict | None]:
    """(the window layers' theta, the compressed layers' theta, their YaRN scaling) from
    `rope_parameters` {main, compress} or the release's rope_theta, compress_rope_theta,
    rope_scaling."""
    params = hf.get("rope_parameters") or {}
    main, compress = params.get("main") or {}, params.get("compress") or {}
    theta = float(main.get("rope_theta", hf.get("rope_theta", 10000.0)))
    compress_theta = float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0)))
    return theta, compress_theta, compress_yarn(compress or hf.get("rope_scaling") or {})


def compress_yarn(scaling: dict) -> dict | None:
    """The compressed layers' YaRN as colibri keeps it: the keys llama.cpp stores, and unit
    magnitude (attention_factor 1, as transformers and llama.cpp's deepseek4 apply it)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    kept = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    return {"type": kind, **{k: scaling[k] for k in kept if scaling.get(k) is not None}, "attention_factor": 1.0}


class DeepseekV4(Adapter):
    model_types = ("deepseek_v4",)
    tiny_models = {"deepseek_v4": TinyModel(TINY, "deepseek")}
    gguf_arch = gguf.MODEL_ARCH.DEEPSEEK2  # the tensor names V4 shares with V3 (token_embd, ffn_*_shexp, ...)
    expert_leaves = ("w1", "w3", "w2")
    skipped_prefixes = ("mtp.",)  # the release's multi-token-prediction block
    integer_tensors = ("ffn.gate.tid2eid",)  # the hash layers' token → experts tables

    gguf_ffn_is_expert = True
    gguf_rope_interleaved = True

    @property
    def gguf_arch_name(self) -> str:
        return "deepseek4"

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, q_rank = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                             "q_lora_rank")
        topk, index_heads, index_dim, groups, group_rank = require(hf, "index_topk", "index_n_heads", "index_head_dim",
                                                                   "o_groups", "o_lora_rank")
        if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ConfigError(f"config.json: scoring_func {hf['scoring_func']!r} (DeepSeek-V4 routes by sqrtsoftplus)")
        fields = common_fields(hf, "deepseek_v4", self.gguf_arch, windows=True)
        n_layers, head_dim = fields["n_layers"], fields["head_dim"]
        ratios = layer_ratios(hf, n_layers)
        hashed = min(max(int(hf.get("num_hash_layers", 3)), 0), n_layers)  # (a count from a stranger's file)
        kinds = hf.get("mlp_layer_types") or ["hash_moe"] * hashed + ["moe"] * n_layers
        theta, compress_theta, compress_scaling = rope_parts(hf)
        rope_dim = int(hf.get("qk_rope_head_dim") or fields["rope_dim"])
        n_shared = int(hf.get("n_shared_experts") or 0)
        fields.update(n_kv_heads=1, v_head_dim=head_dim, rope_theta=theta, rope_scaling=None, rope_dim=rope_dim)
        return ModelConfig(
            **fields,
            attention="compressed",
            attn_sinks=True,
            sliding_window=int(hf.get("sliding_window") or 128),
            sliding_layers=list(range(n_layers)),
            q_lora_rank=q_rank,
            qk_rope_head_dim=rope_dim,
            rope_interleaved=True,
            index_topk=topk,
            index_heads=index_heads,
            index_head_dim=index_dim,
            index_layers=[i for i, ratio in enumerate(ratios) if ratio == OVERLAPPING_RATIO],
            compress_ratios=ratios,
            compress_rope_theta=compress_theta,
            compress_rope_scaling=compress_scaling,
            output_groups=groups,
            output_lora_rank=group_rank,
            hyper_streams=int(hf.get("hc_mult", 4)),
            hyper_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
            hyper_eps=float(hf.get("hc_eps", 1e-6)),
            moe_layers=list(range(n_layers)),
            hash_layers=[i for i, kind in enumerate(kinds[:n_layers]) if kind == "hash_moe"],
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            expert_glu="clamped_silu",
            swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
            router="sqrtsoftplus",
            router_norm_topk=True,  # transformers always renormalizes (norm_topk_prob is true in the releases)
            router_bias=True,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            n_shared_experts=n_shared,
            shared_expert_ffn=ffn * n_shared,
            mtp_layers_skipped=int(hf.get("num_nextn_predict_layers") or 0),
        )

    def skips(self, name: str, c: ModelConfig) -> bool:
        """The MTP block, and the release's router bias of hash layers (which choose by their table)."""
        match = _LAYER.fullmatch(name)
        return super().skips(name, c) or bool(match and match.group(2) == "ffn.gate.bias" and int(match.group(1)) in c.hash_layers)

    def mtp_layers(self, hf: dict) -> int:
        return 0  # not among the decoder layers: transformers writes none, the release keeps them under `mtp.`

    def global_tensors(self, c: ModelConfig) -> dict[str, tuple]:
        s, d = c.hyper_streams, c.hidden_size
        return {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,), "head.weight": (c.vocab_size, d),
                "model.hc_head.hc_fn": (s, s * d), "model.hc_head.hc_base": (s,), "model.hc_head.hc_scale": (1,)}

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        """The runtime's tensors of the layer (formats.config_check), by transformers' names."""
        prefix = f"blk.{layer}."
        return {f"model.layers.{layer}.{TRANSFORMERS_NAMES[name[len(prefix):]]}": shape
                for name, shape in layer_tensors(c, layer).items()}

    def experts(self, layer: int, packed: bool = False) -> ExpertNames:
        return ExpertNames(f"model.layers.{layer}.ffn.experts", self.expert_leaves)

    def canonical_name(self, hf_name: str, n_layers: int) -> str | None:
        if hf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[hf_name]
        match = _LAYER.fullmatch(hf_name)
        part = LAYER_NAMES.get(match.group(2)) if match else None
        return None if part is None else f"blk.{match.group(1)}.{part}"

    # --- GGUF: llama.cpp's deepseek4 ---------------------------------------------------

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        from colibri.convert.gguf_arch import write_rope_scaling  # gguf_arch imports the adapters

        arch, keys = self.gguf_arch_name, {}
        scaling = {k: v for k, v in (c.compress_rope_scaling or {}).items() if k != "attention_factor"}  # llama.cpp's own
        write_rope_scaling(writer, dataclasses.replace(c, rope_scaling=scaling or None))
        writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_sliding_window(c.sliding_window)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_uint32(f"{arch}.expert_gating_func", SQRT_SOFTPLUS_GATING)
        writer.add_uint32(f"{arch}.embedding_length_out", c.hidden_size * c.hyper_streams)
        for key, value in (("attention.indexer.head_count", c.index_heads), ("attention.indexer.key_length", c.index_head_dim),
                           ("attention.indexer.top_k", c.index_topk), ("attention.output_group_count", c.output_groups),
                           ("attention.output_lora_rank", c.output_lora_rank), ("hyper_connection.count", c.hyper_streams),
                           ("hyper_connection.sinkhorn_iterations", c.hyper_sinkhorn_iters),
                           ("hash_layer_count", len(c.hash_layers))):
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_float32(f"{arch}.attention.compress_rope_freq_base", c.compress_rope_theta)
        writer.add_float32(f"{arch}.hyper_connection.epsilon", c.hyper_eps)
        writer.add_array(f"{arch}.attention.compress_ratios", c.compress_ratios)
        for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            writer.add_array(f"{arch}.{key}", [c.swiglu_limit] * c.n_layers)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        from colibri.convert.gguf_arch import f32_value  # gguf_arch imports the adapters

        n_layers, arch = fields["n_layers"], meta.arch
        ratios = meta.source.get(f"{arch}.attention.compress_ratios")
        clamps = meta.source.get(f"{arch}.swiglu_clamp_exp")
        floats = {key: meta.source.get(f"{arch}.{key}") for key in ("attention.compress_rope_freq_base", "hyper_connection.epsilon")}
        if not (isinstance(ratios, list) and len(ratios) >= n_layers and all(isinstance(r, int) for r in ratios)):
            raise GGUFError(f"{meta.file}: {arch}.attention.compress_ratios is not one whole number per layer")
        if not (isinstance(clamps, list) and clamps and len(set(clamps)) == 1 and isinstance(clamps[0], float)):
            raise GGUFError(f"{meta.file}: {arch}.swiglu_clamp_exp is not one clamp for every layer")
        for key, value in floats.items():
            if not isinstance(value, float):
                raise GGUFError(f"{meta.file}: {arch}.{key} is {value!r:.40}, not a float")
        if meta.get("{arch}.expert_gating_func") != SQRT_SOFTPLUS_GATING:
            raise GGUFError(f"{meta.file}: {arch}.expert_gating_func is not sqrtsoftplus ({SQRT_SOFTPLUS_GATING})")
        ratios = ratios[:n_layers]
        return dict(
            attention="compressed", attn_sinks=True, n_kv_heads=1, v_head_dim=fields["head_dim"],
            sliding_window=meta.require(gguf.Keys.Attention.SLIDING_WINDOW), sliding_layers=list(range(n_layers)),
            q_lora_rank=meta.require(gguf.Keys.Attention.Q_LORA_RANK), qk_rope_head_dim=fields["rope_dim"],
            rope_scaling=None, compress_rope_scaling=compress_yarn(fields["rope_scaling"] or {}),
            compress_rope_theta=f32_value(floats["attention.compress_rope_freq_base"]),
            index_topk=meta.require("{arch}.attention.indexer.top_k"),
            index_heads=meta.require("{arch}.attention.indexer.head_count"),
            index_head_dim=meta.require("{arch}.attention.indexer.key_length"),
            index_layers=[i for i, ratio in enumerate(ratios) if ratio == OVERLAPPING_RATIO], compress_ratios=ratios,
            output_groups=meta.require("{arch}.attention.output_group_count"),
            output_lora_rank=meta.require("{arch}.attention.output_lora_rank"),
            hyper_streams=meta.require("{arch}.hyper_connection.count"),
            hyper_sinkhorn_iters=meta.require("{arch}.hyper_connection.sinkhorn_iterations"),
            hyper_eps=f32_value(floats["hyper_connection.epsilon"]),
            hash_layers=list(range(min(meta.require("{arch}.hash_layer_count"), n_layers))),
            expert_glu="clamped_silu", swiglu_limit=f32_value(clamps[0]), router="sqrtsoftplus", router_bias=True,
        )

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if set(c.compress_ratios) - {0, OVERLAPPING_RATIO, LLAMA_HCA_RATIO}:
            problems.append(f"compress ratios {sorted(set(c.compress_ratios))} (llama.cpp pools 4 or {LLAMA_HCA_RATIO})")
        if c.hyper_streams != LLAMA_STREAMS:
            problems.append(f"{c.hyper_streams} residual streams (llama.cpp's graph has {LLAMA_STREAMS})")
        if c.hash_layers != list(range(len(c.hash_layers))):
            problems.append(f"hash layers {c.hash_layers} are not the first ones")
        return problems
