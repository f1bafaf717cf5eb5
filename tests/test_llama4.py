"""Llama 4's own parts: its config read as transformers derives it, what is refused, the
chunked and position-free layers, the temperature and llama3 rope against transformers at
sizes where they act (the tiny model every architecture shares keeps llama.cpp's chunk of 8192
and is checked with the others in tests/test_oracle_runtime.py and tests/test_llama_cpp.py)."""

import dataclasses
import json

import numpy as np
import pytest
from gguf_checks import model_bytes
from oracle_models import build_with_transformers, load_reference, oracle_available
from safetensors.numpy import load_file, save_file
from test_compressed_tensors import save_with_fp8

from colibri.convert.arch import ADAPTERS, ConfigError
from colibri.convert.arch.base import normalized_config
from colibri.convert.arch.llama4 import TINY
from colibri.convert.colibri_to_gguf import export_gguf
from colibri.convert.gguf_arch import rope_freq_factors
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic.storage import encode_e4m3, fp8_e4m3_to_float32
from colibri.formats.config_check import config_problems
from colibri.runtime import kernels, open_model
from colibri.runtime.rope import inverse_frequencies

SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}
# chunks of 4, the temperature from position 1 on and Llama 3.1's rope stretch, at 8 layers
ACTING = {"attention_chunk_size": 4, "floor_scale": 2, "num_hidden_layers": 8, "max_position_embeddings": 64,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}}


def read(config: dict):
    return normalized_config(ADAPTERS["llama4_text"], config)


def test_the_layers_are_transformers_defaults():
    c = read({**TINY, "num_hidden_layers": 8})
    assert c.nope_layers == [3, 7] and c.chunked_layers == [0, 1, 2, 4, 5, 6] and c.moe_layers == [1, 3, 5, 7]
    assert (c.window_of(0), c.chunk_of(0), c.window_of(3), c.chunk_of(3)) == (8192, 8192, 0, 0)
    assert (c.attn_temperature_scale, c.attn_temperature_floor, c.qk_norm, c.expert_input_scaled) == (0.1, 8192, "weightless", True)
    given = read({**TINY, "num_hidden_layers": 8, "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 1], "moe_layers": [2],
                  "layer_types": ["full_attention"] * 8, "use_qk_norm": False, "attn_temperature_tuning": False})
    assert (given.nope_layers, given.chunked_layers, given.moe_layers, given.qk_norm) == ([1], [], [2], "none")
    assert (given.attention_chunk, given.attn_temperature_scale) == (0, 0.0)


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 2}, "expert_input_scaled needs one expert a token"),
    ({"attention_bias": True}, "attention_bias"),
    ({"no_rope_layers": [1, 1]}, "no_rope_layers is not 4 of 0, 1"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types is not 4 of"),
    ({"attention_chunk_size": 0}, "attention_chunk_size 0"),
])
def test_what_the_runtime_cannot_compute_is_refused_by_key(change, message):
    with pytest.raises(ConfigError, match=message):
        read({**TINY, **change})


def test_the_fields_are_checked_together():
    c = read(TINY)
    assert config_problems(dataclasses.replace(c, chunked_layers=[0, 0])) == \
        ["chunked_layers [0, 0] are not distinct increasing layers of the 4"]
    assert config_problems(dataclasses.replace(c, attention_chunk=0)) == ["attention_chunk and chunked_layers come together"]
    assert config_problems(dataclasses.replace(c, nope_layers=[], attn_temperature_scale=0.1)) == \
        ["attn_temperature_scale needs an attn_temperature_floor and nope_layers"]
    assert config_problems(dataclasses.replace(c, qk_norm_after_rope=False)) == ["weightless q/k norms apply after the rotation"]
    assert "rope_scaling llama3 needs" in config_problems(dataclasses.replace(c, rope_scaling={**SCOUT_ROPE, "low_freq_factor": 2.0}))[0]


def test_chunked_attention_sees_its_own_chunk_only():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((10, 2, 8)).astype(np.float32) for _ in range(3))
    out = kernels.attention(q, k, v, 0, 0.3, window=4, chunk=4)
    for p in range(10):
        first = p - p % 4
        want = kernels.attention(q[p:p + 1], k[first:p + 1], v[first:p + 1], p, 0.3, p - first + 1, first_key=first)
        np.testing.assert_allclose(out[p], want[0], rtol=1e-6, atol=1e-6)
    for n in (1, 40):  # a decode step's kernel and a prompt's agree with the reference above
        many = rng.standard_normal((n, 2, 8)).astype(np.float32)
        keys, values = (rng.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(2))
        chunked = kernels.attention(many, keys, values, 0, 0.3, window=4, chunk=4)
        for p in range(n):
            first = p - p % 4
            want = kernels.attention(many[p:p + 1], keys[first:p + 1], values[first:p + 1], p, 0.3, p - first + 1,
                                         first_key=first)
            np.testing.assert_allclose(chunked[p], want[0], rtol=1e-5, atol=1e-6)


def test_llama3_rope_matches_transformers_and_llama_cpps_factors():
    torch = pytest.importorskip("torch")
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (SCOUT_ROPE, ACTING["rope_scaling"]):
        config = Llama4TextConfig(**{k: v for k, v in {**TINY, "rope_scaling": scaling}.items()
                                     if k not in ("architectures", "model_type")})
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
        c = read({**TINY, "rope_scaling": scaling})
        ours, factor = inverse_frequencies(c)
        assert factor == 1.0
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
        plain, _ = inverse_frequencies(dataclasses.replace(c, rope_scaling=None))
        factors = rope_freq_factors(c)
        np.testing.assert_allclose(plain / factors, ours, rtol=1e-6)
        as_imported = {"rope_type": "factors", "factors": [float(f) for f in factors]}
        assert inverse_frequencies(dataclasses.replace(c, rope_scaling=as_imported))[0].tolist() == (plain / factors).tolist()


