"""Kimi-Linear's config as the release and as transformers spell it, what is refused, and what a
sequence keeps. Its logits against transformers and llama.cpp are checked with every
architecture's (tests/test_oracle_runtime.py, tests/test_llama_cpp.py); the per-channel decay
of its recurrence in tests/test_kernels.py."""

import dataclasses
import json

import pytest

from colibri.convert.arch import ADAPTERS, ConfigError
from colibri.convert.arch.base import normalized_config
from colibri.convert.arch.kimi_linear import TINY
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.config_check import config_problems
from colibri.runtime.model import Decoder


def read(config: dict):
    return normalized_config(ADAPTERS["kimi_linear"], config)


def test_the_release_config_and_the_one_transformers_saves_read_the_same():
    release = read(TINY)
    assert (release.linear_layers, release.nope_layers, release.moe_layers) == ([0, 1], [2], [1, 2])
    assert (release.linear_kind, release.linear_k_heads, release.linear_k_head_dim, release.linear_conv_kernel) == ("kda", 4, 256, 4)
    assert (release.head_dim, release.rope_dim, release.q_lora_rank, release.max_position_embeddings) == (96, 32, None, 1048576)
    assert (release.router, release.router_bias, release.router_norm_topk, release.routed_scaling_factor) == ("sigmoid", True, True, 2.446)
    saved = {k: v for k, v in TINY.items() if k not in ("linear_attn_config", "first_k_dense_replace")}
    saved.update(layer_types=["linear_attention", "linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse", "sparse"],
                 linear_head_dim=256, linear_num_heads=4, linear_conv_kernel_dim=4, head_dim=32)
    assert read(saved) == release


@pytest.mark.parametrize("change, message", [
    ({"mla_use_nope": False}, "mla_use_nope false"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func 'softmax'"),
    ({"linear_attn_config": {**TINY["linear_attn_config"], "kda_layers": [1]}}, "do not number the 3 layers"),
    ({"layer_types": ["linear_attention"] * 2}, "layer_types is not 3 of"),
])
def test_what_the_runtime_cannot_compute_is_refused_by_key(change, message):
    with pytest.raises(ConfigError, match=message):
        read({**TINY, **change})


def test_the_kda_fields_are_checked_together():
    c = read(TINY)
    assert config_problems(dataclasses.replace(c, linear_kind="mamba")) == \
        ["linear_kind 'mamba' is not implemented (the runtime has gated_deltanet, kda)"]
    assert config_problems(dataclasses.replace(c, linear_v_heads=8)) == \
        ["Kimi delta attention has as many value heads as key heads, of one width"]


def test_a_kda_layer_keeps_its_states_and_the_mla_layer_its_latents():
    c = read(TINY)
    shape = Decoder.cache_shape_for(c)
    states = {"conv": (3, 3 * 4 * 256), "recurrent": (4, 256, 256)}  # the kernel's last 3 inputs of q, k, v; S per head
    assert [shape.state(i) for i in range(3)] == [states, states, {}]
    assert shape.rows(4096) == [0, 0, 4096]
    float32_states = 2 * 4 * (3 * 3 * 4 * 256 + 4 * 256 * 256)
    assert shape.nbytes(4096, "f16") == 2 * 4096 * (256 + 32) + float32_states  # the latent and the shared key


def test_a_checkpoint_transformers_saved_reads_under_the_release_names(checkpoint, tmp_path):
    """transformers saves the dense first layer's FFN under block_sparse_moe; it converts to the
    release's bytes."""
    from safetensors.numpy import load_file, save_file

    from gguf_checks import model_bytes

    src = checkpoint("kimi_linear", dtype="f32")
    saved = tmp_path / "saved"
    saved.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    renamed = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {n.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): d for n, d in load_file(src / shard).items()}
        save_file(tensors, str(saved / shard))
        renamed.update(dict.fromkeys(tensors, shard))
    (saved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": renamed}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            (saved / name).write_text((src / name).read_text())
    assert "model.layers.0.mlp.gate_proj.weight" in Checkpoint(saved).tensors
    convert(str(src), tmp_path / "a", ConvertOptions(quant="F32", progress=False))
    convert(str(saved), tmp_path / "b", ConvertOptions(quant="F32", progress=False))
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")
