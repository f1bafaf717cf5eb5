"""GLM-5-Next: its config as the release writes it, what is refused, what a sequence keeps, the
indexer's choice of pools, and that transformers' logits need both of what is new in it (the
pools and KDA's safe gate). Its logits against transformers and llama.cpp are checked with every
architecture's (tests/test_oracle_runtime.py, tests/test_llama_cpp.py)."""

import dataclasses
import json

import numpy as np
import pytest

from colibri.convert.arch import ADAPTERS, ConfigError, adapter_for
from colibri.convert.arch.base import normalized_config
from colibri.convert.arch.glm5_next import TINY
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.formats.config_check import config_problems
from colibri.runtime import open_model
from colibri.runtime.indexer import _choose_pools
from colibri.runtime.model import Decoder

ARCH = "glm5_next_text"
RELEASE = {  # zai-org/GLM-5-Next's text_config keys at tiny widths: no per-layer lists (transformers' defaults)
    **{k: v for k, v in TINY.items() if k not in ("layer_types", "mlp_layer_types", "indexer_types")},
    "num_hidden_layers": 8, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
}


def read(config: dict):
    return normalized_config(ADAPTERS[ARCH], config)


def test_the_release_schedule_is_transformers_default():
    c = read(RELEASE)
    assert (c.linear_layers, c.index_layers, c.moe_layers) == ([0, 1, 2, 4, 5, 6], [3, 7], [3, 4, 5, 6, 7])
    assert (c.attention, c.qk_rope_head_dim, c.rope_dim, c.head_dim, c.latent_norm_eps) == ("mla", 0, 0, 64, 1e-5)
    assert (c.index_topk, c.index_kpool, c.index_heads, c.index_head_dim) == (8, 4, 16, 64)
    assert (c.hyper_streams, c.hyper_head_mean, c.linear_kind, c.linear_gate_lower_bound) == (4, True, "kda", -5.0)
    assert (c.expert_glu, c.swiglu_limit, c.router, c.routed_scaling_factor) == ("clamped_silu", 10.0, "sigmoid", 2.5)
    assert adapter_for({"model_type": "glm5_next"}) is ADAPTERS[ARCH]  # a flat config under the wrapper's type
    assert config_problems(c) == []


@pytest.mark.parametrize("change, message", [
    ({"qk_rope_head_dim": 64}, "a rotated MLA"),
    ({"linear_attn_config": {**TINY["linear_attn_config"], "gate_lower_bound": None}}, "gate_lower_bound None"),
    ({"index_kpool_always_select_tail": False}, "without the tail"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"layer_types": ["linear_attention"] * 2}, "layer_types is not 5 layer kinds"),
])
def test_what_the_runtime_cannot_compute_is_refused_by_key(change, message):
    with pytest.raises(ConfigError, match=message):
        read({**TINY, **change})


def test_the_new_fields_are_checked_together():
    c = read(TINY)
    assert config_problems(dataclasses.replace(c, index_kpool=3)) == \
        ["index_kpool 3 needs MLA and an index_topk 8 of whole pools of 2 or more"]
    assert config_problems(dataclasses.replace(c, index_layers=[0, 1])) == \
        ["index_layers [0, 1] are not distinct increasing attention layers of the 5, from the first"]
    assert config_problems(dataclasses.replace(c, linear_gate_lower_bound=1.0)) == \
        ["linear_gate_lower_bound is 1.0, not 0 or a negative number (of Kimi delta attention)"]
    assert config_problems(dataclasses.replace(c, hyper_streams=0)) == ["hyper_head_mean without hyper_streams"]


def test_a_sequence_keeps_kda_states_latents_and_the_indexers_pools():
    c = read(TINY)
    shape = Decoder.cache_shape_for(c)
    states = {"conv": (3, 3 * 4 * 256), "recurrent": (4, 256, 256)}
    assert [shape.state(i) for i in range(5)] == [states, {}, {}, states, {}]
    assert shape.rows(4096) == [0, 4096, 4096, 0, 4096]
    # the latent (nothing rotated); an indexer layer's key and gate a position, and one key a pool
    assert [shape.widths_of(i) for i in (1, 2)] == [{"kv": 256, "index_k": 2 * 64}, {"kv": 256}]
    assert [shape.entries_of(i) for i in (1, 2, 4)] == [{"index": (4, 64)}, {}, {"index": (4, 64)}]
    assert shape.nbytes(4096, "f16") == 2 * 4096 * (3 * 256 + 2 * 128) + 2 * 2 * 1024 * 64 + shape.state_bytes()


