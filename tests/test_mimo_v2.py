"""MiMo-V2-Flash's config as the hub and as transformers spell it, what its sliding layers have
of their own, and what is refused. Its logits against transformers and llama.cpp are checked
with every architecture's (tests/test_oracle_runtime.py, tests/test_llama_cpp.py)."""

import dataclasses

import pytest

from colibri.convert.arch import ADAPTERS, ConfigError
from colibri.convert.arch.base import normalized_config
from colibri.convert.arch.mimo_v2 import TINY
from colibri.formats.config_check import config_problems
from colibri.runtime.model import Decoder

HUB_ONLY = ("hybrid_layer_pattern", "moe_layer_freq", "swa_num_key_value_heads", "swa_rope_theta", "sliding_window_size",
            "partial_rotary_factor", "rope_theta", "layernorm_epsilon", "swa_head_dim", "swa_v_head_dim",
            "swa_num_attention_heads", "add_swa_attention_sink_bias", "add_full_attention_sink_bias")


def read(config: dict):
    return normalized_config(ADAPTERS["mimo_v2_flash"], config)


def test_the_hub_config_and_the_one_transformers_saves_read_the_same():
    hub = read(TINY)
    assert hub.sliding_layers == [1, 2] and hub.moe_layers == [1, 2] and hub.sliding_window == 9
    assert (hub.n_kv_heads, hub.sliding_kv_heads, hub.head_dim, hub.v_head_dim, hub.rope_dim) == (1, 2, 96, 64, 32)
    assert (hub.rope_theta, hub.sliding_rope_theta, hub.attn_sinks, hub.sinks_sliding_only) == (5e6, 1e4, True, True)
    saved = {k: v for k, v in TINY.items() if k not in HUB_ONLY}
    saved.update(layer_types=["full_attention", "sliding_attention", "sliding_attention"], sliding_window=9,
                 mlp_layer_types=["dense", "sparse", "sparse"], rms_norm_eps=1e-5,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}})
    assert read(saved) == hub


def test_without_either_spelling_the_layers_are_transformers_defaults():
    config = {k: v for k, v in TINY.items() if k not in ("hybrid_layer_pattern", "moe_layer_freq")}
    c = read({**config, "num_hidden_layers": 12})
    assert c.sliding_layers == [1, 2, 3, 4, 6, 7, 8, 9, 10] and c.moe_layers == list(range(1, 12))
    assert [c.kv_heads_of(i) for i in (0, 1, 5, 11)] == [1, 2, 1, 1]
    assert [c.rope_theta_of(i) for i in (0, 1)] == [5e6, 1e4] and [c.has_sinks(i) for i in (0, 1)] == [False, True]


@pytest.mark.parametrize("change, message", [
    ({"add_full_attention_sink_bias": True}, "add_full_attention_sink_bias"),
    ({"n_shared_experts": 1}, "n_shared_experts 1"),
    ({"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern is not 3 of 0, 1"),
    ({"moe_layer_freq": [0, 2, 1]}, "moe_layer_freq is not 3 of 0, 1"),
    ({"swa_head_dim": 64}, "swa_head_dim 64 differs from head_dim 96"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"swa_num_key_value_heads": 3}, "n_heads 4 is not a multiple of sliding_kv_heads 3"),
    ({"sliding_window_size": None, "sliding_window": None}, "sliding_window None"),
])
def test_what_the_runtime_cannot_compute_is_refused_by_key(change, message):
    with pytest.raises(ConfigError, match=message):
        read({**TINY, **change})


def test_the_sliding_fields_are_checked_on_their_own():
    c = read(TINY)
    assert config_problems(dataclasses.replace(c, value_scale=0.0)) == ["value_scale is 0.0, not a positive number"]
    assert config_problems(dataclasses.replace(c, sinks_sliding_only=True, attn_sinks=False)) == \
        ["sinks_sliding_only without attn_sinks"]
    no_windows = dataclasses.replace(c, sliding_layers=[], sliding_window=0, attn_sinks=False, sinks_sliding_only=False)
    assert config_problems(no_windows) == \
        ["sliding_kv_heads, sliding_rope_theta and sinks_sliding_only need GQA attention with sliding_layers"]


def test_sliding_layers_cache_their_own_heads_for_their_window():
    c = read(TINY)
    shape = Decoder.cache_shape_for(c)
    assert [shape.widths_of(i) for i in range(3)] == [{"k": 96, "v": 64}, {"k": 192, "v": 128}, {"k": 192, "v": 128}]
    assert shape.rows(4096) == [4096, 8 + 512, 8 + 512]  # the window (less its own position) and a prompt chunk's room
    assert shape.nbytes(4096, "f16") == 2 * (4096 * 160 + 2 * 520 * 320)
