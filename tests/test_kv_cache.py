"""The KV cache's storage kinds on MLA, whose one stream per layer holds the latent and then the
shared rotary key (read in place by the attention kernel when f16): f16 and q8_0 give the f32
cache's logits up to their rounding, for a prompt and for the tokens decoded after it. (On
this random-weight model q8_0's worst logit is off by most of a standard deviation, as it
was with the two streams stored apart; on the trained reference models' held-out text q8_0
costs a mean KL of about 1e-4 from f16, which tests/test_reference_models.py holds.) A
sliding-window layer keeps only its window, and its logits are those of a cache that kept
everything."""

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.runtime import open_model
from colibri.runtime.kv_cache import WRITE_ROOM, CacheShape, KVCache, KVPool
from colibri.runtime.model import Decoder

TOLERANCE = {"f16": 0.03, "q8_0": 0.1}  # mean error, of the f32 logits' standard deviation


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    convert(str(write_checkpoint(root / "src", "deepseek_v3")), root / "model", ConvertOptions(quant="Q8_0", progress=False))
    return root / "model"


def logits(path, kv_quant, ids):
    model = open_model(path, ctx=64, kv_quant=kv_quant, ram_budget="8G")
    out = [model.prefill(ids[:12])]
    out += [model.decode(t)[None] for t in ids[12:]]
    return np.concatenate(out)


@pytest.mark.parametrize("kv_quant", sorted(TOLERANCE))
def test_mla_cache_kinds_agree_with_f32(mla_model, kv_quant):
    ids = np.random.default_rng(3).integers(0, 500, 20).tolist()
    want, got = logits(mla_model, "f32", ids), logits(mla_model, kv_quant, ids)
    assert np.abs(got - want).mean() <= TOLERANCE[kv_quant] * want.std()


def f32_model(tmp_path_factory, arch):
    root = tmp_path_factory.mktemp(f"kv-{arch}")
    convert(str(write_checkpoint(root / "src", arch, dtype="f32")), root / "model", ConvertOptions(quant="F32", progress=False))
    return root / "model"


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """gpt-oss's tiny model: layer 0 sees 8 positions, layer 1 all of them."""
    return f32_model(tmp_path_factory, "gpt_oss")


@pytest.mark.parametrize("kv_quant", ["f32", "f16", "q8_0"])
def test_a_sliding_layer_keeps_only_its_window_and_gives_the_same_logits(windowed_model, kv_quant):
    ctx, n = 1400, 1300
    model = open_model(windowed_model, ctx=ctx, kv_quant=kv_quant, ram_budget="8G")
    window = model.config.sliding_window
    rows = [streams["k"].shape[0] for streams in model.cache.values]
    assert rows == [window - 1 + WRITE_ROOM, ctx]
    assert model.cache.nbytes == CacheShape(2, Decoder.cache_shape_for(model.config).widths, (window, 0)).nbytes(ctx, kv_quant)
    ids = np.random.default_rng(5).integers(0, 500, n).tolist()
    whole = model.prefill(ids)  # in chunks of WRITE_ROOM: the window moves to the rows' front
    assert model.cache.first(0, "k") > 0 and model.cache.first(1, "k") == 0
    model.reset()
    prompt = model.prefill(ids[:600])
    steps = np.array([model.decode(t) for t in ids[600:700]])
    assert np.array_equal(prompt, whole[:600])
    assert np.abs(steps - whole[600:700]).max() <= 1e-4 * whole.std()  # decode's one-query attention


def test_a_windowed_cache_refuses_a_position_before_its_window():
    cache = KVCache(CacheShape(1, {"k": 32}, (4,)), 4096, "f32")
    cache.write(0, "k", 0, np.ones((600, 32), np.float32))
    cache.write(0, "k", 600, np.ones((100, 32), np.float32))  # moves positions 597.. to the front
    assert cache.first(0, "k") == 597
    with pytest.raises(ValueError, match="before the window"):
        cache.write(0, "k", 300, np.ones((1, 32), np.float32))


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """Qwen3-Next's tiny model: layer 0 a gated DeltaNet, layer 1 attention."""
    return f32_model(tmp_path_factory, "qwen3_next")


