"""gpt-oss's MXFP4 checkpoints: the experts' blocks become GGML MXFP4 byte for byte.

The format's functions against gguf's dequantizer, a hostile pair of tensors refused; then
(oracle extra) a transformers-built gpt-oss with its experts in the hub's MXFP4 layout:
converted with any recipe its experts stay MXFP4, their bytes those of the source blocks,
their values transformers' own dequantization of them, and the logits transformers' on the
dequantized model within the int8 path's bounds.
"""

import json

import gguf
import numpy as np
import pytest
from oracle_models import build_with_transformers, load_reference, oracle_available, to_mxfp4
from safetensors.numpy import save_file

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats import mxfp4
from colibri.formats.checkpoint import Checkpoint, CheckpointError
from colibri.formats.layout import ModelLayout

available, reason = oracle_available()


def test_blocks_become_ggml_blocks_of_the_same_values():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    encoded = mxfp4.ggml_blocks(blocks, scales)
    assert encoded.shape == (3, 5, 4 * 17)
    ggml = gguf.quants.dequantize(encoded.reshape(15, -1), gguf.GGMLQuantizationType.MXFP4).reshape(3, 5, 128)
    assert np.array_equal(mxfp4.dequantize(blocks, scales), ggml)
    back = mxfp4.checkpoint_blocks(encoded)
    assert np.array_equal(back[0], blocks) and np.array_equal(back[1], scales)
    # element 2k is the low nibble of byte k, as transformers' FP4 table reads it
    one = np.zeros((1, 1, 16), np.uint8)
    one[0, 0, 0] = 0x2 | (0xA << 4)  # +1.0 then -1.0
    assert mxfp4.dequantize(one, np.full((1, 1), 127, np.uint8))[0, :3].tolist() == [1.0, -1.0, 0.0]


def write_pair(folder, blocks, scales):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    tensors = {"w_blocks": blocks} if scales is None else {"w_blocks": blocks, "w_scales": scales}
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("blocks, scales, problem", [
    (np.zeros((2, 4, 16), np.uint8), None, "lacks its w_scales"),
    (np.zeros((2, 4, 15), np.uint8), np.zeros((2, 4), np.uint8), "not U8"),
    (np.zeros((2, 4, 16), np.uint8), np.zeros((2, 5), np.uint8), "a scale for each group"),
    (np.zeros((2, 4, 16), np.uint8), np.zeros((2, 4), np.float32), "a scale for each group"),
])
def test_blocks_that_do_not_describe_a_weight_are_refused_naming_them(tmp_path, blocks, scales, problem):
    write_pair(tmp_path / "ckpt", blocks, scales)
    with pytest.raises(CheckpointError, match=problem) as error:
        Checkpoint(tmp_path / "ckpt")
    assert "model.safetensors" in str(error.value) and "\n" not in str(error.value)


@pytest.fixture(scope="module")
def hub_mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return to_mxfp4(build_with_transformers(root / "src", "gpt_oss"), root / "hub")


def logits(model, ids):
    model.reset()
    return model.prefill(ids)


@pytest.mark.oracle
@pytest.mark.skipif(not available, reason=reason)
@pytest.mark.parametrize("quant", ["Q4_K_M", "F32"])
def test_hub_mxfp4_experts_are_kept_byte_for_byte(hub_mxfp4, tmp_path, quant):
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    convert(str(hub_mxfp4), tmp_path / "out", ConvertOptions(quant=quant, progress=False))
    layout = ModelLayout(tmp_path / "out")
    source = {}
    for file in hub_mxfp4.glob("*.safetensors"):
        source.update(load_file(file))
    for layer, table in layout.expert_layers.items():
        assert {m.encoding for m in table.matrices.values()} == {"MXFP4"}
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = mxfp4.ggml_blocks(source[p + "gate_up_proj_blocks"].numpy(), source[p + "gate_up_proj_scales"].numpy())
        down = mxfp4.ggml_blocks(source[p + "down_proj_blocks"].numpy(), source[p + "down_proj_scales"].numpy())
        # transformers' dequantization, [E, D, 2I] as GptOssExperts holds it
        values = convert_moe_packed_tensors(source[p + "gate_up_proj_blocks"], source[p + "gate_up_proj_scales"],
                                            dtype=torch.float32).numpy()
        for e in range(table.count):
            gate = layout.expert_matrix_data(layer, e, "gate").reshape(gate_up.shape[1] // 2, -1)
            assert np.array_equal(gate, gate_up[e, 0::2])
            assert np.array_equal(layout.expert_matrix_data(layer, e, "up").reshape(gate.shape), gate_up[e, 1::2])
            assert np.array_equal(layout.expert_matrix_data(layer, e, "down").reshape(down.shape[1:]), down[e])
            dequantized = gguf.quants.dequantize(gate, gguf.GGMLQuantizationType.MXFP4)
            assert np.array_equal(dequantized, values[e][:, 0::2].T)


@pytest.mark.oracle
@pytest.mark.skipif(not available, reason=reason)
def test_hub_mxfp4_logits_stay_close_to_transformers(hub_mxfp4, tmp_path):
    import torch

    from colibri.runtime import open_model

    reference = load_reference(hub_mxfp4)  # the experts dequantized by transformers
    convert(str(hub_mxfp4), tmp_path / "out", ConvertOptions(quant="F32", progress=False))
    model = open_model(tmp_path / "out", ctx=128, kv_quant="f32", ram_budget="8G")
    for length in (7, 33):
        ids = [int(t) for t in np.random.default_rng(length).integers(0, 512, length)]
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].float().numpy()
        got = logits(model, ids)
        cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        # the MXFP4 experts take int8 activations: the Q8_0 bounds of test_oracle_runtime
        assert np.median(cosine) >= 0.999, length
        assert np.median(np.abs(got - want).max(-1)) <= 0.05 * want.std(), length
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.85, length
