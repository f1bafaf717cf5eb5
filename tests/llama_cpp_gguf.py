"""GGUF files written the way llama.cpp's converter writes them (test helper).

``write_reference_gguf(src, out)`` reads a tiny Hugging Face checkpoint (F32 safetensors)
and writes, with gguf-py's own ``GGUFWriter`` -- never colibri's exporter -- what
``convert_hf_to_gguf.py --outtype f32`` writes (llama.cpp as vendored by
llama-cpp-python 0.3.36, ``conversion/{base,llama,qwen,olmo,deepseek,glm,minimax,gpt_oss,dots1,ernie,hunyuan,mimo,kimi_linear}.py``):

* the metadata of ``TextModel.set_gguf_parameters`` and of each model class;
* tensor names from gguf's ``TensorNameMap`` (``map_tensor_name``), with
  ``e_score_correction_bias`` renamed to ``e_score_correction.bias`` first;
* routed experts stacked per layer ([experts, rows, cols]);
* ``llama``: Q and K rows permuted by ``LlamaModel.permute``;
* DeepSeek: ``kv_b_proj`` split into ``attn_k_b`` (transposed per head) and ``attn_v_b``,
  MTP layers dropped, ``head_count_kv`` 1 and the MLA key/value lengths;
* GLM-4.5 and GLM-5: the MTP layer kept, ``block_count`` counting it, ``nextn_predict_layers``;
  GLM-5's indexer keys;
* Kimi-Linear: per-layer ``head_count_kv`` (0 on the KDA layers), the KDA convolutions
  [1, channels, 1, kernel], ``-exp(A_log)``, ``dt_bias`` as ``dt_proj.bias``;
* GLM-5-Next: Kimi-Linear's KDA tensors and per-layer ``head_count_kv``, MLA without rotation, the
  indexer's pools, the hyper-connections (bare ``hc_*`` named ``.weight``), the clamps per layer;
* Llama 4: ``feed_forward_length`` the dense layers' width, the transposed ``gate_up_proj``
  split into gate and up halves, ``down_proj`` transposed;
* MiniMax-M3: every norm's 1 added, the indexer, shared expert and dense FFN by llama.cpp's names,
  the indexer's keys and the leading dense layers from the release's config keys;
* gpt-oss: ``sinks`` named ``.weight``, the transposed ``gate_up_proj`` (and its bias) split
  into gate and up by alternate columns, ``down_proj`` transposed;
* Qwen3-Next and Qwen3.5-MoE: ``-exp(A_log)``, the zero-centred norms plus one, the
  convolution squeezed, Qwen3-Next's ``in_proj_qkvz`` split into ``attn_qkv`` and
  ``attn_gate``, Qwen3.5's value heads reordered from grouped to tiled;
* optionally (``fuse_gate_up``, the converter's ``fuse_gate_up_exps``) each layer's gate and
  up experts in one ``ffn_gate_up_exps`` tensor [experts, 2·ffn, hidden].

The architecture's facts (llama.cpp's architecture, permuted Q/K, MTP layers kept, where
the experts live) come from its adapter; each llama.cpp model class's own keys are one
function below, found by the architecture llama.cpp stores it as.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from colibri.convert.arch import ADAPTERS
from colibri.convert.gguf_tokenizer import add_tokenizer_metadata

EXPERT = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_checkpoint(src: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def add_metadata(w: gguf.GGUFWriter, hp: dict, block_count: int) -> None:
    """TextModel.set_gguf_parameters, then the model class's own keys."""
    adapter = ADAPTERS[hp["model_type"]]
    arch = adapter.gguf_arch
    rope = dict(hp.get("rope_scaling") or {})
    w.add_block_count(block_count)
    w.add_context_length(hp.get("max_position_embeddings", hp.get("model_max_length")))
    w.add_embedding_length(hp["hidden_size"])
    # TextModel's find_hparam order (Llama4Model swaps the two)
    ffn = hp.get("intermediate_size_mlp") if arch == gguf.MODEL_ARCH.LLAMA4 else \
        hp.get("dense_intermediate_size", hp.get("intermediate_size"))
    if ffn is not None:
        w.add_feed_forward_length(ffn)
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(1 if "kv_lora_rank" in hp else hp["num_key_value_heads"])  # MLA: DeepseekV2Model sets 1
    if rope.get("type", rope.get("rope_type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if (theta := hp.get("rope_theta") or (hp.get("rope_parameters") or {}).get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if hp.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (experts := hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")) is not None:
        w.add_expert_count(experts)
    if (used := hp.get("num_experts_per_tok", hp.get("num_experts_per_token"))) is not None:
        w.add_expert_used_count(used)
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if score := hp.get("scoring_func", hp.get("moe_router_activation_func")):
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[score.upper()])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    MODEL_CLASS_KEYS[adapter.gguf_arch_name](w, hp, rope)


