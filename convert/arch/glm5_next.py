"""GLM-5-Next: Kimi delta attention (KDA) layers with a "safe gate" decay, between MLA layers
that rotate nothing and attend where an indexer of pools chooses (`runtime.indexer.PoolIndexer`:
DeepSeek's scores over one key a pool of consecutive positions, plus the positions after the
last complete pool); DeepSeek-V4's hyper-connections around every block, the head a plain mean
of the streams; DeepSeek-V3's sigmoid routing with a correction bias, one shared expert, dense
first layers; every FFN a clamped SwiGLU. llama.cpp stores it as `glm5-next`, under tensor
names and keys newer than the gguf package's, kept here as strings.

The release is multimodal (`Glm5NextForConditionalGeneration`; transformers has no text-only
class): the text model is read from its `text_config` and `language_model.` tensors
(`formats.checkpoint`), in the release's names, which transformers' `save_pretrained` writes
too (q, k and v convolutions apart, the forget gate's tensors and the hyper-connections' bare
`hc_*` beside the layer's others, experts one by one). Layer kinds come from `layer_types`
(`linear_attention`; anything else is MLA), `mlp_layer_types` and `indexer_types`.
"""

import re

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, ResidentView, TinyModel, common_fields, require, sigmoid_routing
from colibri.convert.arch.deepseek_sparse import indexer_layers
from colibri.convert.arch.kimi_linear import kda_fields, sparse_layers
from colibri.convert.gguf_source import GGUFError
from colibri.formats.config_check import layer_tensors
from colibri.formats.model_config import ModelConfig

LINEAR = "linear_attention"
TINY = {  # zai-org/GLM-5-Next's text_config at tiny widths: KDA and MLA layers in turn, the MLA layers of
    # pools of 4 (a prompt is sparse from 12 positions), one sharing the indexer before it; KDA heads of
    # 256 (as Kimi-Linear's tiny model: K-quant rows in its low-rank gates)
    "architectures": ["Glm5NextForConditionalGeneration"],
    "first_k_dense_replace": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 64,
    "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "index_kpool_compress": True,
    "index_n_heads": 16,  # relu zeroes a score with 2**-heads odds: fewer ties for the top-k to break
    "index_topk": 8,
    "indexer_types": ["full", "full", "shared", "full", "full"],
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "layer_types": [LINEAR, "deepseek_sparse_attention", "deepseek_sparse_attention", LINEAR,
                    "deepseek_sparse_attention"],
    "linear_attn_config": {"gate_lower_bound": -5.0, "head_dim": 256, "num_heads": 4, "short_conv_kernel_size": 4},
    "max_position_embeddings": 1048576,
    "mla_use_nope": True,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    "model_type": "glm5_next_text",
    "moe_intermediate_size": 256,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 5,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0,
    "pad_token_id": None,  # the release's is beyond this vocabulary
    "q_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 0,
    "rms_norm_eps": 1e-05,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "v_head_dim": 64,
    "vocab_size": 512,
}

# a layer's tensors: the release's name after `model.layers.N.` → colibri's after `blk.N.`
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"hc_{site}_{part}": f"hc_{site}_{part}.weight" for site in ("attn", "ffn") for part in ("fn", "base", "scale")},
    **{f"self_attn.{x}_proj.weight": f"attn_{x}.weight" for x in "qkv"},
    **{f"self_attn.{x}_conv1d.weight": f"ssm_conv1d_{x}.weight" for x in "qkv"},
    **{f"self_attn.{x}_proj.weight": f"ssm_{x}.weight" for x in ("f_a", "f_b", "g_a", "g_b")},
    "self_attn.b_proj.weight": "ssm_beta.weight", "self_attn.A_log": "ssm_a", "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.o_norm.weight": "ssm_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate.weight",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape.weight",
    **{f"mlp.{m}_proj.weight": f"ffn_{m}.weight" for m in ("gate", "up", "down")},
    **{f"mlp.shared_experts.{m}_proj.weight": f"ffn_{m}_shexp.weight" for m in ("gate", "up", "down")},
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
}
RELEASE_NAMES = {part: name for name, part in LAYER_NAMES.items()}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
GGUF_KEYS = {  # llama.cpp's glm5-next keys (after `glm5-next.`) newer than the gguf package
    "indexer_kpool": "attention.indexer.kpool", "indexer_tail": "attention.indexer.kpool_select_tail",
    "gate_lower_bound": "kda.gate_lower_bound", "streams": "hyper_connection.count",
    "sinkhorn": "hyper_connection.sinkhorn_iterations", "hyper_eps": "hyper_connection.epsilon",
}
INDEXER = "attention.indexer."


