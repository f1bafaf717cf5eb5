"""runtime/fused.py: a token decoded through the fused layer steps gets the general path's bits.

The steps and the general path (`model.Attention`, `model.LatentAttention`, `model.Router`,
`model.DenseFFN`, which serve prompts) run on one record per layer (`runtime.layer_record`) and
share their kernels and their order of arithmetic, so a
decode must give identical logits with and without them, for every layer they take: plain
(Mixtral), q/k/v bias and a gated shared expert (Qwen2-MoE), per-head q/k norms (Qwen3-MoE),
whole-projection q/k norms with clipping (OLMoE), partial rotary and a dense first layer
(GLM-4.5), MLA with the query projected directly (DeepSeek-V2) or through its LoRA with dense
layers and an ungated shared expert (DeepSeek-V3, Kimi-K2), gated DeltaNet layers and gated
attention (Qwen3-Next, Qwen3.5-MoE), chunked and position-free layers with experts whose input
the router scales (Llama 4), Kimi delta attention and MLA without rotation (Kimi-Linear), KDA's
safe gate, MLA with an indexer of pools and hyper-connections (GLM-5-Next), and every KV cache kind.
"""

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import tiny_config, write_checkpoint

CASES = [("mixtral", "Q4_K_M", "f16"), ("qwen2_moe", "Q8_0", "q8_0"), ("qwen3_moe", "Q4_K_M", "f32"),
         ("olmoe", "F32", "f16"), ("glm4_moe", "Q4_K_M", "f16"), ("deepseek_v2", "Q4_K_M", "f16"),
         ("deepseek_v3", "Q4_K_M", "q8_0"), ("deepseek_v3", "F32", "f32"), ("kimi_k2", "Q8_0", "f16"),
         ("qwen3_next", "Q4_K_M", "f16"), ("qwen3_5_moe", "Q8_0", "q8_0"), ("llama4_text", "Q4_K_M", "f16"),
         ("kimi_linear", "Q8_0", "f16"), ("deepseek_v4", "Q4_K_M", "f16"),
         ("minimax_m3_vl_text", "Q4_K_M", "f16"), ("glm5_next_text", "Q4_K_M", "f16")]


@pytest.mark.parametrize("arch, quant, kv_quant", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_decoding_with_fused_layers_gives_the_general_paths_logits(tmp_path, arch, quant, kv_quant):
    from colibri.runtime import open_model

    config = tiny_config(arch, clip_qkv=0.05) if arch == "olmoe" else None  # a clip that clips most of the values
    convert(str(write_checkpoint(tmp_path / "src", arch, config=config)), tmp_path / "model",
            ConvertOptions(quant=quant, progress=False))
    model = open_model(tmp_path / "model", ctx=64, ram_budget="8G", kv_quant=kv_quant)
    assert arch != "olmoe" or model.decoder.records[0].mixer.clip == np.float32(0.05)
    fused_layers, c = model.decoder.decode_layers, model.config
    # every layer but a hyper-connected one without routed experts (GLM-5-Next's dense first layer)
    assert all(step is not None for i, step in enumerate(fused_layers) if not c.hyper_streams or c.is_moe_layer(i))

    def decode(steps):
        model.decoder.decode_layers = steps
        model.reset()
        logits = [model.prefill([5, 9, 2, 7, 11, 3, 8, 1, 4, 6])[-1]]  # then past 12 positions: MiniMax-M3's and
        # GLM-5-Next's sparse
        for _ in range(6):
            logits.append(model.decode(int(np.argmax(logits[-1]))))
        return np.array(logits)

    np.testing.assert_array_equal(decode(fused_layers), decode([None] * len(fused_layers)))


@pytest.mark.parametrize("encodings", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "Q5_K"), ("F32", "Q8_0", "F16")])
def test_a_fused_ffn_step_gives_the_dense_ffns_bits(encodings):
    from colibri.convert.quantize_q4k import quantize
    from colibri.runtime import kernels
    from colibri.runtime.fused import FFNStep
    from colibri.runtime.model import DenseFFN

    rng = np.random.default_rng(3)
    hidden, ffn = 256, 512
    matrices = []
    for encoding, shape in zip(encodings, ((ffn, hidden), (ffn, hidden), (hidden, ffn))):
        stored = quantize(rng.standard_normal(shape).astype(np.float32), encoding).reshape(-1).view(np.uint8)
        matrices.append(kernels.Matrix(stored, encoding, *shape))
    ffn_layer = DenseFFN(*matrices)
    h = np.empty((1, hidden), np.float32)
    step = FFNStep(*matrices, h)
    for _ in range(3):
        h[:] = rng.normal(size=(1, hidden))
        with kernels.decoding_alone():  # the general path's products of one token decoded alone
            np.testing.assert_array_equal(step(), ffn_layer(h.copy()))


@pytest.mark.parametrize("arch, policy", [("mixtral", "lru"), ("deepseek_v3", "lfru")])
def test_the_layer_tail_runs_cached_experts_as_a_fetch_would(tmp_path, monkeypatch, arch, policy):
    """A decoded token's routed experts run inside the output kernel's call when they are all
    cached (found through the store's slot table), else after it through `fetch`: the same
    logits as the general path, and the same hits, misses, evictions and cache contents."""
    from colibri.formats.layout import ModelLayout
    from colibri.runtime import fused, open_model
    from colibri.runtime.expert_store import slot_bytes

    convert(str(write_checkpoint(tmp_path / "src", arch)), tmp_path / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    layout = ModelLayout(tmp_path / "model")
    half = layout.config.n_experts * slot_bytes(layout)  # half the experts of the two MoE layers
    tail, ran = fused._routed_tail_kernel, []
    monkeypatch.setattr(fused, "_routed_tail_kernel", lambda *args: ran.append(tail(*args)) or ran[-1])

    def decode(with_fused_steps: bool):
        model = open_model(tmp_path / "model", ctx=64, cache_policy=policy, expert_cache=half)
        if not with_fused_steps:
            model.decoder.decode_layers = [None] * len(model.decoder.layers)
        logits = [model.prefill([5, 9, 2, 7, 11, 3, 8, 1, 4, 6])[-1]]  # then past 12 positions: MiniMax-M3's and
        # GLM-5-Next's sparse
        for _ in range(8):
            logits.append(model.decode(int(np.argmax(logits[-1]))))
        index = model.store.index
        return np.array(logits), (index.hits, index.misses, index.evictions, dict(index.slot_of))

    fused_logits, fused_cache = decode(True)
    assert True in ran and False in ran  # both branches: every expert cached, and one not
    general_logits, general_cache = decode(False)
    np.testing.assert_array_equal(fused_logits, general_logits)
    assert fused_cache == general_cache and fused_cache[2] > 0  # evictions too
