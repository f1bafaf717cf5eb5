"""formats.config_check: the one validation of a normalized config and its tensors that the
converter, verify and open_model share."""

import dataclasses

import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES, write_checkpoint
from colibri.formats.config_check import config_problems, expected_tensors, tensor_problems
from colibri.formats.layout import ModelLayout


def stored_shapes(layout: ModelLayout):
    shapes = {name: t.shape for name, t in layout.tensors.items()}
    experts = {layer: {m: x.shape for m, x in table.matrices.items()} for layer, table in layout.expert_layers.items()}
    return shapes, experts


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    out = {}
    for arch in ARCHITECTURES:
        src = write_checkpoint(root / f"{arch}-src", arch)
        convert(str(src), root / arch, ConvertOptions(quant="F32", progress=False))
        out[arch] = ModelLayout(root / arch)
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_stores_exactly_what_its_config_implies(layouts, arch):
    layout = layouts[arch]
    assert config_problems(layout.config) == []
    shapes, experts = stored_shapes(layout)
    assert tensor_problems(layout.config, shapes, experts) == []
    assert set(expected_tensors(layout.config)) == set(shapes)


BAD_FIELDS = [
    ("rope_dim", "twice the head"), ("rope_dim", -2), ("rope_dim", 3), ("hidden_size", 0), ("n_kv_heads", 3),
    ("head_dim", 10**30), ("vocab_size", True), ("n_layers", 2.0), ("norm_eps", -1.0), ("norm_eps", float("nan")),
    ("rope_theta", 0.0), ("hidden_act", "gelu"), ("attention", "sliding"), ("qk_norm", "layer"),
    ("router", "relu"), ("n_experts_used", 0), ("n_experts_used", 10**6), ("moe_layers", [0, 0]),
    ("moe_layers", [-1]), ("moe_layers", [10**6]), ("router_groups", 3), ("router_topk_groups", 0),
    ("rope_scaling", {"rope_type": "longrope"}), ("rope_scaling", {"type": "yarn", "factor": "x"}),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}), ("rope_scaling", [1]), ("clip_qkv", -1.0),
    ("eos_token_ids", [10**9]), ("bos_token_id", -1), ("tie_word_embeddings", "no"), ("routed_scaling_factor", 0.0),
    ("max_position_embeddings", 0),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
def test_a_bad_field_is_named(layouts, field, value):
    config = layouts["qwen3_moe"].config
    value = 2 * config.head_dim if value == "twice the head" else value
    config = dataclasses.replace(config, **{field: value})
    problems = config_problems(config)
    assert problems and field.split("_")[0] in " ".join(problems), problems


LINEAR_BAD_FIELDS = [
    ("linear_layers", [5]), ("linear_layers", [0, 0]), ("linear_v_heads", 3), ("linear_k_heads", 0),
    ("linear_conv_kernel", 10**6), ("linear_v_head_dim", -1), ("linear_v_tiled", "yes"), ("attn_output_gate", 1),
]


@pytest.mark.parametrize("field, value", LINEAR_BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in LINEAR_BAD_FIELDS])
def test_a_bad_deltanet_field_is_named(layouts, field, value):
    """A hybrid model's fields size its states and index its heads: each is checked."""
    config = dataclasses.replace(layouts["qwen3_next"].config, **{field: value})
    problems = config_problems(config)
    assert problems and field in " ".join(problems), problems


def test_gated_attention_with_biases_is_refused(layouts):
    config = dataclasses.replace(layouts["qwen3_next"].config, attn_bias=True)
    assert any("attn_output_gate" in p for p in config_problems(config))


def test_shapes_that_contradict_the_config(layouts):
    layout = layouts["deepseek_v3"]
    shapes, experts = stored_shapes(layout)
    wrong = dict(shapes)
    wrong["blk.1.attn_kv_b.weight"] = (1, 1)
    del wrong["output_norm.weight"]
    problems = tensor_problems(layout.config, wrong, experts)
    assert any("misshapen" in p and "blk.1.attn_kv_b.weight" in p for p in problems)
    assert any("lacks tensor output_norm.weight" in p for p in problems)
    layer = next(iter(experts))
    bent = {**experts, layer: {**experts[layer], "down": (1, 2)}}
    assert any(f"layer {layer} experts" in p for p in tensor_problems(layout.config, shapes, bent))
    assert any("expert layers" in p for p in tensor_problems(layout.config, shapes, {}))
