"""runtime/fused.py: a decoded token's fused attention + routing gives the general path's bits.

`DecodeLayer` and the general path (`model.Attention`, `model.Router`, which serve prompts)
share their kernels and their order of arithmetic, so a decode must give identical logits
with and without it, for every attention variant it takes: plain (Mixtral), q/k/v bias and
a shared expert (Qwen2-MoE), per-head q/k norms (Qwen3-MoE), whole-projection q/k norms with
clipping (OLMoE), partial rotary (GLM-4.5), and every KV cache kind.
"""

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint

CASES = [("mixtral", "Q4_K_M", "f16"), ("qwen2_moe", "Q8_0", "q8_0"), ("qwen3_moe", "Q4_K_M", "f32"),
         ("olmoe", "F32", "f16"), ("glm4_moe", "Q4_K_M", "f16")]


@pytest.mark.parametrize("arch, quant, kv_quant", CASES, ids=[c[0] for c in CASES])
def test_decoding_with_fused_layers_gives_the_general_paths_logits(tmp_path, arch, quant, kv_quant):
    from colibri.runtime import open_model

    convert(str(write_checkpoint(tmp_path / "src", arch)), tmp_path / "model", ConvertOptions(quant=quant, progress=False))
    model = open_model(tmp_path / "model", ctx=64, ram_budget="8G", kv_quant=kv_quant)
    if arch == "olmoe":
        model.config.clip_qkv = 0.05  # clips most of the values
    fused_layers = model.decoder.decode_layers
    assert sum(step is not None for step in fused_layers) >= 1

    def decode(steps):
        model.decoder.decode_layers = steps
        model.reset()
        logits = [model.prefill([5, 9, 2, 7])[-1]]
        for _ in range(6):
            logits.append(model.decode(int(np.argmax(logits[-1]))))
        return np.array(logits)

    np.testing.assert_array_equal(decode(fused_layers), decode([None] * len(fused_layers)))
