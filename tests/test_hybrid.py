"""Qwen3-Next and Qwen3.5-MoE checkpoints as the hub ships them: Qwen3.5's multimodal release
(the text model under `model.language_model.`, `lm_head` beside it, a vision tower and its
config beside that, the text config a `qwen3_5_moe_text`), and both models' separate
multi-token-prediction head (`mtp.*`), which no conversion reads."""

import json
import shutil

import numpy as np
from gguf_checks import model_bytes
from safetensors.numpy import load_file, save_file

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.layout import ModelLayout

EXTRA = "model-extra.safetensors"


def rewritten(src, dst, rename, extra: dict, config) -> None:
    """A copy of checkpoint `src` with its tensors renamed, `extra` tensors added in a shard of
    their own and config.json replaced by `config(text config)`."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        save_file({rename(n): d for n, d in load_file(dst / shard).items()}, dst / shard)
    save_file(extra, dst / EXTRA)
    weight_map = {rename(n): f for n, f in index["weight_map"].items()} | dict.fromkeys(extra, EXTRA)
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))


def test_a_qwen3_5_multimodal_checkpoint_converts_as_its_text_model(checkpoint, tmp_path):
    source = checkpoint("qwen3_5_moe", dtype="f32")
    extra = {"model.visual.patch_embed.proj.weight": np.ones((16, 24), np.float32),
             "mtp.fc.weight": np.ones((16, 32), np.float32)}
    rewritten(source, tmp_path / "wrapped", lambda n: n if n == "lm_head.weight" else "model.language_model." + n[6:],
              extra, lambda text: {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                                   "text_config": {**text, "model_type": "qwen3_5_moe_text"},
                                   "vision_config": {"model_type": "qwen3_5_moe", "hidden_size": 16}})
    summary = convert(str(tmp_path / "wrapped"), tmp_path / "a", ConvertOptions(progress=False))
    convert(str(source), tmp_path / "b", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")
    assert summary["skipped_tensors"] == 2
    assert ModelLayout(tmp_path / "a").manifest["provenance"]["skipped_tensors"] == sorted(extra)


def test_qwen3_next_skips_its_multi_token_prediction_head(checkpoint, tmp_path):
    source = checkpoint("qwen3_next", dtype="f32")
    extra = {"mtp.fc.weight": np.ones((16, 32), np.float32), "mtp.layers.0.input_layernorm.weight": np.ones(16, np.float32)}
    rewritten(source, tmp_path / "with-mtp", lambda n: n, extra, lambda config: config)
    summary = convert(str(tmp_path / "with-mtp"), tmp_path / "a", ConvertOptions(progress=False))
    convert(str(source), tmp_path / "b", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "a") == model_bytes(tmp_path / "b")
    assert summary["skipped_tensors"] == 2


def test_the_output_gate_rows_stay_in_the_resident_bytes_the_budget_counts(checkpoint, tmp_path):
    """Gated attention holds its query rows and its gate rows as two matrices, moved within
    attn_q's own memory: nothing beside the resident weights the RAM budget counted."""
    from colibri.runtime import open_model

    convert(str(checkpoint("qwen3_next")), tmp_path / "m", ConvertOptions(quant="Q8_0", progress=False))
    model = open_model(tmp_path / "m", ctx=64, ram_budget="4G")
    attention, raw = model.decoder.layers[1][1], model.decoder.weights.raw["blk.1.attn_q.weight"]
    assert np.shares_memory(attention.q.data, raw) and np.shares_memory(attention.gate.data, raw)
    assert attention.q.data.nbytes + attention.gate.data.nbytes == raw.nbytes
    assert model.budget.resident == model.decoder.weights.nbytes