def llama_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def qwen_moe_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])


def dots1_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    qwen_moe_keys(w, hp, rope)
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])


def ernie_moe_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_expert_count(hp["moe_num_experts"])
    w.add_expert_used_count(hp["moe_k"])
    w.add_interleave_moe_layer_step(hp["moe_layer_interval"])
    w.add_leading_dense_block_count(hp["moe_layer_start_index"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["moe_num_shared_experts"])
    if hp["moe_num_shared_experts"]:  # the converter's own formula
        w.add_expert_shared_feed_forward_length(hp["intermediate_size"] // hp["num_key_value_heads"])


def hunyuan_moe_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_expert_shared_feed_forward_length(hp["intermediate_size"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"][0])
    w.add_expert_used_count(hp["moe_topk"][0])
    w.add_expert_shared_count(hp["num_shared_expert"][0])
    if rope.get("type") == "dynamic":  # NTK alpha folded into the base (the converter's width: hidden / heads)
        dim = hp["hidden_size"] // hp["num_attention_heads"]
        w.add_rope_freq_base(hp["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
        w.add_context_length(256 * 1024)


def olmoe_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_layer_norm_rms_eps(1e-5)


def deepseek2_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    rank, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def glm4moe_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * hp.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_nextn_predict_layers(hp["num_nextn_predict_layers"])


def minimaxm2_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_rope_dimension_count(hp["rotary_dim"])


def minimaxm3_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """MiniMaxM3Model: MiniMaxM2Model's keys, the shared expert, the routed scale, the indexer's
    (gguf-py's add_indexer_* helpers are newer than the gguf package here: the same keys by name),
    the leading dense layers counted from the release's moe_layer_freq."""
    minimaxm2_keys(w, hp, rope)
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(True)
    sparse, keys = hp["sparse_attention_config"], f"{w.arch}.attention.indexer."
    for key, value in (("head_count", "sparse_num_index_heads"), ("key_length", "sparse_index_dim"),
                       ("top_k", "sparse_topk_blocks"), ("block_size", "sparse_block_size"),
                       ("local_blocks", "sparse_local_block")):
        w.add_uint32(keys + key, sparse[value])
    w.add_leading_dense_block_count(next(i for i, moe in enumerate(hp["moe_layer_freq"] + [1]) if moe))


# llama.cpp's minimax-m3 tensors the gguf package here does not map (its tensor_mapping.py's "MSA" and
# "kimi" lines, and the dense FFN minimax-m2 lacks)
MINIMAX_M3_NAMES = {
    **{f"self_attn.index_{part}": f"indexer.{part}" for part in ("q_proj", "k_proj", "q_norm", "k_norm")},
    **{f"block_sparse_moe.shared_experts.{m}_proj": f"ffn_{m}_shexp" for m in ("gate", "up", "down")},
    **{f"mlp.{m}_proj": f"ffn_{m}" for m in ("gate", "up", "down")},
}


def minimaxm3_tensors(name: str, data: np.ndarray):
    """MiniMaxM3Model.modify_tensors: every norm's 1 added; the names gguf lacks, by MINIMAX_M3_NAMES."""
    if name.endswith("norm.weight"):
        data = data + 1.0
    layer = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
    if layer and layer.group(2) in MINIMAX_M3_NAMES:
        name = f"blk.{layer.group(1)}.{MINIMAX_M3_NAMES[layer.group(2)]}.weight"
    yield name, data


def glm_dsa_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """GlmMoeDsaModel and DeepseekV32Model: DeepseekV2Model's keys, the MTP layers kept, the
    indexer's (gguf-py's add_indexer_* helpers are newer than the gguf package here: the same
    keys by name)."""
    deepseek2_keys(w, hp, rope)
    w.add_nextn_predict_layers(hp["num_nextn_predict_layers"])
    keys = f"{w.arch}.attention.indexer."
    w.add_uint32(keys + "head_count", hp["index_n_heads"])
    w.add_uint32(keys + "key_length", hp["index_head_dim"])
    w.add_uint32(keys + "top_k", hp["index_topk"])
    if hp.get("indexer_types") is not None:
        w.add_array(keys + "types", [t == "full" for t in hp["indexer_types"]])


def gpt_oss_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])


def qwen3next_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """Qwen3NextModel (and Qwen3.5-MoE's, which adds its M-RoPE sections)."""
    qwen_moe_keys(w, hp, rope)
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if hp.get("layer_types") is not None:
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in hp["layer_types"]])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    partial = hp.get("partial_rotary_factor") or (hp.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(hp["head_dim"] * partial))
    if w.arch == "qwen35moe":
        w.add_rope_dimension_sections([11, 11, 10, 0])


def mimo2_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """MimoV2Model, on the config as AutoConfig gives it (a sliding query sees `sliding_window_size`
    earlier positions), converted without its MTP layers (`--no-mtp`)."""
    pattern = hp["hybrid_layer_pattern"]
    w.add_head_count_kv([hp["swa_num_key_value_heads"] if p == 1 else hp["num_key_value_heads"] for p in pattern])
    w.add_sliding_window(hp["sliding_window_size"] + 1)
    w.add_sliding_window_pattern([p == 1 for p in pattern])
    w.add_value_length(hp["v_head_dim"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_rope_freq_base_swa(hp["swa_rope_theta"])
    w.add_rope_dimension_count(int(hp["head_dim"] * hp["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(hp["layernorm_epsilon"])
    w.add_float32(f"{w.arch}.attention.value_scale", hp["attention_value_scale"])


def llama4_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """Llama4Model (LlamaModel's keys, then its own)."""
    llama_keys(w, hp, rope)
    w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    if hp.get("layer_types") and all(kind == "full_attention" for kind in hp["layer_types"]):
        w.add_sliding_window(0)


def llama4_tensors(name: str, data: np.ndarray):
    """Llama4Model.modify_tensors: the transposed gate_up_proj split into gate and up, down_proj transposed."""
    if name.endswith("gate_up_proj"):
        gate, up = np.split(data.swapaxes(-1, -2), 2, axis=-2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), gate
        yield name.replace("gate_up_proj", "up_proj.weight"), up
    elif name.endswith("down_proj"):
        yield name + ".weight", data.swapaxes(-1, -2)
    else:
        yield name, data


def kimi_linear_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """KimiLinearModel: head_count_kv 0 on the KDA layers, MLA's widths, the KDA head width."""
    spec = hp["linear_attn_config"]
    w.add_vocab_size(hp["vocab_size"])
    w.add_head_count_kv([1 if i + 1 in spec["full_attn_layers"] else 0 for i in range(hp["num_hidden_layers"])])
    w.add_ssm_conv_kernel(spec["short_conv_kernel_size"])
    w.add_kda_head_dim(spec["head_dim"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["num_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])


def kimi_linear_tensors(name: str, data: np.ndarray):
    """KimiLinearModel.modify_tensors: convolutions [1, channels, 1, kernel], A = -exp(A_log), dt_bias renamed."""
    if name.endswith("_conv1d.weight"):
        data = data.reshape(1, data.shape[0], 1, data.shape[-1])
    elif name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    yield name, data


def glm5next_keys(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """Glm5NextModel: head_count_kv 0 on the KDA layers, the KDA width and gate bound, MLA's widths
    (no rotation), the indexer's over pools, the hyper-connections, the MoE's and its clamps (the
    gguf package here predates its add_* helpers: the same keys by name)."""
    layers, spec, arch = hp["num_hidden_layers"], hp["linear_attn_config"], w.arch
    w.add_head_count_kv([0 if kind == "linear_attention" else 1 for kind in hp["layer_types"]])
    w.add_vocab_size(hp["vocab_size"])
    w.add_layer_norm_eps(1e-6)
    w.add_ssm_conv_kernel(spec["short_conv_kernel_size"])
    w.add_kda_head_dim(spec["head_dim"])
    if spec.get("gate_lower_bound") is not None:
        w.add_float32(f"{arch}.kda.gate_lower_bound", spec["gate_lower_bound"])
    w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_rope_dimension_count(0)
    w.add_key_length(hp["kv_lora_rank"])
    w.add_value_length(hp["kv_lora_rank"])
    w.add_key_length_mla(hp["qk_nope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    indexer = f"{arch}.attention.indexer."
    for key, value in (("head_count", "index_n_heads"), ("key_length", "index_head_dim"), ("top_k", "index_topk"),
                       ("kpool", "index_kpool")):
        w.add_uint32(indexer + key, hp[value])
    w.add_bool(indexer + "kpool_select_tail", hp.get("index_kpool_always_select_tail", True))
    w.add_array(indexer + "types", [t == "full" for t in hp["indexer_types"]])
    w.add_uint32(f"{arch}.hyper_connection.count", hp["hc_mult"])
    w.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", hp["hc_sinkhorn_iters"])
    w.add_float32(f"{arch}.hyper_connection.epsilon", hp["hc_eps"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_array(f"{arch}.swiglu_clamp_exp", [hp["swiglu_limit"]] * layers)
    w.add_array(f"{arch}.swiglu_clamp_shexp", [hp["swiglu_limit"]] * layers)


# llama.cpp's glm5-next tensors the gguf package here does not map (its tensor_mapping.py's glm5-next lines)
GLM5_NEXT_NAMES = {
    **{f"hc_{site}_{part}": f"hc_{site}_{part}.weight" for site in ("attn", "ffn") for part in ("fn", "base", "scale")},
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate.weight",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape.weight",
    **{f"self_attn.{x}_proj.weight": f"attn_{x}.weight" for x in ("q_a", "q_b")},
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    **{f"self_attn.indexer.{x}": f"indexer.{y}" for x, y in (("wq_b.weight", "attn_q_b.weight"), ("wk.weight", "attn_k.weight"),
       ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"), ("weights_proj.weight", "proj.weight"))},
}


def glm5next_tensors(name: str, data: np.ndarray):
    """Glm5NextModel.modify_tensors: KimiLinearModel's (convolutions, -exp(A_log), dt_bias), the
    names gguf lacks by GLM5_NEXT_NAMES."""
    layer = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if layer and layer.group(2) in GLM5_NEXT_NAMES:
        yield f"blk.{layer.group(1)}.{GLM5_NEXT_NAMES[layer.group(2)]}", data
        return
    yield from kimi_linear_tensors(name, data)


# llama.cpp's converter: one model class per architecture it writes, by llama.cpp's name
MODEL_CLASS_KEYS = {gguf.MODEL_ARCH_NAMES[arch]: keys for arch, keys in {
    gguf.MODEL_ARCH.LLAMA: llama_keys, gguf.MODEL_ARCH.QWEN2MOE: qwen_moe_keys, gguf.MODEL_ARCH.QWEN3MOE: qwen_moe_keys,
    gguf.MODEL_ARCH.OLMOE: olmoe_keys, gguf.MODEL_ARCH.DEEPSEEK2: deepseek2_keys, gguf.MODEL_ARCH.GLM4_MOE: glm4moe_keys,
    gguf.MODEL_ARCH.MINIMAXM2: minimaxm2_keys, gguf.MODEL_ARCH.GPT_OSS: gpt_oss_keys, gguf.MODEL_ARCH.GLM_DSA: glm_dsa_keys,
    gguf.MODEL_ARCH.QWEN3NEXT: qwen3next_keys, gguf.MODEL_ARCH.QWEN35MOE: qwen3next_keys, gguf.MODEL_ARCH.DOTS1: dots1_keys,
    gguf.MODEL_ARCH.ERNIE4_5_MOE: ernie_moe_keys, gguf.MODEL_ARCH.HUNYUAN_MOE: hunyuan_moe_keys,
    gguf.MODEL_ARCH.MIMO2: mimo2_keys, gguf.MODEL_ARCH.LLAMA4: llama4_keys, gguf.MODEL_ARCH.KIMI_LINEAR: kimi_linear_keys,
}.items()} | {"deepseek32": glm_dsa_keys, "minimax-m3": minimaxm3_keys, "glm5-next": glm5next_keys}


def v_heads_tiled(data: np.ndarray, axis: int, hp: dict, width: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head → tiled."""
    k, r = hp["linear_num_key_heads"], hp["linear_num_value_heads"] // hp["linear_num_key_heads"]
    data = np.moveaxis(data, axis, 0)
    shape = data.shape
    data = data.reshape(k, r, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(data, 0, axis))


def qwen3next_tensors(name: str, data: np.ndarray, hp: dict, tiled: bool):
    """Qwen3NextModel.modify_tensors (with Qwen3.5's value-head reorder when `tiled`)."""
    k_dim, v_dim = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    keys = 2 * k_dim * hp["linear_num_key_heads"]
    if tiled and "linear_attn." in name and hp["linear_num_key_heads"] != hp["linear_num_value_heads"]:
        if ".in_proj_qkv." in name or ".conv1d" in name:
            data = np.concatenate([data[:keys], v_heads_tiled(data[keys:], 0, hp, v_dim)])
        elif ".in_proj_z." in name:
            data = v_heads_tiled(data, 0, hp, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            data = v_heads_tiled(data, 0, hp, 1)
        elif ".out_proj." in name:
            data = v_heads_tiled(data, 1, hp, v_dim)
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    if "in_proj_qkvz.weight" in name:
        heads, widths = hp["linear_num_key_heads"], [k_dim, k_dim, *[hp["linear_num_value_heads"] // hp["linear_num_key_heads"] * v_dim] * 2]
        grouped = data.T.reshape(data.shape[1], heads, sum(widths))
        q, k, v, z = np.split(grouped, np.cumsum(widths)[:-1], axis=-1)
        flat = [part.reshape(data.shape[1], -1) for part in (q, k, v, z)]
        yield name.replace("in_proj_qkvz", "in_proj_qkv"), np.concatenate(flat[:3], axis=1).T
        yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3].T
    else:
        yield name, data


def gpt_oss_tensors(name: str, data: np.ndarray):
    """GptOssModel.modify_tensors of a float checkpoint: (Hugging Face-style name, array) pairs."""
    if name.endswith("sinks"):
        yield name + ".weight", data
    elif name.endswith("gate_up_proj_bias"):
        yield name.replace("gate_up_proj_bias", "gate_proj.bias"), data[..., ::2]
        yield name.replace("gate_up_proj_bias", "up_proj.bias"), data[..., 1::2]
    elif name.endswith("gate_up_proj"):
        data = data.swapaxes(-1, -2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), data[:, ::2]
        yield name.replace("gate_up_proj", "up_proj.weight"), data[:, 1::2]
    elif name.endswith("down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), data
    elif name.endswith("down_proj"):
        yield name.replace("down_proj", "down_proj.weight"), data.swapaxes(-1, -2)
    else:
        yield name, data


def gguf_tensors(tensors: dict[str, np.ndarray], hp: dict, block_count: int, fuse_gate_up: bool = False):
    """(gguf name, array) pairs in checkpoint order, as the converter's modify_tensors yields them."""
    adapter = ADAPTERS[hp["model_type"]]
    name_map = gguf.get_tensor_name_map(adapter.gguf_arch, block_count)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, data in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if not adapter.gguf_keeps_mtp and layer and int(layer.group(1)) >= hp["num_hidden_layers"]:
            continue  # DeepSeek's converter skips MTP layers
        if adapter.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hp["num_attention_heads"] if "q_proj" in name else hp["num_key_value_heads"]
            data = permute(data, heads)
        if m := EXPERT.match(name):
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = data
            continue
        if name.endswith("kv_b_proj.weight"):
            heads, nope, v = hp["num_key_value_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
            kv_b = data.reshape(heads, nope + v, data.shape[-1])
            yield name_map.get_name(name.replace("kv_b_proj.weight", "k_b_proj")) + ".weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            yield name_map.get_name(name.replace("kv_b_proj.weight", "v_b_proj")) + ".weight", np.ascontiguousarray(kv_b[:, nope:])
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if "attention_sink" in name and not name.endswith(".weight"):  # MimoV2Model.filter_tensors
            name += ".weight"
        if adapter.gguf_arch == gguf.MODEL_ARCH.GPT_OSS:
            pairs = gpt_oss_tensors(name, data)
        elif adapter.gguf_arch == gguf.MODEL_ARCH.LLAMA4:
            pairs = llama4_tensors(name, data)
        elif adapter.gguf_arch_name == "glm5-next":
            pairs = glm5next_tensors(name, data)
        elif adapter.gguf_arch == gguf.MODEL_ARCH.KIMI_LINEAR:
            pairs = kimi_linear_tensors(name, data)
        elif adapter.gguf_arch_name == "minimax-m3":
            pairs = minimaxm3_tensors(name, data)
        elif adapter.gguf_arch in (gguf.MODEL_ARCH.QWEN3NEXT, gguf.MODEL_ARCH.QWEN35MOE):
            pairs = qwen3next_tensors(name, data, hp, adapter.gguf_arch == gguf.MODEL_ARCH.QWEN35MOE)
        else:
            pairs = [(name, data)]
        for name, data in pairs:
            yield name if name.startswith("blk.") else name_map.get_name(name, try_suffixes=(".weight", ".bias")), data
    stacked = {}
    for (layer, leaf), by_expert in experts.items():
        stacked[name_map.get_name(f"{adapter.experts(layer).prefix}.{leaf}") + ".weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    for name, data in stacked.items():
        if fuse_gate_up and "ffn_gate_exps" in name:
            yield name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([data, stacked[name.replace("gate", "up")]], axis=1)
        elif not (fuse_gate_up and "ffn_up_exps" in name):
            yield name, data


def write_reference_gguf(src: Path, out: Path, split_max_size: int = 0, fuse_gate_up: bool = False) -> Path:
    """Write `out` from the F32 checkpoint `src` as llama.cpp's converter would; returns `out`."""
    src = Path(src)
    hp = json.loads((src / "config.json").read_text())
    adapter = ADAPTERS[hp["model_type"]]
    block_count = hp["num_hidden_layers"] + (hp.get("num_nextn_predict_layers") or 0) * adapter.gguf_keeps_mtp
    writer = gguf.GGUFWriter(out, adapter.gguf_arch_name, split_max_size=split_max_size)
    add_metadata(writer, hp, block_count)
    add_tokenizer_metadata(writer, src)
    for name, data in gguf_tensors(read_checkpoint(src), hp, block_count, fuse_gate_up):
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
