"""convert.synthetic: hub-layout MoE checkpoints, checked against their own definition
and (when the oracle extra is installed) against what transformers builds and loads."""

from __future__ import annotations

import hashlib
import json
import math
import pathlib

import numpy as np
import pytest

from colibri.convert import synthetic as S
from colibri.formats.checkpoint import SAVED_HALVES, SAVED_NAMES, renamed_tensor

import oracle_models as O

ARCHS = list(S.ARCHITECTURES)
_ORACLE_OK, _ORACLE_WHY = O.oracle_available()


def need_oracle():
    if not _ORACLE_OK:
        pytest.skip("oracle extra not installed")


# ------------------------------------------------------------------------------------
# helpers: a tiny independent safetensors reader
# ------------------------------------------------------------------------------------

_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8, "I64": np.int64}


def read_header(path: pathlib.Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
    return json.loads(raw), 8 + n


def read_raw(path: pathlib.Path, name: str) -> tuple[str, np.ndarray]:
    """(safetensors dtype, array of the stored elements; BF16 as uint16, F8 as uint8)."""
    header, start = read_header(path)
    info = header[name]
    b, e = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + b)
        data = f.read(e - b)
    return info["dtype"], np.frombuffer(data, dtype=_NP[info["dtype"]]).reshape(info["shape"])


def weight_map(ckpt: pathlib.Path) -> dict[str, str]:
    idx = ckpt / "model.safetensors.index.json"
    if idx.exists():
        return json.loads(idx.read_text())["weight_map"]
    header, _ = read_header(ckpt / "model.safetensors")
    return {k: "model.safetensors" for k in header if k != "__metadata__"}


def read_tensor(ckpt: pathlib.Path, name: str) -> tuple[str, np.ndarray]:
    return read_raw(ckpt / weight_map(ckpt)[name], name)


def decoded(ckpt: pathlib.Path, name: str) -> np.ndarray:
    dt, raw = read_tensor(ckpt, name)
    if dt == "BF16":
        return S.bf16_bits_to_float32(raw)
    if dt == "F8_E4M3":
        return S.fp8_e4m3_to_float32(raw)
    return raw.astype(np.float32)


def mtp_prefixes(cfg: dict) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}." for i in S.mtp_layer_indices(cfg))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache: dict = {}

    def get(arch, dtype="bf16", fused=False, **kw):
        key = (arch, dtype, fused, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}-{int(fused)}")
            cache[key] = S.write_checkpoint(out, arch, dtype=dtype, fused_experts=fused, **kw)
        return cache[key]

    return get