def chosen_reference(q, pooled, weights, start, pool, select):
    """The spec's choice, query by query in numpy (formats/spec.md, `index_kpool`)."""
    n, rows = q.shape[0], start + q.shape[0]
    out = np.zeros((n, rows), np.uint8)
    for i in range(n):
        end = start + i + 1
        visible = end // pool
        if visible <= select:
            out[i, :end] = 1
            continue
        dots = np.einsum("hd,jd->hj", q[i].astype(np.float64), pooled[:visible].astype(np.float64))
        scores = (weights[i, :, None] * np.maximum(dots / np.sqrt(q.shape[2]), 0)).sum(0)
        for j in sorted(range(visible), key=lambda j: (-scores[j], j))[:select]:
            out[i, j * pool:(j + 1) * pool] = 1
        out[i, visible * pool:end] = 1
    return out


def test_a_query_attends_to_its_best_pools_and_the_positions_after_them():
    rng = np.random.default_rng(5)
    pool, select, start, n, heads, width = 4, 3, 9, 23, 8, 16
    q = rng.standard_normal((n, heads, width)).astype(np.float32)
    pooled = rng.standard_normal(((start + n) // pool, width)).astype(np.float32)
    pooled[5] = pooled[2]  # a tie: the earlier pool wins
    weights = rng.standard_normal((n, heads)).astype(np.float32)
    chosen = np.zeros((n, start + n), np.uint8)
    _choose_pools(q, pooled, weights, start, pool, select, chosen, 2)
    want = chosen_reference(q, pooled, weights, start, pool, select)
    np.testing.assert_array_equal(chosen, want)
    assert (chosen.sum(1) < np.arange(start + 1, start + n + 1)).any()  # some queries leave positions out
    assert all(chosen[i, start + i] == ((start + i + 1) % pool != 0 or chosen[i, start + i]) for i in range(n))


@pytest.fixture(scope="module")
def transformers_model(tmp_path_factory):
    from oracle_models import build_with_transformers, load_reference, oracle_available

    available, reason = oracle_available()
    if not available:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("glm5-next")
    src = build_with_transformers(root / "src", ARCH)
    convert(str(src), root / "f32", ConvertOptions(quant="F32", progress=False))
    return load_reference(src), root / "f32"


@pytest.mark.oracle
def test_transformers_logits_need_the_pools_and_the_safe_gate(transformers_model, monkeypatch):
    """Ours match transformers' on a prompt past the dense rows; attending to every position,
    or decaying as Kimi-Linear does, moves them far beyond that."""
    import torch

    from colibri.runtime.indexer import PoolIndexer

    reference, path = transformers_model
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 512, 33)]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].float().numpy()
    model = open_model(path, ctx=64, kv_quant="f32", ram_budget="8G")
    tolerance = 1e-4 * want.std()
    assert np.abs(model.prefill(ids) - want).max() <= tolerance
    sparse = slice(TINY["index_topk"] + TINY["index_kpool"] - 1, None)  # the rows past the dense ones
    with monkeypatch.context() as patch:
        patch.setattr(PoolIndexer, "sees_all", lambda self, end: True)
        model.reset()
        assert np.abs(model.prefill(ids) - want)[sparse].max() > 100 * tolerance
    model.config.linear_gate_lower_bound = 0.0  # exp(A softplus(...)), Kimi-Linear's decay
    model.reset()
    assert np.abs(model.prefill(ids) - want).max() > 100 * tolerance


def test_the_releases_fp8_and_mtp_layer_convert(tmp_path):
    """FP8 weights with block scales, as the release stores its projections and experts, convert
    to what the same checkpoint in BF16 gives within e4m3's rounding; the MTP layer after the
    decoder layers is skipped and counted."""
    config = {**TINY, "num_nextn_predict_layers": 1}
    bf16 = write_checkpoint(tmp_path / "bf16", ARCH, config=config)
    fp8 = write_checkpoint(tmp_path / "fp8", ARCH, config=config, dtype="fp8")
    def names(src):
        return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]

    assert "model.layers.5.mlp.gate.weight" in names(bf16)  # the synthetic MTP layer is a decoder layer
    assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in names(fp8)
    logits = {}
    for name, src in (("bf16", bf16), ("fp8", fp8)):
        convert(str(src), tmp_path / f"out-{name}", ConvertOptions(quant="F32", progress=False))
        stored = json.loads((tmp_path / f"out-{name}" / "colibri.json").read_text())["config"]
        assert (stored["n_layers"], stored["mtp_layers_skipped"]) == (5, 1)
        logits[name] = open_model(tmp_path / f"out-{name}", ctx=64, kv_quant="f32", ram_budget="8G").prefill(list(range(3, 20)))
    cos = (logits["fp8"] * logits["bf16"]).sum(-1) / np.linalg.norm(logits["fp8"], axis=-1) / np.linalg.norm(logits["bf16"], axis=-1)
    assert np.median(cos) > 0.95 and not np.array_equal(logits["fp8"], logits["bf16"])
