"""compressed-tensors' packed INT4 experts (Kimi-K2-Thinking, Kimi-K2.5/2.6) become Q4_0 byte
for byte: the same values, no float in between; other targets go through float32."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri.cli import convert_main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.quantize_q4k import dequantize
from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model

QUANTIZATION_CONFIG = {  # as Kimi-K2-Thinking's config.json has it
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group", "dynamic": False}}},
}
EXPERT = ".mlp.experts."


def pack_int4(w: np.ndarray, group: int = 32):
    """(packed I32 [rows, cols / 8], scales [rows, cols / group], the float32 values they hold)."""
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group)
    scales = (np.abs(grouped).max(axis=2) / 7).astype(np.float16).astype(np.float32)  # f16 values
    scales[scales == 0] = 1.0
    q = np.clip(np.round(grouped / scales[:, :, None]), -8, 7).astype(np.int8).reshape(rows, cols)
    u = (q.astype(np.int32) + 8).reshape(rows, cols // 8, 8)
    packed = (u << (4 * np.arange(8, dtype=np.int32))).sum(axis=2, dtype=np.int64).astype(np.uint32).view(np.int32)
    return packed, scales, (q.reshape(rows, cols // group, group) * scales[:, :, None]).reshape(rows, cols)


def int4_checkpoint(src, dst, group=32, shape_of=None):
    """A copy of the float checkpoint `src` whose routed experts are packed INT4; returns the
    float32 values each expert weight then holds."""
    shutil.copytree(src, dst)
    held = {}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted({f for f in index["weight_map"].values()}):
        tensors, out = load_file(dst / shard), {}
        for name, data in tensors.items():
            if EXPERT in name and name.endswith(".weight"):
                packed, scales, held[name] = pack_int4(data.astype(np.float32), group)
                base = name.removesuffix(".weight")
                out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scales
                out[base + ".weight_shape"] = np.array(shape_of(data.shape) if shape_of else data.shape, np.int32)
                for suffix in ("_packed", "_scale", "_shape"):
                    index["weight_map"][base + ".weight" + suffix] = shard
                del index["weight_map"][name]
            else:
                out[name] = data
        save_file(out, dst / shard)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    return held


def with_floats(src, dst, held: dict):
    """A copy of checkpoint `src` whose tensors named in `held` store those float32 values."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(dst / shard)
        save_file({n: held.get(n, d) for n, d in tensors.items()}, dst / shard)
    return dst


@pytest.fixture
def int4(checkpoint, tmp_path):
    src = checkpoint("kimi_k2", dtype="f32")
    return src, tmp_path / "int4", int4_checkpoint(src, tmp_path / "int4")


