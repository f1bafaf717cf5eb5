"""The runtime computes what transformers computes (oracle extra).

Tiny models of every architecture are built and saved by transformers, converted, and run:
F32 logits must match transformers' float32 logits to 1e-4 × their standard deviation for
prompts of 1, 7 and 33 tokens and 16 cached decode steps, with identical greedy tokens;
BF16 conversions the same against the bf16 checkpoint upcast to float32. Quantized
conversions are compared with the F32 run, teacher-forced on the same tokens.
"""

import numpy as np
import pytest
from oracle_models import build_with_transformers, load_reference, oracle_available

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES
from colibri.formats.config_check import OVERLAPPING_RATIO

available, reason = oracle_available()
pytestmark = [pytest.mark.oracle, pytest.mark.skipif(not available, reason=reason)]

PROMPT_LENGTHS = (1, 7, 33)
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(arch, dtype)`: (checkpoint folder, transformers model, {quant: converted folder})."""
    cache = {}

    def build(arch, dtype="f32"):
        if (arch, dtype) not in cache:
            folder = tmp_path_factory.mktemp(f"rt-{arch}-{dtype}")
            src = build_with_transformers(folder / "src", arch, dtype=dtype)
            cache[arch, dtype] = (src, load_reference(src), {})
        return cache[arch, dtype]

    return build


def converted(entry, quant):
    src, _, outs = entry
    if quant not in outs:
        outs[quant] = src.parent / f"out-{quant}"
        convert(str(src), outs[quant], ConvertOptions(quant=quant, progress=False))
    return outs[quant]


def reference_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def prompt(vocab, length, seed=0):
    return [int(t) for t in np.random.default_rng(seed + length).integers(0, vocab, length)]


def open_f32(path, **kwargs):
    from colibri.runtime import open_model

    return open_model(path, ctx=128, kv_quant="f32", ram_budget="8G", **kwargs)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(built, arch, dtype):
    entry = built(arch, dtype)
    reference = entry[1]
    model = open_f32(converted(entry, "F32" if dtype == "f32" else "BF16"))
    vocab = reference.config.get_text_config().vocab_size
    for length in PROMPT_LENGTHS:
        ids = prompt(vocab, length)
        want = reference_logits(reference, ids)
        model.reset()
        got = model.prefill(ids)
        assert np.abs(got - want).max() <= 1e-4 * want.std(), (arch, length)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    # greedy generation through the KV cache, one decode step at a time
    ids = prompt(vocab, 7)
    model.reset()
    logits = model.prefill(ids)[-1]
    for _ in range(DECODE_STEPS):
        token = int(np.argmax(logits))
        ids.append(token)
        logits = model.decode(token)
    want = reference_logits(reference, ids)
    assert [int(t) for t in want[6:-1].argmax(-1)] == ids[7:], "greedy tokens differ from transformers"
    assert np.abs(logits - want[-1]).max() <= 1e-4 * want.std()


def test_gpt_oss_clamped_swiglu_and_window_match_transformers(tmp_path):
    """gpt-oss with a SwiGLU limit its products cross and a window of 4: prompts and cached
    decode steps against transformers."""
    src = build_with_transformers(tmp_path / "src", "gpt_oss", overrides={"swiglu_limit": 0.05, "sliding_window": 4})
    reference = load_reference(src)
    convert(str(src), tmp_path / "out", ConvertOptions(quant="F32", progress=False))
    model = open_f32(tmp_path / "out")
    assert model.config.swiglu_limit == 0.05  # the products' std is ~0.3: most are clipped
    for length in PROMPT_LENGTHS:
        ids = prompt(reference.config.get_text_config().vocab_size, length)
        want = reference_logits(reference, ids)
        model.reset()
        assert np.abs(model.prefill(ids) - want).max() <= 1e-4 * want.std(), length
    ids = prompt(reference.config.get_text_config().vocab_size, 7)
    model.reset()
    steps = [model.prefill(ids)[-1]] + [model.decode(t) for t in prompt(reference.config.get_text_config().vocab_size, 16, seed=1)]
    want = reference_logits(reference, ids + prompt(reference.config.get_text_config().vocab_size, 16, seed=1))[6:]
    assert np.abs(np.array(steps) - want).max() <= 1e-4 * want.std()


# Bounds from measurements on these tiny random models (two prompts × eight architectures):
# Q8_0 median cosine ≥ 0.9997, mean KL ≤ 0.0007; Q4_K_M median cosine ≥ 0.974, mean KL ≤ 0.0052.
# Quantization flips near-tied router choices (worst in the sigmoid-routed DeepSeek/GLM
# models), and one flip changes that token's logits a lot, so the gates are the median
# cosine, the mean KL, and top-1 agreement only on rows whose top-1 clearly leads.
QUANT_BOUNDS = {
    "Q8_0": {"median_cos": 0.999, "mean_kl": 0.002, "top1": 0.85},
    "Q4_K_M": {"median_cos": 0.96, "mean_kl": 0.01, "top1": 0.6},
}
# DeepSeek's sparse attention: past index_topk positions (DeepSeek-V4: compressed entries of 4;
# MiniMax-M3: blocks) quantization also changes which ones a query attends to (DeepSeek-V3.2's median cosine there:
# Q8_0 0.997, Q4_K_M 0.936), so the bounds above hold for the rows before, these for the rows after
SPARSE_MEDIAN_COS = {"Q8_0": 0.99, "Q4_K_M": 0.9}
# DeepSeek-V4's tiny model has more products a row than the others (query LoRA, grouped output,
# compressors, 4 streams mixed twice a layer): its Q4_K_M median cosine is 0.958 on the dense rows,
# whether or not its hyper-connection and compressor tensors are quantized
# Kimi-Linear's tiny model: median cosine 0.948, 4 of its 7 clear rows. Its first KDA layer's output
# moves 14% (relative) at Q4_K_M, as Qwen3-Next's DeltaNet's (18%) and Kimi-K2's MLA's (12%) do,
# most of it from the Q4_K embedding (8% with the rest in F32); three such layers, two routed, add up
# GLM-5-Next's tiny model keeps 2 pools of 4 a query: one pool flipped is half of what it attends to,
# and its Q8_0 flips 14 of the last indexer layer's 37 sparse rows (median cosine 0.975 there, Q4_K_M
# 0.88); its dense rows, KDA and MLA under 4 streams: Q4_K_M median cosine 0.946, Q8_0 4 of 5 clear
# rows. llama.cpp computes the same on its export (tests/test_llama_cpp.py)
BOUNDS_OF = {("deepseek_v4", "Q4_K_M"): {"median_cos": 0.95}, ("kimi_linear", "Q4_K_M"): {"median_cos": 0.94, "top1": 0.5},
             ("glm5_next_text", "Q8_0"): {"top1": 0.8}, ("glm5_next_text", "Q4_K_M"): {"median_cos": 0.93}}
SPARSE_BOUNDS_OF = {("glm5_next_text", "Q8_0"): 0.96, ("glm5_next_text", "Q4_K_M"): 0.85}
CLEAR_MARGIN = 0.5  # top-1 minus top-2 logit, in units of the logits' standard deviation


def dense_rows(c, n: int) -> int:
    """The first rows whose queries attend to every position (DeepSeek-V4: every entry; MiniMax-M3:
    every block; GLM-5-Next: every pool)."""
    if not c.index_topk:
        return n
    if c.index_block:
        return c.index_topk * c.index_block
    if c.index_kpool:  # GLM-5-Next: every pool, and the positions after the last complete one
        return c.index_topk + c.index_kpool - 1
    return (c.index_topk + 1) * OVERLAPPING_RATIO - 1 if c.attention == "compressed" else c.index_topk


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("quant", list(QUANT_BOUNDS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_runs_stay_close_to_f32(built, arch, quant):
    entry = built(arch)
    vocab = entry[1].config.get_text_config().vocab_size
    ids = prompt(vocab, 48, seed=1)
    want = open_f32(converted(entry, "F32")).prefill(ids)
    model = open_f32(converted(entry, quant))
    got = model.prefill(ids)
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    log_p, log_q = log_softmax(want), log_softmax(got)
    dense = dense_rows(model.config, len(ids))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)[:dense].mean()
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = ((top2[:, 1] - top2[:, 0]) > CLEAR_MARGIN * want.std())[:dense]
    agreement = (got.argmax(-1) == want.argmax(-1))[:dense][clear].mean() if clear.any() else 1.0
    bounds = {**QUANT_BOUNDS[quant], **BOUNDS_OF.get((arch, quant), {})}
    assert np.median(cos[:dense]) >= bounds["median_cos"], (arch, quant, np.median(cos[:dense]))
    if dense < len(ids):
        sparse_bound = SPARSE_BOUNDS_OF.get((arch, quant), SPARSE_MEDIAN_COS[quant])
        assert np.median(cos[dense:]) >= sparse_bound, (arch, quant, np.median(cos[dense:]))
    assert kl <= bounds["mean_kl"], (arch, quant, kl)
    assert agreement >= bounds["top1"], (arch, quant, agreement, int(clear.sum()))


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss", "glm_moe_dsa", "qwen3_5_moe", "deepseek_v4"])
def test_placement_never_changes_logits(built, arch):
    entry = built(arch)
    path = converted(entry, "Q4_K_M")
    from colibri.formats.layout import ModelLayout

    layout = ModelLayout(path)
    all_experts = sum(t.stride * t.count for t in layout.expert_layers.values())
    ids = prompt(entry[1].config.get_text_config().vocab_size, 20, seed=2)
    results, hit_rates = [], []
    for cache_bytes in (0, all_experts // 4, all_experts):
        model = open_f32(path, expert_cache=cache_bytes)
        logits = [model.prefill(ids[:10])]
        logits += [model.decode(t)[None] for t in ids[10:]]
        results.append(np.concatenate(logits))
        hit_rates.append(model.stats()["expert_hit_rate"])
    assert all(np.array_equal(results[0], r) for r in results[1:])
    assert hit_rates[0] == 0.0 and hit_rates[0] < hit_rates[1] < hit_rates[2]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompts_batched_together_match_transformers(built, arch):
    """Prompts of 1, 7 and 33 tokens decoded together (`runtime.batch`): each step's logits
    match transformers' on that sequence alone, and the greedy tokens are transformers'."""
    entry = built(arch)
    reference = entry[1]
    model = open_f32(converted(entry, "F32"), parallel=len(PROMPT_LENGTHS))
    scheduler = model.scheduler(keep_logits=True)
    prompts = {scheduler.add(prompt(reference.config.get_text_config().vocab_size, n), 8): prompt(reference.config.get_text_config().vocab_size, n)
               for n in PROMPT_LENGTHS}
    steps = {i: [] for i in prompts}
    while scheduler.busy:
        for event in scheduler.step():
            steps[event.sequence].append(event)
    for i, ids in prompts.items():
        tokens = [e.token for e in steps[i]]
        want = reference_logits(reference, ids + tokens)[len(ids) - 1:]
        for event, row in zip(steps[i], want):
            assert np.abs(event.logits - row).max() <= 1e-4 * row.std(), arch
            assert event.token == int(np.argmax(row)), "greedy tokens differ from transformers"
    assert scheduler.stats()["rows_per_step"] > 1
