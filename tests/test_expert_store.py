"""The expert cache: policies decide what stays, never what is computed."""

import os

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.runtime.expert_store import POLICIES, CacheIndex


def test_lru_evicts_the_least_recently_used():
    index = CacheIndex(2, "lru")
    index.place([(0, 1)])
    index.place([(0, 2)])
    index.place([(0, 1)])  # 1 is now more recent than 2
    index.place([(0, 3)])  # evicts 2
    assert set(index.slot_of) == {(0, 1), (0, 3)} and index.evictions == 1


def test_lfru_keeps_a_hot_expert_through_a_burst_of_cold_ones():
    lru, lfru = CacheIndex(2, "lru"), CacheIndex(2, "lfru")
    for index in (lru, lfru):
        for _ in range(10):
            index.place([(0, 0)])
        for cold in range(1, 5):
            index.place([(0, cold)])
    assert (0, 0) in lfru.slot_of and (0, 0) not in lru.slot_of


def test_a_request_larger_than_the_cache_never_evicts_its_own_experts():
    index = CacheIndex(2, "lru")
    placed = index.place([(0, 5), (0, 1), (0, 3)])
    assert [key for key, _, _ in placed] == [(0, 1), (0, 3), (0, 5)]  # file order
    slots = [slot for _, slot, _ in placed]
    assert slots[:2] != [None, None] and slots[2] is None  # the third goes to scratch
    assert index.misses == 3 and index.hits == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_hit_path_counts_and_touches_as_a_lookup_does(policy):
    """`hit_slots` (the all-cached lookup, by array) gives the slots `place` gave, counts and
    touches as `place` does, and gives None, counting nothing, once one expert was evicted."""
    fast, slow = CacheIndex(3, policy), CacheIndex(3, policy)
    for index in (fast, slow):
        index.place([(0, 70), (0, 2)])
        index.place([(0, 5)])
    slots = fast.hit_slots(0, np.array([5, 70, 5], np.int64))
    placed = dict((key, slot) for key, slot, _ in slow.place([(0, 5), (0, 70), (0, 5)]))
    assert slots.tolist() == [placed[0, 5], placed[0, 70], placed[0, 5]]
    assert (fast.hits, fast.misses) == (slow.hits, slow.misses) == (2, 3)
    for index in (fast, slow):
        index.place([(1, 0)])  # evicts the same expert from both: they were touched alike
    assert fast.slot_of == slow.slot_of and fast.evictions == 1
    evicted = next(e for e in (2, 5, 70) if (0, e) not in fast.slot_of)
    assert fast.hit_slots(0, np.array([evicted], np.int64)) is None and fast.hits == 2
    assert fast.hit_slots(1, np.array([0], np.int64)).tolist() == [fast.slot_of[1, 0]]
    assert fast.hit_slots(2, np.array([0], np.int64)) is None  # a layer never seen


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from colibri.convert.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("store")
    src = write_checkpoint(root / "src", "deepseek_v3")
    convert(str(src), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "model"


def test_read_ahead_is_neither_hit_nor_miss_and_keeps_protected_slots():
    index = CacheIndex(3, "lru")
    index.place([(0, 1), (0, 2)])
    slot = index.admit((1, 7), protected={(0, 1), (0, 2)})
    assert slot is not None and index.hits == 0 and index.misses == 2
    assert index.admit((1, 8), protected={(0, 1), (0, 2), (1, 7)}) is None  # every slot is protected
    assert index.place([(1, 7)])[0][2] and index.hits == 1  # the read-ahead expert is a hit
    index.drop((1, 7))
    assert (1, 7) not in index.slot_of and index.free == [slot]


def _logits(model, ids, **options):
    from colibri.runtime import open_model

    m = open_model(model, ctx=64, ram_budget="8G", **options)
    try:
        logits = [m.prefill(ids[:8])] + [m.decode(t)[None] for t in ids[8:]]
        return np.concatenate(logits), m.stats()
    finally:
        m.close()


def test_placement_policy_prefetch_and_io_mode_never_change_logits(model):
    from colibri.formats.layout import ModelLayout

    all_experts = sum(t.stride * t.count for t in ModelLayout(model).expert_layers.values())
    ids = list(range(3, 23))
    runs = {}
    # Not run, as each computes what a run here does: prefetch with no cache (the store starts no
    # prefetcher without a slot to read into), and a second policy's prefetch with room for
    # every expert (a free slot is always left, so no policy is asked for a victim).
    for policy in POLICIES:
        for cache in (0, all_experts // 3, all_experts):
            for prefetch in (False, True):
                if prefetch and (cache == 0 or (cache == all_experts and policy != "lru")):
                    continue
                runs[policy, cache, prefetch] = _logits(model, ids, expert_cache=cache, cache_policy=policy, prefetch=prefetch)
    runs["direct"] = _logits(model, ids, expert_cache=all_experts // 3, prefetch=True, io="direct")
    for cache in (0, all_experts // 3, all_experts):
        runs["mmap", cache] = _logits(model, ids, expert_cache=cache, prefetch=True, io="mmap")
    reference = runs["lru", 0, False][0]
    assert all(np.array_equal(reference, logits) for logits, _ in runs.values())
    for policy in POLICIES:
        rates = [runs[policy, cache, False][1]["expert_hit_rate"] for cache in (0, all_experts // 3, all_experts)]
        assert rates[0] == 0.0 < rates[1] < rates[2]
    streaming = runs["lru", all_experts // 3, True][1]
    assert streaming["prefetch"] and streaming["prefetched_experts"] > 0
    assert 0 <= streaming["prefetch_accuracy"] <= 1 and 0 <= streaming["read_hidden_share"] <= 1
    assert not runs["lru", all_experts // 3, False][1]["prefetched_experts"]
    assert runs["direct"][1]["io"] == "direct" and runs["direct"][1]["expert_bytes_read"] > 0
    mapped = runs["mmap", all_experts // 3][1]
    assert mapped["io"] == "mmap" and mapped["expert_evictions"] > 0 and mapped["expert_resident_bytes"] is not None
    assert runs["direct"][1]["expert_resident_bytes"] is None


def test_a_failed_read_ahead_is_reported_by_the_fetch_that_needs_it(model):
    from colibri.runtime import open_model

    from colibri.formats.layout import ModelLayout

    all_experts = sum(t.stride * t.count for t in ModelLayout(model).expert_layers.values())
    m = open_model(model, ctx=64, ram_budget="8G", expert_cache=all_experts // 3, prefetch=True)
    store = m.store
    layer = min(store.tables)
    store.prefetch(layer, [0, 1], in_use=set())
    for future in list(store.pending.values()):
        future.exception()
    store.index.place([(layer, 0)])  # landed: a hit, and the slot holds expert 0 of `layer`
    slot = store.index.slot_of[(layer, 0)]
    assert np.array_equal(store.slab[slot, : store.tables[layer].expert_bytes], ModelLayout(model).expert_data(layer, 0))
    for fd in store.fds.values():
        os.close(fd)
    store.fds = {file: os.open("/dev/null", os.O_RDONLY) for file in store.fds}  # every read now comes up short
    store.prefetch(layer, [5], in_use=set())
    with pytest.raises(OSError, match="short read"):
        store.fetch(layer, [5])
    assert (layer, 5) not in store.index.slot_of and not store.pending  # no slot claims to hold it
    with pytest.raises(OSError, match="short read"):  # asked again, it is read again, not served from garbage
        store.fetch(layer, [5])


def test_prefill_of_the_last_position_only_gives_its_row(model):
    from colibri.runtime import open_model

    m = open_model(model, ctx=64, ram_budget="8G")
    ids = list(range(3, 14))
    every = m.prefill(ids)
    m.reset()
    last = m.prefill(ids, all_logits=False)
    assert last.shape == (1, every.shape[1]) and np.array_equal(last[0], every[-1])


def test_a_prompt_longer_than_a_chunk_gives_the_logits_of_one_pass(model, monkeypatch):
    from colibri.runtime import amx, engine, kernels, open_model

    # int8 products only (the tile path serves a product of at least amx.MIN_TOKENS rows, which
    # chunks change). Attention sums in another order for a chunk's few queries than for a
    # whole prompt's (kernels.attention): most rows agree to float rounding; a row where such
    # a difference tips an int8 activation's rounding, or a router's near-tie, moves further,
    # but within the int8 path's error, not by the O(1) of a misplaced position or cache row.
    monkeypatch.setattr(amx, "available", lambda: False)
    m = open_model(model, ctx=64, ram_budget="8G")
    ids = list(range(3, 40))
    whole = m.prefill(ids)
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)  # 4 chunks of 8 and one of 5
    m.reset()
    chunked = m.prefill(ids)
    m.reset()
    last = m.prefill(ids, all_logits=False)
    assert chunked.shape == whole.shape and m.cache.length == len(ids)
    rows = np.abs(chunked - whole).max(axis=1)
    assert np.median(rows) <= 1e-4 * whole.std() and rows.max() <= kernels.FAST_PATH_TOLERANCE * np.abs(whole).max()
    assert np.array_equal(last[0], chunked[-1])


def test_a_known_read_ahead_counts_as_a_miss_of_the_fetch_it_serves(model):
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.expert_store import ExpertStore

    layout = ModelLayout(model)
    layer = next(iter(layout.expert_layers))
    store = ExpertStore(layout, 8 * layout.expert_layers[layer].stride, 2)
    try:
        store.prefetch(layer, [2, 3], in_use=set(), speculative=False)
        slots = store.fetch(layer, [2, 3, 4])
        stats = store.stats()
        assert (stats["expert_hits"], stats["expert_misses"]) == (0, 3) and stats["prefetched_experts"] == 0
        assert all(np.array_equal(store.slab[s, :layout.expert_layers[layer].expert_bytes], layout.expert_data(layer, e))
                   for s, e in zip(slots, (2, 3, 4)))
        store.fetch(layer, [2])
        assert store.stats()["expert_hits"] == 1
    finally:
        store.close()


def test_a_kernel_may_read_the_slot_table_only_while_nothing_else_can_change_the_cache(model):
    """`slot_table` gives each expert's slot (-1: not cached) to a kernel that looks experts up
    itself, and None while a read ahead is pending or uncounted, with a prefetcher, or with
    mapped records; `count_hits` then counts as the fetch it replaces."""
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.expert_store import ExpertStore

    layout = ModelLayout(model)
    layer = next(iter(layout.expert_layers))
    store = ExpertStore(layout, 8 * layout.expert_layers[layer].stride, 2)
    try:
        slots = store.fetch(layer, [1, 4])
        table = store.slot_table(layer)
        assert table[[1, 4]].tolist() == slots.tolist() and table[0] == -1
        store.count_hits(layer, np.array([4, 1], np.int64))
        assert store.stats()["expert_hits"] == 2
        store.prefetch(layer, [5], in_use=set(), speculative=False)
        assert store.slot_table(layer) is None  # read ahead, not yet fetched
        store.fetch(layer, [5])
        assert store.slot_table(layer) is not None
    finally:
        store.close()
    for options in ({"prefetch": True}, {"io": "mmap"}):
        store = ExpertStore(layout, 8 * layout.expert_layers[layer].stride, 2, **options)
        try:
            store.fetch(layer, [1])
            assert store.slot_table(layer) is None
        finally:
            store.close()