def _kda_layers(hf: dict, layers: int) -> list[int]:
    """The KDA layers, from `layer_types` (transformers' default when absent: all but every fourth)."""
    kinds = hf.get("layer_types")
    if kinds is None:
        return [i for i in range(layers) if i % 4 != 3]
    if not (isinstance(kinds, list) and len(kinds) == layers and all(isinstance(k, str) for k in kinds)):
        raise ConfigError(f"config.json: layer_types is not {layers} layer kinds")
    return [i for i, kind in enumerate(kinds) if kind == LINEAR]


class Glm5Next(Adapter):
    model_types = ("glm5_next_text",)
    model_type_aliases = ("glm5_next",)  # a flat config.json under the multimodal wrapper's type
    tiny_models = {"glm5_next_text": TinyModel(TINY, "glm")}
    gguf_arch = gguf.MODEL_ARCH.KIMI_LINEAR  # the tensor names it shares with llama.cpp's kimi-linear
    gguf_leading_dense = True
    gguf_split_kv_b = True
    gguf_norm_topk = True
    gguf_linear_kv_zero = True

    @property
    def gguf_arch_name(self) -> str:
        return "glm5-next"

    def normalize(self, hf: dict) -> ModelConfig:
        kv_rank, nope, v_dim, q_rank = require(hf, "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")
        experts, used, ffn, layers = require(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                             "num_hidden_layers")
        topk, index_heads, index_dim = require(hf, "index_topk", "index_n_heads", "index_head_dim")
        if hf.get("qk_rope_head_dim", 0) or hf.get("mla_use_nope") is False:
            raise ConfigError("config.json: a rotated MLA (qk_rope_head_dim > 0) is not GLM-5-Next's")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json: scoring_func {hf['scoring_func']!r} (GLM-5-Next routes by sigmoid)")
        if hf.get("index_kpool_always_select_tail", True) is not True or hf.get("index_kpool_compress", True) is not True:
            raise ConfigError("config.json: an indexer without pooled keys or without the tail "
                              "(index_kpool_compress, index_kpool_always_select_tail false) is not supported")
        spec = hf.get("linear_attn_config") or {}
        bound = spec["gate_lower_bound"] if "gate_lower_bound" in spec else hf.get("linear_lower_bound", -5.0)
        if bound is None or not isinstance(bound, (int, float)) or bound >= 0:
            raise ConfigError(f"config.json: KDA's gate_lower_bound {bound!r} is not a negative number "
                              "(colibri computes GLM-5-Next's safe gate only)")
        linear = _kda_layers(hf, layers)
        moe = sparse_layers(hf, layers, list(range(min(int(hf.get("first_k_dense_replace", 3)), layers), layers)))
        attended = [i for i in range(layers) if i not in linear]
        shared = hf.get("n_shared_experts") or 0
        fields = common_fields(hf, "glm5_next_text", self.gguf_arch)
        eps = float(hf.get("rms_norm_eps", 1e-5))
        fields.update(n_kv_heads=fields["n_heads"], head_dim=nope, v_head_dim=v_dim, rope_dim=0, rope_scaling=None,
                      norm_eps=eps)
        return ModelConfig(
            **fields,
            attention="mla",
            q_lora_rank=q_rank,
            kv_lora_rank=kv_rank,
            latent_norm_eps=eps,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=0,
            index_topk=topk,
            index_heads=index_heads,
            index_head_dim=index_dim,
            index_layers=[i for i in indexer_layers(hf, layers) if i in attended],
            index_kpool=int(hf.get("index_kpool", 16)),
            hyper_streams=int(hf.get("hc_mult", 4)),
            hyper_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
            hyper_eps=float(hf.get("hc_eps", 1e-6)),
            hyper_head_mean=True,
            linear_layers=linear,
            linear_gate_lower_bound=float(bound),
            **kda_fields(hf, heads=64, width=128),
            dense_ffn=hf.get("intermediate_size", 0),
            moe_layers=moe,
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            expert_glu="clamped_silu",
            swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
            n_shared_experts=shared,
            shared_expert_ffn=ffn * shared,
            mtp_layers_skipped=int(hf.get("num_nextn_predict_layers") or 0),
            **sigmoid_routing(hf),
        )

    def global_tensors(self, c: ModelConfig) -> dict[str, tuple]:
        d = c.hidden_size
        return {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,), "lm_head.weight": (c.vocab_size, d)}

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        """The runtime's tensors of the layer (formats.config_check), by the release's names and shapes."""
        prefix, tensors = f"blk.{layer}.", {}
        for name, shape in layer_tensors(c, layer).items():
            release = RELEASE_NAMES[name[len(prefix):]]
            tensors[f"model.layers.{layer}.{release}"] = (shape[0], 1, shape[1]) if "_conv1d." in release else shape
        return tensors

    def canonical_name(self, hf_name: str, n_layers: int) -> str | None:
        if hf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[hf_name]
        match = _LAYER.fullmatch(hf_name)
        part = LAYER_NAMES.get(match.group(2)) if match else None
        return None if part is None else f"blk.{match.group(1)}.{part}"

    def resident_views(self, name: str, shape: tuple, c: ModelConfig) -> list[ResidentView]:
        canonical = self.canonical_name(name, c.n_layers)
        if canonical is None:
            return []
        if canonical.endswith(".ssm_a"):  # stored as llama.cpp does: A = -exp(A_log)
            return [ResidentView(canonical, None, shape, transform="neg_exp")]
        if "_conv1d_" in canonical:
            return [ResidentView(canonical, None, (shape[0], shape[-1]))]
        return [ResidentView(canonical, None, shape)]

    # --- GGUF: llama.cpp's glm5-next -----------------------------------------------------

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        arch = self.gguf_arch_name
        writer.add_kv_lora_rank(c.kv_lora_rank)
        writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_ssm_conv_kernel(c.linear_conv_kernel)
        writer.add_kda_head_dim(c.linear_k_head_dim)
        for key, value in ((INDEXER + "head_count", c.index_heads), (INDEXER + "key_length", c.index_head_dim),
                           (INDEXER + "top_k", c.index_topk), (GGUF_KEYS["indexer_kpool"], c.index_kpool),
                           (GGUF_KEYS["streams"], c.hyper_streams), (GGUF_KEYS["sinkhorn"], c.hyper_sinkhorn_iters)):
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_bool(f"{arch}.{GGUF_KEYS['indexer_tail']}", True)
        writer.add_array(f"{arch}.{INDEXER}types", [layer in c.index_layers for layer in range(c.n_layers)])
        writer.add_float32(f"{arch}.{GGUF_KEYS['hyper_eps']}", c.hyper_eps)
        if c.linear_gate_lower_bound:  # absent: Kimi-Linear's decay, in llama.cpp's graph as in ours
            writer.add_float32(f"{arch}.{GGUF_KEYS['gate_lower_bound']}", c.linear_gate_lower_bound)
        writer.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-6)  # the indexer's LayerNorm
        for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            writer.add_array(f"{arch}.{key}", [c.swiglu_limit] * c.n_layers)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        from colibri.convert.gguf_arch import f32_value  # gguf_arch imports the adapters

        layers, heads, arch = fields["n_layers"], fields["n_heads"], meta.arch
        kv_heads = meta.per_layer(gguf.Keys.Attention.HEAD_COUNT_KV, layers, heads)
        linear = [i for i in range(layers) if kv_heads[i] == 0]
        full = meta.source.get(f"{arch}.{INDEXER}types")
        if full is not None and not (isinstance(full, list) and len(full) >= layers):
            raise GGUFError(f"{meta.file}: {arch}.{INDEXER}types is not one flag per layer")
        attended = [i for i in range(layers) if i not in linear]
        index_layers = attended if full is None else [i for i in attended if full[i]]
        clamps = meta.source.get(f"{arch}.swiglu_clamp_exp")
        if not (isinstance(clamps, list) and clamps and len(set(clamps)) == 1 and isinstance(clamps[0], float)):
            raise GGUFError(f"{meta.file}: {arch}.swiglu_clamp_exp is not one clamp for every layer")
        floats = {key: meta.source.get(f"{arch}.{GGUF_KEYS[key]}") for key in ("hyper_eps", "gate_lower_bound")}
        if floats["gate_lower_bound"] is None:  # llama.cpp's graph then decays as Kimi-Linear does
            floats["gate_lower_bound"] = 0.0
        for key, value in floats.items():
            if not isinstance(value, float):
                raise GGUFError(f"{meta.file}: {arch}.{GGUF_KEYS[key]} is {value!r:.40}, not a float")
        if meta.source.get(f"{arch}.{GGUF_KEYS['indexer_tail']}", True) is not True:
            raise GGUFError(f"{meta.file}: {arch}.{GGUF_KEYS['indexer_tail']} is not true (colibri's pools keep the tail)")
        width, nope = meta.require(gguf.Keys.KDA.HEAD_DIM), meta.require(gguf.Keys.Attention.KEY_LENGTH_MLA)
        return dict(
            architecture=self.model_types[0], attention="mla", n_kv_heads=heads, head_dim=nope,
            v_head_dim=meta.require(gguf.Keys.Attention.VALUE_LENGTH_MLA), rope_dim=0, rope_scaling=None,
            q_lora_rank=meta.require(gguf.Keys.Attention.Q_LORA_RANK), kv_lora_rank=meta.require(gguf.Keys.Attention.KV_LORA_RANK),
            latent_norm_eps=fields["norm_eps"], qk_nope_head_dim=nope, qk_rope_head_dim=0,
            index_topk=meta.require("{arch}." + INDEXER + "top_k"), index_heads=meta.require("{arch}." + INDEXER + "head_count"),
            index_head_dim=meta.require("{arch}." + INDEXER + "key_length"), index_layers=index_layers,
            index_kpool=meta.require("{arch}." + GGUF_KEYS["indexer_kpool"]),
            hyper_streams=meta.require("{arch}." + GGUF_KEYS["streams"]),
            hyper_sinkhorn_iters=meta.require("{arch}." + GGUF_KEYS["sinkhorn"]),
            hyper_eps=f32_value(floats["hyper_eps"]), hyper_head_mean=True,
            linear_layers=linear, linear_kind="kda", linear_gate_lower_bound=f32_value(floats["gate_lower_bound"]),
            linear_conv_kernel=meta.require(gguf.Keys.SSM.CONV_KERNEL), linear_k_heads=heads, linear_v_heads=heads,
            linear_k_head_dim=width, linear_v_head_dim=width, expert_glu="clamped_silu", swiglu_limit=f32_value(clamps[0]),
            router="sigmoid", router_bias=True,
        )

    def gguf_shape(self, name: str, shape: tuple) -> tuple:
        """The shapes llama.cpp's glm5-next loader reads: convolutions [kernel, 1, channels]."""
        return (shape[0], 1, shape[1]) if ".ssm_conv1d_" in name else shape

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = []
        if c.router != "sigmoid" or not c.router_norm_topk or c.router_groups != 1:
            problems.append("llama.cpp's glm5-next routes by sigmoid, renormalized, without expert groups")
        if c.hyper_streams != 4:
            problems.append(f"{c.hyper_streams} residual streams (llama.cpp's graph has 4)")
        return problems
