"""MiniMax-M3 beyond what every architecture is checked for (tests/test_oracle_runtime.py,
tests/test_llama_cpp.py and the rest): the release's layout, as transformers' multimodal class
saves it, converts to the bytes of its text-only class's save; the config's two spellings
agree; attention keeps each key-value group to its own blocks; what llama.cpp cannot run as we
do is refused in one line."""

import json
import shutil

import numpy as np
import pytest
from oracle_models import build_with_transformers, oracle_available

from colibri.convert.arch import ADAPTERS, ConfigError
from colibri.convert.arch.base import normalized_config
from colibri.convert.arch.minimax_m3 import TINY
from colibri.convert.colibri_to_gguf import export_gguf
from colibri.convert.gguf_source import GGUFError
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.layout import read_manifest
from colibri.runtime import kernels

ARCH = "minimax_m3_vl_text"


def read(config: dict):
    return normalized_config(ADAPTERS[ARCH], config)


def need_oracle():
    available, reason = oracle_available()
    if not available:
        pytest.skip(reason)


def checksums(folder) -> dict:
    """Every tensor's and expert's sha256 in a conversion's manifest, by name."""
    manifest = read_manifest(folder)[0]
    sums = {name: entry["sha256"] for name, entry in manifest["tensors"].items()}
    for entry in manifest["expert_layers"]:
        sums.update({f"{entry['layer']}.{i}": digest for i, digest in enumerate(entry["sha256"])})
    return sums


def test_the_release_layout_converts_to_the_bytes_of_the_text_models_save(tmp_path):
    """The multimodal class saves the release's names (`language_model.` prefix, w1/w3/w2 per
    expert, `block_sparse_moe`, `self_attn.index_*`, the dense and shared FFNs' gate and up
    apart) beside a vision tower; the text-only class fuses them under `mlp`. Both convert to
    the same tensors and experts, byte for byte, and the same config."""
    need_oracle()
    import torch
    import transformers

    text = build_with_transformers(tmp_path / "text", ARCH)
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    config = transformers.MiniMaxM3VLConfig(text_config=text_model.config.to_dict(),
                                           vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                              num_attention_heads=2))
    release_model = transformers.MiniMaxM3SparseForConditionalGeneration(config)
    state = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
             for k, v in text_model.state_dict().items()}
    missing, unexpected = release_model.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(k.startswith(("model.vision_tower.", "model.multi_modal_projector."))
                                              for k in missing)
    release_model.save_pretrained(tmp_path / "release", max_shard_size="2MB")  # shards and an index, as the hub
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text / name, tmp_path / "release" / name)
    index = json.loads((tmp_path / "release" / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",
                 "language_model.model.layers.1.self_attn.index_q_proj.weight",
                 "language_model.model.layers.0.mlp.gate_proj.weight", "language_model.lm_head.weight"):
        assert name in index, name
    assert any(name.startswith("vision_tower.") for name in index)

    for source in ("text", "release"):
        convert(str(tmp_path / source), tmp_path / f"{source}-F32", ConvertOptions(quant="F32", progress=False))
    assert checksums(tmp_path / "release-F32") == checksums(tmp_path / "text-F32")
    configs = [read_manifest(tmp_path / f"{source}-F32")[0]["config"] for source in ("text", "release")]
    assert configs[0] == configs[1]


def test_the_release_keys_and_transformers_keys_give_one_config():
    """The release's `sparse_attention_config` and `moe_layer_freq` against the lists and
    `index_*` keys transformers writes; the rotated width from partial_rotary_factor, whatever
    rotary_dim says (as transformers)."""
    c = read(TINY)
    sparse = TINY["sparse_attention_config"]
    saved = {k: v for k, v in TINY.items() if k not in ("sparse_attention_config", "moe_layer_freq", "rotary_dim")}
    saved.update(layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
                 mlp_layer_types=["dense", "sparse", "sparse"], rotary_dim=64, index_n_heads=sparse["sparse_num_index_heads"],
                 index_head_dim=sparse["sparse_index_dim"], index_block_size=sparse["sparse_block_size"],
                 index_topk_blocks=sparse["sparse_topk_blocks"], index_local_blocks=sparse["sparse_local_block"])
    assert read(saved) == c
    assert (c.index_layers, c.moe_layers, c.rope_dim, c.index_block, c.index_topk) == ([1, 2], [1, 2], 32, 4, 3)
    assert c.expert_glu == "clamped_swiglu" and c.n_shared_experts == 1 and c.routed_scaling_factor == 2.0


@pytest.mark.parametrize("change, words", [
    ({"num_key_value_heads": 4, "num_attention_heads": 4}, "index_heads 2 is not one a key-value head"),
    ({"scoring_func": "softmax"}, "routes by sigmoid"),
    ({"moe_layer_freq": [0, 1]}, "mlp_layer_types is not 3"),
])
def test_what_the_runtime_cannot_run_is_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as error:
        read({**TINY, **change})
    assert "\n" not in str(error.value)


def test_each_kv_group_attends_to_its_own_blocks():
    """A choice of blocks per query and kv head equals attending with each group's heads alone
    over its kv head and that group's choice, each block's flag repeated for its positions."""
    rng = np.random.default_rng(5)
    n, heads, kv_heads, width, rows, block = 3, 4, 2, 16, 22, 4
    q = rng.standard_normal((n, heads, width)).astype(np.float32)
    keys, values = (rng.standard_normal((rows, kv_heads, width)).astype(np.float32) for _ in range(2))
    chosen = (rng.random((n * kv_heads, -(-rows // block))) < 0.5).astype(np.uint8)
    chosen[:, -1] = 1  # each query's own block
    start = rows - n
    got = kernels.attention(q, keys, values, start, 0.25, chosen=chosen, block=block)
    group, positions = heads // kv_heads, np.repeat(chosen, block, axis=1)[:, :rows]
    for kv in range(kv_heads):
        alone = kernels.attention(q[:, kv * group:(kv + 1) * group], keys[:, kv:kv + 1], values[:, kv:kv + 1], start,
                                  0.25, chosen=positions[kv::kv_heads])
        np.testing.assert_array_equal(got[:, kv * group:(kv + 1) * group], alone)
    first_groups_choice = kernels.attention(q, keys, values, start, 0.25, chosen=chosen[::kv_heads], block=block)
    assert not np.array_equal(got[:, group:], first_groups_choice[:, group:])  # the second group's own blocks count


def test_a_model_llama_cpp_would_run_otherwise_is_not_exported(checkpoint, tmp_path):
    """llama.cpp's minimax-m3 makes every layer from the first MoE one sparse, and hard-codes
    the SwiGLU's alpha and limit: a model that differs is refused in one line."""
    config = {**TINY, "swiglu_limit": 5.0}
    src = checkpoint(ARCH, config=config)
    convert(str(src), tmp_path / "model", ConvertOptions(progress=False))
    with pytest.raises(GGUFError, match="swiglu alpha 1.702 and limit 7.0") as error:
        export_gguf(tmp_path / "model", tmp_path / "model.gguf", progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "model.gguf").exists()