MAVERICK_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                       "dynamic": False}}}}


def per_expert(tensors: dict) -> dict:
    """Each layer's fused, transposed experts as one [rows, cols] matrix each, as the FP8 release stores them."""
    out = {}
    for name, data in tensors.items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            ffn = data.shape[2] // 2
            for e in range(data.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(data[e, :, :ffn].T)
                out[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(data[e, :, ffn:].T)
        elif name.endswith("experts.down_proj"):
            for e in range(data.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = np.ascontiguousarray(data[e].T)
        else:
            out[name] = data
    return out


def write_folder(folder, config: dict, tensors: dict, fp8: set = frozenset()) -> None:
    folder.mkdir()
    shard = "model-00001-of-00001.safetensors"
    if fp8:
        save_with_fp8(folder / shard, tensors, fp8)
    else:
        save_file(tensors, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, shard)}))
    (folder / "config.json").write_text(json.dumps(config))


def test_the_fp8_release_converts_as_the_values_it_holds(checkpoint, tmp_path):
    """Llama-4-Maverick-FP8's layout: a `llama4` wrapper with the text model under
    `language_model.`, each routed expert's matrices apart in FP8 with a scale per row
    (compressed-tensors), a vision tower beside: it converts to the bytes of the same values
    stored as float32 in a text-only checkpoint."""
    src = checkpoint("llama4_text", dtype="f32")
    tensors = per_expert({n: d for f in sorted(src.glob("*.safetensors")) for n, d in load_file(f).items()})
    text = json.loads((src / "config.json").read_text())
    release, held = {}, {}
    for name, data in tensors.items():
        if ".experts." in name:
            scale = (np.abs(data).max(axis=1, keepdims=True) / 448).astype(np.float32)
            release[name], release[name + "_scale"] = encode_e4m3(data / scale), scale
            held[name] = fp8_e4m3_to_float32(release[name]) * scale
        else:
            release[name] = data
    assert len(held) == 2 * 8 * 3
    wrapped = {"language_model." + n: d for n, d in release.items()}
    wrapped["vision_model.patch_embedding.linear.weight"] = np.ones((16, 48), np.float32)
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
              "vision_config": {"model_type": "llama4_vision_model"}, "quantization_config": MAVERICK_FP8}
    write_folder(tmp_path / "release", config, wrapped, {"language_model." + n for n in held})
    write_folder(tmp_path / "plain", text, {**tensors, **held})
    summary = convert(str(tmp_path / "release"), tmp_path / "a", ConvertOptions(progress=False, quant="F32"))
    convert(str(tmp_path / "plain"), tmp_path / "b", ConvertOptions(progress=False, quant="F32"))
    assert summary["architecture"] == "llama4_text" and summary["skipped_tensors"] == 1
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")


oracle, reason = oracle_available()


@pytest.fixture(scope="module")
def acting(tmp_path_factory):
    """The tiny model with chunks, the temperature and llama3 rope acting, saved by transformers:
    (its folder, transformers' model, our F32 conversion)."""
    if not oracle:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("llama4-acting")
    src = build_with_transformers(root / "src", "llama4_text", overrides=ACTING)
    convert(str(src), root / "f32", ConvertOptions(quant="F32", progress=False))
    return src, load_reference(src), root / "f32"


@pytest.mark.oracle
def test_chunks_temperature_and_llama3_rope_match_transformers(acting):
    import torch

    _, reference, path = acting
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 512, 19)]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    model = open_model(path, ctx=64, kv_quant="f32", ram_budget="8G")
    full = model.prefill(ids)
    assert np.abs(full - want).max() <= 1e-4 * want.std()
    model.reset()
    steps = [model.prefill(ids[:6])[-1]] + [model.decode(t) for t in ids[6:]]  # cached decode across chunk edges
    assert np.abs(np.stack(steps) - want[5:]).max() <= 1e-4 * want.std()
    assert (np.stack(steps).argmax(-1) == want[5:].argmax(-1)).all()


def test_llama3_rope_goes_to_llama_cpp_as_rope_freqs_and_back(checkpoint, tmp_path):
    """Scout's rope scaling leaves as llama.cpp's rope_freqs tensor, is read back as those
    factors, and llama.cpp computes the same logits as the runtime (optional: llama extra)."""
    src = checkpoint("llama4_text", dtype="f32", config={**TINY, "rope_scaling": ACTING["rope_scaling"]})
    convert(str(src), tmp_path / "a", ConvertOptions(quant="F32", progress=False))
    export_gguf(tmp_path / "a", tmp_path / "a.gguf", progress=False)
    convert(str(tmp_path / "a.gguf"), tmp_path / "b", ConvertOptions(progress=False))
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 512, 24)]
    ours = open_model(tmp_path / "a", ctx=64, kv_quant="f32", ram_budget="8G").prefill(ids)
    imported = open_model(tmp_path / "b", ctx=64, kv_quant="f32", ram_budget="8G")
    assert imported.config.rope_scaling["rope_type"] == "factors"
    assert np.abs(imported.prefill(ids) - ours).max() <= 1e-5 * ours.std()
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(model_path=str(tmp_path / "a.gguf"), logits_all=True, n_ctx=64, n_threads=2, verbose=False,
                            type_k=0, type_v=0)
    model.eval(ids)
    theirs = np.array(model.scores[:len(ids)], np.float32)
    model.close()
    assert np.abs(theirs - ours).max() <= 1e-4 * ours.std()