# ------------------------------------------------------------------------------------
# layout, index, config
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_index_and_plan(ckpt, arch):
    path = ckpt(arch)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"):
        assert (path / f).is_file(), f
    index = json.loads((path / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    files = sorted(set(wmap.values()))
    assert len(files) >= 2 and files == sorted(p.name for p in path.glob("*.safetensors"))
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    seen: dict[str, str] = {}
    total = 0
    for f in files:
        header, start = read_header(path / f)
        assert (start - 8) % 8 == 0
        assert header.pop("__metadata__") == {"format": "pt"}
        end = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            assert name not in seen, f"{name} in {seen[name]} and {f}"
            seen[name] = f
            b, e = info["data_offsets"]
            assert b == end and e - b == math.prod(info["shape"]) * np.dtype(_NP[info["dtype"]]).itemsize
            end = e
        assert (path / f).stat().st_size == start + end
        total += end
    assert seen == wmap  # every tensor exactly once, in the file the index names
    assert index["metadata"]["total_size"] == total

    plan = S.checkpoint_plan(arch)
    assert {s.name: (list(s.shape), s.dtype) for s in plan} == {
        name: (info["shape"], info["dtype"])
        for f in files
        for name, info in read_header(path / f)[0].items()
        if name != "__metadata__"
    }
    for s in plan:  # K-quant friendly: every matrix's input dimension is a multiple of 256
        if sum(d > 1 for d in s.shape) >= 2 and s.kind not in ("conv", "table", "score_bias", "position_bias"):  # taps,
            # ids, ERNIE's [1, E] bias, pools' position biases, vectors with unit dimensions (Kimi-Linear's A_log): no matrix
            assert s.shape[-1] % 256 == 0, s


_MUST_HAVE = {
    "mimo_v2_flash": {  # a dense full layer, then sliding ones: twice the KV heads, sinks; values narrower than keys
        "model.layers.0.mlp.down_proj.weight": [256, 256],
        "model.layers.0.self_attn.k_proj.weight": [96, 256],
        "model.layers.1.self_attn.k_proj.weight": [192, 256],
        "model.layers.1.self_attn.v_proj.weight": [128, 256],
        "model.layers.1.self_attn.attention_sink_bias": [4],
        "model.layers.2.mlp.gate.e_score_correction_bias": [8],
    },
    "hunyuan_v1_moe": {  # the router's `wg`, the q/k norms' names, one shared MLP
        "model.layers.1.mlp.gate.wg.weight": [8, 256],
        "model.layers.1.self_attn.query_layernorm.weight": [64],
        "model.layers.1.mlp.shared_mlp.gate_proj.weight": [256, 256],
    },
    "ernie4_5_moe": {  # a dense first layer; the correction bias stored as one group's
        "model.layers.0.mlp.up_proj.weight": [512, 256],
        "model.layers.1.mlp.moe_statics.e_score_correction_bias": [1, 8],
        "model.layers.2.mlp.shared_experts.down_proj.weight": [256, 256],
    },
    "dots1": {  # a dense first layer, then routed experts with a correction bias and a shared expert
        "model.layers.0.mlp.gate_proj.weight": [512, 256],
        "model.layers.1.self_attn.q_norm.weight": [64],
        "model.layers.1.mlp.gate.e_score_correction_bias": [8],
        "model.layers.1.mlp.shared_experts.up_proj.weight": [256, 256],
        "model.layers.2.mlp.experts.7.down_proj.weight": [256, 256],
    },
    "deepseek_v4": {  # a window, CSA, HCA and CSA layer; the first routed by its token table
        "model.layers.0.ffn.gate.tid2eid": [512, 2],
        "model.layers.0.hc_attn_fn": [24, 1024],
        "model.layers.0.attn.attn_sink": [4],
        "model.layers.1.ffn.gate.bias": [8],
        "model.layers.1.attn.compressor.ape": [4, 512],
        "model.layers.1.attn.indexer.compressor.ape": [4, 256],
        "model.layers.1.attn.indexer.weights_proj.weight": [16, 256],
        "model.layers.2.attn.compressor.ape": [128, 256],
        "model.layers.3.ffn.experts.7.w3.weight": [256, 256],
        "model.hc_head.hc_fn": [4, 1024],
    },
    "mixtral": {
        "model.layers.1.block_sparse_moe.gate.weight": [8, 256],
        "model.layers.1.block_sparse_moe.experts.7.w1.weight": [256, 256],
        "model.layers.1.block_sparse_moe.experts.7.w2.weight": [256, 256],
        "model.layers.1.block_sparse_moe.experts.7.w3.weight": [256, 256],
        "model.layers.1.self_attn.k_proj.weight": [128, 256],
    },
    "qwen2_moe": {
        "model.layers.0.mlp.experts.0.gate_proj.weight": [256, 256],
        "model.layers.0.mlp.shared_expert.up_proj.weight": [512, 256],
        "model.layers.0.mlp.shared_expert_gate.weight": [1, 256],
        "model.layers.0.self_attn.q_proj.bias": [256],
        "model.layers.0.self_attn.v_proj.bias": [256],
    },
    "qwen3_moe": {
        "model.layers.0.self_attn.q_proj.weight": [512, 256],
        "model.layers.0.self_attn.o_proj.weight": [256, 512],
        "model.layers.0.self_attn.q_norm.weight": [128],
        "model.layers.0.self_attn.k_norm.weight": [128],
    },
    "olmoe": {
        "model.layers.0.self_attn.q_norm.weight": [256],
        "model.layers.0.self_attn.k_norm.weight": [256],
        "model.layers.0.mlp.experts.3.down_proj.weight": [256, 256],
    },
    "deepseek_v2": {
        "model.layers.0.mlp.gate_proj.weight": [512, 256],
        "model.layers.1.self_attn.q_proj.weight": [512, 256],
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": [320, 256],
        "model.layers.1.self_attn.kv_a_layernorm.weight": [256],
        "model.layers.1.self_attn.kv_b_proj.weight": [512, 256],
        "model.layers.1.mlp.shared_experts.gate_proj.weight": [512, 256],
    },
    "deepseek_v3": {
        "model.layers.1.self_attn.q_a_proj.weight": [256, 256],
        "model.layers.1.self_attn.q_a_layernorm.weight": [256],
        "model.layers.1.self_attn.q_b_proj.weight": [512, 256],
        "model.layers.1.mlp.gate.e_score_correction_bias": [8],
        "model.layers.3.embed_tokens.weight": [512, 256],
        "model.layers.3.enorm.weight": [256],
        "model.layers.3.hnorm.weight": [256],
        "model.layers.3.eh_proj.weight": [256, 512],
        "model.layers.3.shared_head.norm.weight": [256],
        "model.layers.3.shared_head.head.weight": [512, 256],
        "model.layers.3.mlp.experts.7.down_proj.weight": [256, 256],
        "model.layers.3.self_attn.kv_b_proj.weight": [512, 256],
    },
    "kimi_k2": {
        "model.layers.2.mlp.gate.e_score_correction_bias": [8],
        "model.layers.2.mlp.shared_experts.down_proj.weight": [256, 256],
    },
    "glm4_moe": {
        "model.layers.0.mlp.up_proj.weight": [512, 256],
        "model.layers.1.self_attn.q_proj.bias": [256],
        "model.layers.1.self_attn.k_proj.bias": [128],
        "model.layers.1.self_attn.q_norm.weight": [64],
        "model.layers.1.mlp.gate.e_score_correction_bias": [8],
        "model.layers.3.eh_proj.weight": [256, 512],
        "model.layers.3.shared_head.head.weight": [512, 256],
    },
    "minimax_m2": {
        "model.layers.1.block_sparse_moe.e_score_correction_bias": [8],
        "model.layers.1.block_sparse_moe.experts.7.w3.weight": [256, 256],
        "model.layers.1.self_attn.q_norm.weight": [256],  # over the whole projection
        "model.layers.1.self_attn.k_norm.weight": [128],
    },
    "deepseek_v32": {  # the sparse attention's indexer in every layer
        "model.layers.0.self_attn.indexer.wq_b.weight": [1024, 256],
        "model.layers.2.self_attn.indexer.wk.weight": [128, 256],
        "model.layers.2.self_attn.indexer.k_norm.bias": [128],
        "model.layers.2.self_attn.indexer.weights_proj.weight": [8, 256],
    },
    "glm_moe_dsa": {"model.layers.2.self_attn.indexer.wq_b.weight": [1024, 256]},
    "qwen3_next": {  # layer 0 a DeltaNet (q, k, v, z and b, a fused per key head), layer 1 gated attention
        "model.layers.0.linear_attn.in_proj_qkvz.weight": [768, 256],
        "model.layers.0.linear_attn.in_proj_ba.weight": [8, 256],
        "model.layers.0.linear_attn.conv1d.weight": [512, 1, 4],
        "model.layers.0.linear_attn.A_log": [4],
        "model.layers.0.linear_attn.dt_bias": [4],
        "model.layers.0.linear_attn.norm.weight": [64],
        "model.layers.0.linear_attn.out_proj.weight": [256, 256],
        "model.layers.1.self_attn.q_proj.weight": [512, 256],
        "model.layers.1.mlp.shared_expert_gate.weight": [1, 256],
    },
    "qwen3_5_moe": {
        "model.layers.0.linear_attn.in_proj_qkv.weight": [512, 256],
        "model.layers.0.linear_attn.in_proj_z.weight": [256, 256],
        "model.layers.0.linear_attn.in_proj_b.weight": [4, 256],
        "model.layers.0.linear_attn.in_proj_a.weight": [4, 256],
        "model.layers.1.self_attn.q_proj.weight": [512, 256],
    },
    "gpt_oss": {  # as transformers' GptOssExperts holds them: transposed, gate and up interleaved
        "model.layers.0.self_attn.sinks": [4],
        "model.layers.0.self_attn.o_proj.bias": [256],
        "model.layers.1.mlp.router.weight": [8, 256],
        "model.layers.1.mlp.router.bias": [8],
        "model.layers.1.mlp.experts.gate_up_proj": [8, 256, 512],
        "model.layers.1.mlp.experts.gate_up_proj_bias": [8, 512],
        "model.layers.1.mlp.experts.down_proj": [8, 256, 256],
        "model.layers.1.mlp.experts.down_proj_bias": [8, 256],
    },
}
_MUST_HAVE["llama4_text"] = {  # as transformers' Llama4TextExperts holds them: transposed, gate columns then up
    "model.layers.0.feed_forward.gate_proj.weight": [512, 256],
    "model.layers.1.feed_forward.router.weight": [8, 256],
    "model.layers.1.feed_forward.experts.gate_up_proj": [8, 256, 512],
    "model.layers.1.feed_forward.experts.down_proj": [8, 256, 256],
    "model.layers.1.feed_forward.shared_expert.up_proj.weight": [256, 256],
}
_MUST_HAVE["kimi_linear"] = {  # KDA layers under self_attn as the release names them, then an MLA layer
    "model.layers.0.mlp.gate_proj.weight": [512, 256],
    "model.layers.0.self_attn.q_conv1d.weight": [1024, 1, 4],
    "model.layers.0.self_attn.A_log": [1, 1, 4, 1],
    "model.layers.0.self_attn.f_b_proj.weight": [1024, 256],
    "model.layers.1.block_sparse_moe.experts.0.w1.weight": [256, 256],
    "model.layers.2.self_attn.kv_b_proj.weight": [4 * 128, 256],
}
_MUST_HAVE["minimax_m3_vl_text"] = {  # the release's names: per-expert w1/w3/w2, the indexer as self_attn.index_*
    "model.layers.0.mlp.gate_proj.weight": [512, 256],
    "model.layers.1.self_attn.index_q_proj.weight": [2 * 64, 256],
    "model.layers.1.self_attn.index_k_norm.weight": [64],
    "model.layers.1.self_attn.q_norm.weight": [64],
    "model.layers.1.block_sparse_moe.e_score_correction_bias": [8],
    "model.layers.1.block_sparse_moe.experts.0.w1.weight": [256, 256],
    "model.layers.2.block_sparse_moe.shared_experts.up_proj.weight": [256, 256],
}
_MUST_HAVE["glm5_next_text"] = {  # the release's names: KDA with a flat forget gate and per-head A_log; MLA
    # without a rotary part; the indexer's pools; bare hyper-connections; per-expert
    "model.layers.0.self_attn.A_log": [4],
    "model.layers.0.self_attn.v_conv1d.weight": [1024, 1, 4],
    "model.layers.0.hc_attn_fn": [24, 4 * 256],
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": [256, 256],
    "model.layers.1.self_attn.indexer.index_kpool_compress_ape": [4, 64],
    "model.layers.1.self_attn.indexer.index_kpool_compress_gate": [64, 256],
    "model.layers.1.hc_ffn_scale": [3],
    "model.layers.1.mlp.experts.0.gate_proj.weight": [256, 256],
}
_MUST_NOT_HAVE = {
    "glm5_next_text": ["model.layers.2.self_attn.indexer.wk.weight", "model.layers.0.mlp.gate.weight",
                       "model.hc_head.hc_fn", "model.layers.0.self_attn.q_a_proj.weight"],
    "minimax_m3_vl_text": ["model.layers.0.self_attn.index_q_proj.weight", "model.layers.0.block_sparse_moe.gate.weight"],
    "kimi_linear": ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.q_conv1d.weight",
                    "model.layers.2.self_attn.q_a_proj.weight"],
    "llama4_text": ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.feed_forward.router.weight",
                    "model.layers.1.feed_forward.experts.gate_up_proj_bias"],
    "mimo_v2_flash": ["model.layers.0.self_attn.attention_sink_bias", "model.layers.0.mlp.gate.weight"],
    "deepseek_v4": ["model.layers.0.ffn.gate.bias", "model.layers.0.attn.compressor.ape",
                    "model.layers.2.attn.indexer.wq_b.weight", "lm_head.weight"],
    "qwen3_next": ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.linear_attn.in_proj_qkvz.weight"],
    "qwen3_5_moe": ["model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.linear_attn.in_proj_qkv.weight"],
    "glm_moe_dsa": ["model.layers.1.self_attn.indexer.wq_b.weight"],  # layer 1 shares layer 0's
    "gpt_oss": ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"],
    "mixtral": ["model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.bias"],
    "minimax_m2": ["model.layers.0.block_sparse_moe.gate.e_score_correction_bias", "model.layers.0.self_attn.q_proj.bias"],
    "qwen3_moe": ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.shared_expert_gate.weight"],
    "deepseek_v2": ["model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                    "model.layers.0.mlp.gate.weight"],
    "kimi_k2": ["model.layers.3.eh_proj.weight"],
    "glm4_moe": ["model.layers.1.self_attn.o_proj.bias"],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_arch_specific_tensors(ckpt, arch):
    path = ckpt(arch)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["torch_dtype"] == "bfloat16" and "quantization_config" not in cfg
    if arch == "qwen3_5_moe":  # Qwen3.5's hub config is v5-style
        assert cfg["rope_parameters"]["rope_theta"] and "rope_theta" not in cfg
    elif arch == "glm5_next_text":  # nothing rotates
        assert "rope_theta" not in cfg and "rope_parameters" not in cfg
    else:
        assert "rope_theta" in cfg and "rope_parameters" not in cfg  # hub (v4-style) config
    assert cfg["architectures"] == {
        "mixtral": ["MixtralForCausalLM"], "qwen2_moe": ["Qwen2MoeForCausalLM"],
        "qwen3_moe": ["Qwen3MoeForCausalLM"], "olmoe": ["OlmoeForCausalLM"],
        "deepseek_v2": ["DeepseekV2ForCausalLM"], "deepseek_v3": ["DeepseekV3ForCausalLM"],
        "kimi_k2": ["DeepseekV3ForCausalLM"], "glm4_moe": ["Glm4MoeForCausalLM"],
        "minimax_m2": ["MiniMaxM2ForCausalLM"], "gpt_oss": ["GptOssForCausalLM"],
        "deepseek_v32": ["DeepseekV32ForCausalLM"], "glm_moe_dsa": ["GlmMoeDsaForCausalLM"],
        "qwen3_next": ["Qwen3NextForCausalLM"], "qwen3_5_moe": ["Qwen3_5MoeForCausalLM"],
        "deepseek_v4": ["DeepseekV4ForCausalLM"], "dots1": ["Dots1ForCausalLM"],
        "ernie4_5_moe": ["Ernie4_5_MoeForCausalLM"], "hunyuan_v1_moe": ["HunYuanMoEV1ForCausalLM"],
        "mimo_v2_flash": ["MiMoV2FlashForCausalLM"], "llama4_text": ["Llama4ForCausalLM"],
        "kimi_linear": ["KimiLinearForCausalLM"], "minimax_m3_vl_text": ["MiniMaxM3VLForCausalLM"],
        "glm5_next_text": ["Glm5NextForConditionalGeneration"],
    }[arch]
    if arch == "gpt_oss":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["rope_scaling"]["truncate"] is False
    if arch in ("deepseek_v3", "kimi_k2"):
        assert cfg["rope_scaling"]["type"] == "yarn"
        assert {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "original_max_position_embeddings"} <= set(cfg["rope_scaling"])
        assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    if arch == "glm4_moe":
        assert cfg["partial_rotary_factor"] == 0.5 and cfg["attention_bias"] is True
    wmap = weight_map(path)
    for name, shape in _MUST_HAVE[arch].items():
        assert name in wmap, name
        assert list(read_tensor(path, name)[1].shape) == shape, name
    for name in _MUST_NOT_HAVE.get(arch, []):
        assert name not in wmap, name
    # the MTP layer is exactly a decoder layer + its six extra tensors
    mtp = S.mtp_layer_indices(cfg)
    assert len(mtp) == {"deepseek_v3": 1, "glm4_moe": 1, "deepseek_v32": 1, "glm_moe_dsa": 1}.get(arch, 0)
    for i in mtp:
        last = cfg["num_hidden_layers"] - 1
        extra = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight"}
        got = {k[len(f"model.layers.{i}."):] for k in wmap if k.startswith(f"model.layers.{i}.")}
        ref = {k[len(f"model.layers.{last}."):] for k in wmap if k.startswith(f"model.layers.{last}.")}
        assert got == ref | extra


# ------------------------------------------------------------------------------------
# values
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_bf16_values_read_back(ckpt, arch):
    path = ckpt(arch)
    plan = {s.name: s for s in S.checkpoint_plan(arch)}
    for name, spec in plan.items():
        if not (name.startswith(("model.embed_tokens", "model.norm", "lm_head", "model.layers.1."))):
            continue
        dt, raw = read_tensor(path, name)
        want = S.tensor_values(spec, seed=0)
        if dt == "BF16":
            assert np.array_equal(raw, S.float32_to_bf16_bits(want)), name
        else:
            assert dt == "F32" and spec.kind == "score_bias" and np.array_equal(raw, want), name
        np.testing.assert_array_equal(decoded(path, name), S.stored_values(spec, seed=0))
    router = decoded(path, "model.layers.1." + ("block_sparse_moe" if arch == "mixtral" else "mlp") + ".gate.weight")
    assert abs(router.std() - 2 / math.sqrt(256)) < 0.02
    assert abs(decoded(path, "model.embed_tokens.weight").std() - 0.02) < 0.002
    norm = decoded(path, "model.layers.1.input_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.05 and norm.std() > 0.01


def test_f32_f16_and_seed(ckpt, tmp_path):
    plan = {s.name: s for s in S.checkpoint_plan("olmoe")}
    name = "model.layers.0.self_attn.q_proj.weight"
    x = S.tensor_values(plan[name], seed=0)
    dt, raw = read_tensor(ckpt("olmoe", "f32"), name)
    assert dt == "F32" and np.array_equal(raw, x)
    dt, raw = read_tensor(ckpt("olmoe", "f16"), name)
    assert dt == "F16" and np.array_equal(raw, x.astype(np.float16))
    assert json.loads((ckpt("olmoe", "f16") / "config.json").read_text())["torch_dtype"] == "float16"

    def digest(p):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir())}

    again = S.write_checkpoint(tmp_path / "again", "olmoe", dtype="f16")
    assert digest(again) == digest(ckpt("olmoe", "f16"))  # deterministic, tokenizer included
    other = S.write_checkpoint(tmp_path / "other", "olmoe", dtype="f16", seed=1)
    assert not np.array_equal(read_tensor(other, name)[1], raw)


def test_sharding_options(tmp_path):
    one = S.write_checkpoint(tmp_path / "one", "qwen3_moe", shards=1)
    assert not (one / "model.safetensors.index.json").exists()
    assert [p.name for p in one.glob("*.safetensors")] == ["model.safetensors"]
    cap = 1_000_000
    many = S.write_checkpoint(tmp_path / "many", "qwen3_moe", max_shard_bytes=cap)
    sizes = [p.stat().st_size for p in many.glob("*.safetensors")]
    biggest = max(s.nbytes for s in S.checkpoint_plan("qwen3_moe"))
    assert len(sizes) > 3 and all(s <= max(cap, biggest) + 65536 for s in sizes)
    assert set(weight_map(one)) == set(weight_map(many))
    # rewriting into the same folder leaves no stale shards behind
    S.write_checkpoint(tmp_path / "many", "qwen3_moe", shards=2)
    assert len(list((tmp_path / "many").glob("*.safetensors"))) == 2


# ------------------------------------------------------------------------------------
# FP8 and fused experts
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,fused", [("deepseek_v3", False), ("kimi_k2", False), ("mixtral", True),
                                        ("glm4_moe", True)])