@pytest.mark.parametrize("kv_quant", ["f32", "q8_0"])
def test_a_deltanet_layer_keeps_fixed_states_that_plan_and_budget_count(hybrid_model, kv_quant):
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.plan import plan

    ctx = 512
    model = open_model(hybrid_model, ctx=ctx, kv_quant=kv_quant, ram_budget="8G")
    c, cache = model.config, model.cache
    assert [streams["k"].shape[0] for streams in cache.values] == [0, ctx]  # no positions in the DeltaNet layer
    assert {n: a.shape for n, a in cache.states[0].items()} == {
        "conv": (c.linear_conv_kernel - 1, c.linear_conv_channels),
        "recurrent": (c.linear_v_heads, c.linear_k_head_dim, c.linear_v_head_dim)}
    state_bytes = 4 * ((c.linear_conv_kernel - 1) * c.linear_conv_channels
                       + c.linear_v_heads * c.linear_k_head_dim * c.linear_v_head_dim)
    assert cache.nbytes == Decoder.cache_shape_for(c).nbytes(ctx, kv_quant) == model.budget.kv
    assert Decoder.cache_shape_for(c).state_bytes() == state_bytes
    p = plan(ModelLayout(hybrid_model), 8 << 30, ctx=ctx, kv_quant=kv_quant, mem_bw=1e10)
    assert p["kv_cache_bytes"] == cache.nbytes and p["state_bytes"] == state_bytes


def test_deltanet_states_continue_across_passes_and_restart_at_position_0(hybrid_model):
    model = open_model(hybrid_model, ctx=256, kv_quant="f32", ram_budget="8G")
    ids = np.random.default_rng(8).integers(0, 500, 40).tolist()
    whole = model.prefill(ids)
    assert np.abs(model.cache.states[0]["recurrent"]).max() > 0
    model.reset()
    parts = np.concatenate([model.prefill(ids[:5]), model.prefill(ids[5:23]),
                            np.array([model.decode(t) for t in ids[23:]])])
    assert np.abs(parts - whole).max() <= 1e-5 * whole.std()
    model.reset()  # a new sequence starts from zero states, whatever the last one left
    assert np.array_equal(model.prefill(ids), whole)


def test_pooled_caches_write_and_read_as_caches_of_their_own():
    """A pool's caches are its slots in the unwindowed layers and own arrays in the windowed
    ones; the pool's one-call write of a position of many slots stores what each cache's
    write does."""
    shape = CacheShape(2, {"k": 32}, (0, 8))
    pool, own = KVPool(shape, 64, "f16", 3), [KVCache(shape, 64, "f16") for _ in range(3)]
    rows = np.random.default_rng(9).standard_normal((3, 32)).astype(np.float32)
    slots, positions = np.array([2, 0], np.int64), np.array([5, 11], np.int64)
    pool.write(0, "k", slots, positions, rows[:2])
    for slot, position, row in zip(slots, positions, rows):
        own[slot].write(0, "k", int(position), row[None])
    for cache, alone in zip(pool.caches, own):
        assert np.array_equal(cache.stored(0, "k", 12), alone.stored(0, "k", 12))
    assert np.shares_memory(pool.caches[1].values[0]["k"], pool.values[0]["k"])
    assert not np.shares_memory(pool.caches[1].values[1]["k"], pool.caches[2].values[1]["k"])
    assert pool.holds(0, pool.caches[:2]) and not pool.holds(1, pool.caches[:2])
    assert not pool.holds(0, [pool.caches[0], own[0]])
    assert pool.caches[0].nbytes == own[0].nbytes


def test_sequences_batched_over_a_pool_with_sinks_and_windows_get_their_logits_alone(windowed_model):
    """gpt-oss (attention sinks, a sliding layer): a batch step's one attention call over the
    pool gives each sequence the logits it gets alone."""
    def run(parallel, prompts):
        model = open_model(windowed_model, ctx=64, ram_budget="8G", parallel=parallel)
        scheduler = model.scheduler(keep_logits=True)
        index = {scheduler.add(p, 6, ignore_eos=True): i for i, p in enumerate(prompts)}
        out = {}
        while scheduler.busy:
            for event in scheduler.step():
                out.setdefault(index[event.sequence], []).append(event.logits)
        return out

    prompts = [np.random.default_rng(i).integers(3, 500, 5 + 3 * i).tolist() for i in range(3)]
    together = run(3, prompts)
    for i, prompt in enumerate(prompts):
        alone = run(1, [prompt])[0]
        assert len(alone) == len(together[i])
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(alone, together[i]))
