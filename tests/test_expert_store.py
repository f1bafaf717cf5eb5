"""The expert cache: policies decide what stays, never what is computed."""

import numpy as np
import pytest

from convert.hf_to_colibri import ConvertOptions, convert
from runtime.expert_store import POLICIES, CacheIndex


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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from convert.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("store")
    src = write_checkpoint(root / "src", "deepseek_v3")
    convert(str(src), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "model"


def test_placement_and_policy_never_change_logits(model):
    from runtime import open_model

    from formats.layout import ModelLayout

    all_experts = sum(t.stride * t.count for t in ModelLayout(model).expert_layers.values())
    ids = list(range(3, 23))
    runs = {}
    for policy in POLICIES:
        for cache in (0, all_experts // 3, all_experts):
            m = open_model(model, ctx=64, expert_cache=cache, cache_policy=policy, ram_budget="2G")
            logits = [m.prefill(ids[:8])] + [m.decode(t)[None] for t in ids[8:]]
            runs[policy, cache] = (np.concatenate(logits), m.stats()["expert_hit_rate"])
    reference = runs["lru", 0][0]
    assert all(np.array_equal(reference, logits) for logits, _ in runs.values())
    for policy in POLICIES:
        assert runs[policy, 0][1] == 0.0 < runs[policy, all_experts // 3][1] < runs[policy, all_experts][1]