def test_int4_experts_become_q4_0_with_the_same_values(int4, tmp_path):
    _, source, held = int4
    convert(str(source), tmp_path / "q", ConvertOptions(progress=False))  # the default Q4_K_M recipe
    layout = ModelLayout(tmp_path / "q")
    for layer, table in layout.expert_layers.items():
        assert {m.encoding for m in table.matrices.values()} == {"Q4_0"}
        for expert in (0, table.count - 1):
            for matrix, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                info = table.matrices[matrix]
                got = dequantize(layout.expert_matrix_data(layer, expert, matrix).reshape(info.shape[0], -1),
                                 "Q4_0", info.shape[1])
                want = held[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"]
                assert np.array_equal(got, want)
    assert layout.tensors["blk.1.attn_output.weight"].encoding == "Q5_K"  # the rest follows Q4_K_M (8 experts)


def test_logits_are_those_of_the_same_values_in_float(int4, tmp_path):
    src, source, held = int4
    plain = with_floats(src, tmp_path / "plain", held)
    convert(str(source), tmp_path / "q", ConvertOptions(progress=False, quant="F32"))
    convert(str(plain), tmp_path / "f", ConvertOptions(progress=False, quant="F32"))
    assert {m.encoding for t in ModelLayout(tmp_path / "q").expert_layers.values() for m in t.matrices.values()} == {"Q4_0"}
    ids = [1, 5, 9, 100, 200, 33, 7]
    got = open_model(tmp_path / "q", ctx=64, ram_budget="8G", kv_quant="f32").prefill(ids)
    want = open_model(tmp_path / "f", ctx=64, ram_budget="8G", kv_quant="f32").prefill(ids)
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.999, cosine  # only the int8 activations of the Q4_0 products differ


def test_an_override_reads_them_as_floats(int4, tmp_path):
    _, source, held = int4
    convert(str(source), tmp_path / "q", ConvertOptions(progress=False, overrides=[("ffn_down_exps", "Q8_0")]))
    table = ModelLayout(tmp_path / "q").expert_layers[1]
    assert (table.matrices["down"].encoding, table.matrices["gate"].encoding) == ("Q8_0", "Q4_0")
    info = table.matrices["down"]
    got = dequantize(ModelLayout(tmp_path / "q").expert_matrix_data(1, 2, "down").reshape(info.shape[0], -1),
                     "Q8_0", info.shape[1])
    want = held["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert np.abs(got - want).max() <= np.abs(want).max() / 127


def test_inconsistent_packed_tensors_are_one_line(checkpoint, tmp_path, capsys):
    src = checkpoint("kimi_k2", dtype="f32")
    int4_checkpoint(src, tmp_path / "bad", shape_of=lambda shape: (shape[0], shape[1] * 2))
    assert convert_main([str(tmp_path / "bad"), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "weight_shape says" in err and "the packed data holds" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def multimodal_checkpoint(src, dst):
    """`src` as Kimi-K2.5 / K2.6 ship it: the text model under `language_model.`, its config as
    `text_config`, a vision tower and projector beside it."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {"language_model." + n: d for n, d in load_file(dst / shard).items()}
        save_file(tensors, dst / shard)
    vision = {"vision_tower.encoder.blocks.0.wqkv.weight": np.ones((48, 16), np.float32),
              "mm_projector.proj.0.weight": np.ones((16, 16), np.float32)}
    save_file(vision, dst / "model-vision.safetensors")
    weight_map = {"language_model." + n: f for n, f in index["weight_map"].items()}
    weight_map.update(dict.fromkeys(vision, "model-vision.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    text = json.loads((dst / "config.json").read_text())
    quantization = text.pop("quantization_config", None)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 16}}
    (dst / "config.json").write_text(json.dumps({**config, **({"quantization_config": quantization} if quantization else {})}))
    return dst


def test_a_kimi_k25_checkpoint_converts_as_its_text_model(int4, tmp_path):
    """Kimi-K2.5's checkpoint: its text model (K2's, INT4 experts) converts to the same bytes as
    that text model alone; the vision tower is skipped and counted."""
    from gguf_checks import model_bytes

    _, source, _ = int4
    wrapped = multimodal_checkpoint(source, tmp_path / "k25")
    summary = convert(str(wrapped), tmp_path / "a", ConvertOptions(progress=False))
    convert(str(source), tmp_path / "b", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")
    assert summary["skipped_tensors"] == 2
    skipped = ModelLayout(tmp_path / "a").manifest["provenance"]["skipped_tensors"]
    assert skipped == ["mm_projector.proj.0.weight", "vision_tower.encoder.blocks.0.wqkv.weight"]


def test_other_packed_schemes_are_refused_naming_the_setting(int4, capsys):
    _, source, _ = int4
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (source / "config.json").write_text(json.dumps(config))
    assert convert_main([str(source), str(source.parent / "out"), "--no-progress"]) == 1
    assert "quantization_config group group_0: symmetric False (supported: 4-bit symmetric groups)" in capsys.readouterr().err



FP8_GROUP = {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                          "symmetric": True, "dynamic": False}}
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int32": "I32", "int64": "I64"}


def save_with_fp8(path, tensors: dict, fp8: set):
    """A safetensors file of numpy arrays; the uint8 arrays named in `fp8` stored as F8_E4M3
    (numpy has no such dtype for safetensors' own writer)."""
    header, payload = {}, bytearray()
    for name, data in tensors.items():
        dtype = "F8_E4M3" if name in fp8 else SAFETENSORS_DTYPES[data.dtype.name]
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [len(payload), len(payload) + data.nbytes]}
        payload += np.ascontiguousarray(data).tobytes()
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + payload)


def fp8_attention(source, strategy_of):
    """`source`'s attention weights as compressed-tensors FP8: e4m3 codes and a `.weight_scale`
    per row ("channel") or per tensor ("tensor"), as `strategy_of(name)` says; returns the
    float32 values each weight then holds."""
    from colibri.convert.synthetic.storage import encode_e4m3, fp8_e4m3_to_float32

    held = {}
    index = json.loads((source / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        out = load_file(source / shard)
        for name in [n for n, d in out.items() if ".self_attn." in n and n.endswith(".weight") and d.ndim == 2]:
            w = out[name].astype(np.float32)
            amax = np.abs(w).max(axis=1, keepdims=True) if strategy_of(name) == "channel" else np.abs(w).max().reshape(1)
            scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
            out[name], out[name + "_scale"] = encode_e4m3(w / scale), scale
            held[name] = fp8_e4m3_to_float32(out[name]) * scale
            index["weight_map"][name + "_scale"] = shard
        save_with_fp8(source / shard, out, set(held))
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_1"] = FP8_GROUP
    (source / "config.json").write_text(json.dumps(config))
    return held


def test_fp8_attention_converts_to_the_values_it_holds(int4, tmp_path):
    """Kimi-K2.5/2.6's attention (compressed-tensors FP8, a scale per row or per tensor) beside
    its INT4 experts converts to what the same values stored as floats convert to."""
    from gguf_checks import model_bytes

    _, source, _ = int4
    shutil.copytree(source, tmp_path / "before")
    held = fp8_attention(source, lambda name: "tensor" if "o_proj" in name else "channel")
    assert held
    plain = with_floats(tmp_path / "before", tmp_path / "plain", held)
    convert(str(source), tmp_path / "a", ConvertOptions(progress=False, quant="F32"))
    convert(str(plain), tmp_path / "b", ConvertOptions(progress=False, quant="F32"))
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")


def test_other_fp8_schemes_are_refused_naming_the_setting(int4, capsys):
    _, source, _ = int4
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_1"] = {**FP8_GROUP, "weights": {
        **FP8_GROUP["weights"], "strategy": "block", "block_structure": [64, 64]}}
    (source / "config.json").write_text(json.dumps(config))
    assert convert_main([str(source), str(source.parent / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "group group_1: float weights of 8 bits, strategy 'block', blocks [64, 64]" in err


def test_an_fp8_only_checkpoint_has_its_scheme_checked_too(checkpoint, tmp_path, capsys):
    """No packed INT4 in it (a compressed-tensors FP8 checkpoint): the scheme is still checked."""
    source = tmp_path / "fp8"
    shutil.copytree(checkpoint("kimi_k2", dtype="f32"), source)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}
    (source / "config.json").write_text(json.dumps(config))
    fp8_attention(source, lambda name: "channel")
    convert(str(source), tmp_path / "ok", ConvertOptions(progress=False, quant="F32"))  # the supported scheme converts
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_1"]["weights"].update(strategy="block", block_structure=[64, 64])
    (source / "config.json").write_text(json.dumps(config))
    assert convert_main([str(source), str(tmp_path / "out"), "--no-progress"]) == 1
    assert "group group_1: float weights of 8 bits, strategy 'block', blocks [64, 64]" in capsys.readouterr().err
