"""Checks shared by the GGUF tests: two colibri models hold the same bytes and compute the same logits."""

import numpy as np

from colibri.formats.layout import ModelLayout
from colibri.runtime import open_model
from colibri.runtime.rope import inverse_frequencies

PROMPT = [1, 5, 9, 100, 200, 33, 7, 300, 17, 250]
# The GGUF cannot say these; everything else in the config must come back unchanged (the rope
# scaling as the same frequencies: GGUF names its keys otherwise).
NOT_IN_GGUF = {
    "architecture",  # kimi_k2 is deepseek2 with sigmoid routing, imported as deepseek_v3
    "mtp_layers_skipped",  # counts the MTP layers dropped from *this* source; the export has none
    "bos_token_id", "eos_token_ids",  # from the tokenizer's metadata, not config.json
}


# exports refused, with the reason's words (none now); GGUFs no import reads
EXPORT_REFUSED: dict[str, str] = {}
# llama.cpp's DeepSeek-V4 converter reads only the release's FP4 experts (it repacks them as
# MXFP4), so it writes no GGUF of an F32 checkpoint to import; the export's round trip and
# llama.cpp running it check the deepseek4 GGUF instead
NOT_IMPORTABLE: set[str] = {"deepseek_v4"}


def logits(path, ids=PROMPT):
    return open_model(path, ctx=64, kv_quant="f32", ram_budget="8G").prefill(ids)


def model_bytes(path):
    """Every resident tensor's and expert record's bytes, by name."""
    layout = ModelLayout(path)
    blocks = {name: bytes(layout.tensor_data(name)) for name in layout.tensors}
    for table in layout.expert_layers.values():
        blocks.update({(table.layer, e): bytes(layout.expert_data(table.layer, e)) for e in range(table.count)})
    return blocks


def assert_same_model(a, b):
    first, again = ModelLayout(a), ModelLayout(b)
    assert first.manifest["tensors"] == again.manifest["tensors"]
    assert first.manifest["expert_layers"] == again.manifest["expert_layers"]
    assert model_bytes(a) == model_bytes(b)
    config_a, config_b = first.manifest["config"], again.manifest["config"]
    kept = NOT_IN_GGUF | {"rope_scaling"}
    assert {k: v for k, v in config_a.items() if k not in kept} == {k: v for k, v in config_b.items() if k not in kept}
    (freq_a, factor_a), (freq_b, factor_b) = inverse_frequencies(first.config), inverse_frequencies(again.config)
    assert np.array_equal(freq_a, freq_b) and factor_a == factor_b
    assert np.array_equal(logits(a), logits(b))