def test_fp8_well_formed(ckpt, arch, fused):
    path = ckpt(arch, "fp8", fused)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    assert cfg["torch_dtype"] == "bfloat16"
    plan = S.checkpoint_plan(arch, dtype="fp8", fused_experts=fused)
    by_name = {s.name: s for s in plan}
    wmap = weight_map(path)
    assert set(wmap) == set(by_name)
    n_fp8 = 0
    for s in plan:
        dt, raw = read_tensor(path, s.name)
        if s.kind in ("linear", "experts"):
            n_fp8 += 1
            assert dt == "F8_E4M3"
            assert not np.isin(raw, [0x7F, 0xFF]).any(), f"NaN code in {s.name}"
            sdt, scale = read_tensor(path, s.name + "_scale_inv")
            assert sdt == "F32" and (scale > 0).all()
            assert scale.shape == raw.shape[:-2] + tuple(-(-d // 128) for d in raw.shape[-2:])
        elif s.kind == "scale_inv":
            assert dt == "F32"
        else:
            assert dt == ("F32" if s.kind == "score_bias" else "BF16"), s.name
    assert n_fp8 > 10
    # dequantised weights reproduce the generated values at e4m3 precision, ~N(0, 0.02)
    name = next(s.name for s in plan if s.kind in ("linear", "experts") and ".layers.1." in s.name)
    codes = read_tensor(path, name)[1]
    scale = read_tensor(path, name + "_scale_inv")[1]
    full = np.repeat(np.repeat(scale, 128, axis=-2), 128, axis=-1)[..., : codes.shape[-2], : codes.shape[-1]]
    deq = S.fp8_e4m3_to_float32(codes) * full
    x = S.tensor_values(by_name[name])
    assert np.all(np.abs(deq - x) <= np.abs(x) * (2.0**-4 + 1e-6) + full * 2.0**-9)
    assert abs(deq.std() - 0.02) < 0.002
    blocks = np.abs(S.fp8_e4m3_to_float32(codes))
    assert blocks.max() == 448.0  # each block is scaled so its amax maps to e4m3's max


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_experts_well_formed(ckpt, arch):
    fused, per = ckpt(arch, "bf16", True), ckpt(arch)
    cfg = json.loads((fused / "config.json").read_text())
    wf, wp = weight_map(fused), weight_map(per)
    assert not any(".experts.0." in k for k in wf)
    prefixes = sorted({k.rsplit(".experts.", 1)[0] for k in wp if ".experts." in k})
    assert prefixes and {k for k in wf if ".experts." in k} == {
        f"{p}.experts.{w}" for p in prefixes for w in ("gate_up_proj", "down_proj")
    }
    # everything else is unchanged
    assert {k for k in wp if ".experts." not in k} == {k for k in wf if ".experts." not in k}
    E = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
    inter = cfg["intermediate_size"] if arch == "mixtral" else cfg["moe_intermediate_size"]
    g, u, d = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    p = prefixes[-1]
    _, gu = read_tensor(fused, p + ".experts.gate_up_proj")
    _, dn = read_tensor(fused, p + ".experts.down_proj")
    assert gu.shape == (E, 2 * inter, 256) and dn.shape == (E, 256, inter)
    for e in (0, E - 1):  # same expert weights as the per-expert checkpoint, gate rows first
        assert np.array_equal(gu[e, :inter], read_tensor(per, f"{p}.experts.{e}.{g}.weight")[1])
        assert np.array_equal(gu[e, inter:], read_tensor(per, f"{p}.experts.{e}.{u}.weight")[1])
        assert np.array_equal(dn[e], read_tensor(per, f"{p}.experts.{e}.{d}.weight")[1])


# ------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_files(ckpt, arch):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    path = ckpt(arch)
    cfg = json.loads((path / "config.json").read_text())
    tc = json.loads((path / "tokenizer_config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert 256 + 200 < tok.get_vocab_size() <= cfg["vocab_size"]
    assert tc["bos_token"] and tc["eos_token"] and tc["chat_template"]
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if tc.get(key):
            assert tok.token_to_id(tc[key]) is not None
            assert tc["added_tokens_decoder"][str(tok.token_to_id(tc[key]))]["content"] == tc[key]
    eos_ids = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    for i in eos_ids + ([cfg["bos_token_id"]] if cfg.get("bos_token_id") is not None else []):
        assert tok.id_to_token(i) in [t["content"] for t in tc["added_tokens_decoder"].values()]
    gen_eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert tok.token_to_id(tc["eos_token"]) in gen_eos
    text = "The engineer walked across the square, counting bridges."
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text) / 2 and tok.decode(ids) == text
    prompt = ImmutableSandboxedEnvironment().from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
        bos_token=tc["bos_token"], eos_token=tc["eos_token"],
    )
    assert "Hello there" in prompt
    enc = tok.encode(prompt, add_special_tokens=False).ids
    specials = {int(i) for i in tc["added_tokens_decoder"]}
    assert any(i in specials for i in enc)


# ------------------------------------------------------------------------------------
# against transformers (oracle extra)
# ------------------------------------------------------------------------------------


def _names_shapes(path: pathlib.Path) -> dict:
    out = {}
    for f in sorted(set(weight_map(path).values())):
        header, _ = read_header(path / f)
        out.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    need_oracle()
    import transformers

    transformers.logging.set_verbosity_error()
    cache: dict = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = O.build_with_transformers(tmp_path_factory.mktemp(f"oracle-{arch}"), arch, **kw)
        return cache[key]

    return get


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_same_tensors_as_transformers(oracle, arch):
    # a tensor transformers saves under another name than the release's (SAVED_NAMES), by the release's;
    # one it saves fused (SAVED_HALVES: MiniMax-M3's text model, its experts fused too), as its halves
    saved = _names_shapes(oracle(arch))
    text = saved if arch not in O.MULTIMODAL_ONLY else {  # the text model's, named as a text-only checkpoint
        name.replace("model.language_model.", "model."): shape for name, shape in saved.items()
        if name.startswith("model.language_model.") or name == "lm_head.weight"}
    ref = {renamed_tensor(name, SAVED_NAMES.get(arch, ())): shape for name, shape in text.items()}
    for fused, first, second in SAVED_HALVES.get(arch, ()):
        for name in [n for n in ref if n.endswith(fused)]:
            rows, cols = ref.pop(name)
            ref.update({name.removesuffix(fused) + leaf: (rows // 2, cols) for leaf in (first, second)})
    cfg = S.tiny_config(arch)
    mtp = mtp_prefixes(cfg)
    plan = {s.name: tuple(s.shape) for s in S.checkpoint_plan(arch, fused_experts=arch in SAVED_HALVES)}
    # transformers has no MTP modules: compare the rest, the MTP layer is checked above
    assert {k: v for k, v in plan.items() if not (mtp and k.startswith(mtp))} == ref
    assert len(json.loads((oracle(arch) / "model.safetensors.index.json").read_text())["weight_map"]) == len(saved)
    assert len(set(weight_map(oracle(arch)).values())) >= 2


@pytest.mark.oracle
@pytest.mark.parametrize(
    "arch,opts",
    [("mixtral", dict(fused_experts=True)), ("deepseek_v3", dict(fp8=True)),
     ("qwen2_moe", dict(fused_experts=True, fp8=True)), ("kimi_k2", dict(fp8=True, dtype="bf16"))],
)
def test_variants_same_tensors_as_transformers(oracle, arch, opts):
    ref = _names_shapes(oracle(arch, **opts))
    mtp = mtp_prefixes(S.tiny_config(arch))
    plan = S.checkpoint_plan(arch, dtype="fp8" if opts.get("fp8") else "bf16",
                             fused_experts=opts.get("fused_experts", False))
    assert {s.name: tuple(s.shape) for s in plan if not (mtp and s.name.startswith(mtp))} == ref
    if opts.get("fp8"):
        conf = json.loads((oracle(arch, **opts) / "config.json").read_text())
        assert conf["quantization_config"]["weight_block_size"] == [128, 128]
    if arch == "kimi_k2":
        assert json.loads((oracle(arch, **opts) / "config.json").read_text())["model_type"] == "kimi_k2"


@pytest.mark.oracle
# MiniMax-M3's text-only class loads only the fused names it saves; the release's (the synthetic
# model's) load through its multimodal class, and tests/test_minimax_m3.py converts that class's save
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in SAVED_HALVES])
def test_transformers_loads_synthetic(ckpt, arch, tmp_path):
    need_oracle()
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    path = ckpt(arch)
    cfg = json.loads((path / "config.json").read_text())
    config = O._hf_config(cfg)
    prefix = "model."
    if arch in O.MULTIMODAL_ONLY:  # its wrapper loads the text model under the release's prefix
        prefix = "model.language_model."
        tensors = {prefix + n.removeprefix("model.") if n.startswith("model.") else n: t for n, t in O._read_all(path).items()}
        path = tmp_path / "wrapped"
        path.mkdir()
        (path / "generation_config.json").write_text((ckpt(arch) / "generation_config.json").read_text())
        O._write_all(path, tensors)
    model, info = O.causal_lm_class(config).from_pretrained(path, config=config, dtype=torch.float32,
                                                            output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.startswith("model.visual.")]  # a wrapper's vision tower
    assert not missing and not info["mismatched_keys"]
    mtp = mtp_prefixes(cfg)
    # only the MTP layer, which transformers does not model, is left over
    assert all(mtp and k.startswith(mtp) for k in info["unexpected_keys"])
    assert bool(info["unexpected_keys"]) == bool(mtp)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 50, 300, 7, 120]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    # the loaded parameters are the stored values
    name = "model.layers.1.input_layernorm.weight"
    stored = "model.layers.1.attn_norm.weight" if arch == "deepseek_v4" else name  # the release's name
    np.testing.assert_array_equal(model.state_dict()[prefix + name.removeprefix("model.")].numpy(),
                                  decoded(ckpt(arch), stored))


@pytest.mark.oracle
def test_fused_and_fp8_agree_through_transformers(ckpt):
    need_oracle()
    import torch

    x = torch.tensor([[1, 17, 300, 42, 7, 99]])
    with torch.no_grad():
        ref = O.load_reference(ckpt("deepseek_v3")).forward(x).logits
        fused = O.load_reference(ckpt("deepseek_v3", "bf16", True)).forward(x).logits
        fp8 = O.load_reference(ckpt("deepseek_v3", "fp8")).forward(x).logits
    assert torch.equal(ref, fused)  # fused experts hold the very same weights
    assert (fp8 - ref).abs().max() < 0.25 * ref.abs().max()  # e4m3 rounding only
    assert (fp8 - ref).abs().mean() < 0.05 * ref.abs().mean() + 0.01


@pytest.mark.oracle
def test_fp8_codes_match_torch_cast(ckpt):
    need_oracle()
    import torch

    path = ckpt("deepseek_v3", "fp8")
    plan = {s.name: s for s in S.checkpoint_plan("deepseek_v3", dtype="fp8")}
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # 320 rows: a partial block
    codes = read_tensor(path, name)[1]
    scale = read_tensor(path, name + "_scale_inv")[1]
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[: codes.shape[0], : codes.shape[1]]
    q = torch.from_numpy(S.tensor_values(plan[name]) / full).to(torch.float8_e4m3fn)
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
