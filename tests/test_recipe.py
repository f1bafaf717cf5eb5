"""The Q4_K_M recipe chooses llama.cpp's type for every tensor."""

import pytest

from colibri.formats.recipe import Recipe, parse_override, use_more_bits


def types(recipe, names_shapes):
    return {n: recipe.encoding(n, s) for n, s in names_shapes}


def test_use_more_bits_matches_llama_cpp_formula():
    # n = 32: first 4, last 4, and every third layer from 4 + 2
    chosen = [i for i in range(32) if use_more_bits(i, 32)]
    assert chosen == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


@pytest.mark.parametrize("n_layers", [4, 16, 61])
def test_q4_k_m_per_tensor_types(n_layers):
    r = Recipe("Q4_K_M", n_layers=n_layers, n_experts=64, tied_embeddings=False)
    for i in range(n_layers):
        more = use_more_bits(i, n_layers)
        assert r.encoding(f"blk.{i}.attn_v.weight", (512, 2048)) == ("Q6_K" if more else "Q4_K")
        assert r.encoding(f"blk.{i}.attn_kv_b.weight", (512, 512)) == ("Q6_K" if more else "Q4_K")
        for down in ("ffn_down_exps", "ffn_down_shexp", "ffn_down"):
            assert r.encoding(f"blk.{i}.{down}.weight", (2048, 1024)) == ("Q6_K" if more else "Q4_K")
        for plain in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps", "attn_q_b", "ffn_gate_inp_shexp"):
            assert r.encoding(f"blk.{i}.{plain}.weight", (512, 2048)) == "Q4_K"
        assert r.encoding(f"blk.{i}.ffn_gate_inp.weight", (64, 2048)) == "F32"
        assert r.encoding(f"blk.{i}.attn_norm.weight", (2048,)) == "F32"
        assert r.encoding(f"blk.{i}.attn_q.bias", (2048,)) == "F32"
        assert r.encoding(f"blk.{i}.exp_probs_b.bias", (64,)) == "F32"
    assert r.encoding("output.weight", (32000, 2048)) == "Q6_K"
    assert r.encoding("token_embd.weight", (32000, 2048)) == "Q4_K"


def test_tied_embeddings_get_the_output_type():
    r = Recipe("Q4_K_M", n_layers=4, n_experts=64, tied_embeddings=True)
    assert r.encoding("token_embd.weight", (32000, 2048)) == "Q6_K"


def test_eight_experts_rules_mixtral():
    r = Recipe("Q4_K_M", n_layers=32, n_experts=8, tied_embeddings=False)
    for i in (0, 5, 31):
        assert r.encoding(f"blk.{i}.attn_v.weight", (1024, 4096)) == "Q8_0"
        assert r.encoding(f"blk.{i}.attn_k.weight", (1024, 4096)) == "Q8_0"
        assert r.encoding(f"blk.{i}.attn_output.weight", (4096, 4096)) == "Q5_K"
        assert r.encoding(f"blk.{i}.attn_q.weight", (4096, 4096)) == "Q4_K"


def test_row_length_fallbacks():
    r = Recipe("Q4_K_M", n_layers=32, n_experts=64, tied_embeddings=False)
    assert r.encoding("blk.5.ffn_gate_exps.weight", (128, 96)) == "Q5_0"  # Q4_K → Q5_0
    assert r.encoding("blk.0.ffn_down_exps.weight", (128, 96)) == "Q8_0"  # Q6_K → Q8_0
    assert r.encoding("blk.5.ffn_gate_exps.weight", (128, 100)) == "F16"  # not a multiple of 32
    assert r.encoding("output.weight", (1000, 96)) == "Q8_0"
    r8 = Recipe("Q4_K_M", n_layers=32, n_experts=8, tied_embeddings=False)
    assert r8.encoding("blk.5.attn_output.weight", (128, 96)) == "Q5_1"  # Q5_K → Q5_1


def test_other_recipes():
    shapes = [("blk.0.attn_q.weight", (256, 256)), ("blk.0.attn_norm.weight", (256,)), ("blk.0.ffn_gate_inp.weight", (8, 256)), ("output.weight", (512, 256))]
    assert set(types(Recipe("Q8_0", 4, 8, False), shapes).values()) == {"Q8_0", "F32"}
    assert types(Recipe("Q8_0", 4, 8, False), shapes)["output.weight"] == "Q8_0"
    assert types(Recipe("BF16", 4, 8, False), shapes) == {
        "blk.0.attn_q.weight": "BF16", "blk.0.attn_norm.weight": "F32", "blk.0.ffn_gate_inp.weight": "F32", "output.weight": "BF16"}
    assert set(types(Recipe("F32", 4, 8, False), shapes).values()) == {"F32"}
    assert Recipe("F16", 4, 8, False).encoding("blk.0.attn_q.weight", (256, 256)) == "F16"


def test_overrides_first_match_wins_and_are_checked():
    overrides = [parse_override("ffn_down_exps=Q8_0"), parse_override(r"blk\.1\..*=Q5_K")]
    r = Recipe("Q4_K_M", n_layers=16, n_experts=64, tied_embeddings=False, overrides=overrides)
    assert r.encoding("blk.1.ffn_down_exps.weight", (256, 512)) == "Q8_0"
    assert r.encoding("blk.1.ffn_up_exps.weight", (512, 256)) == "Q5_K"
    assert r.encoding("blk.1.attn_norm.weight", (256,)) == "F32"  # never quantized
    q8 = Recipe("Q8_0", 16, 64, False, overrides=[parse_override("attn_q=Q4_K")])
    with pytest.raises(ValueError, match="multiple"):
        q8.encoding("blk.1.attn_q.weight", (256, 288))  # Q8_0 fits 288, the Q4_K override does not
    bad = Recipe("Q4_K_M", 16, 64, False, overrides=[parse_override("attn_q=Q6_K")])
    assert bad.encoding("blk.1.attn_q.weight", (256, 288)) == "Q5_0"  # fallback tensors ignore overrides (llama.cpp)
    with pytest.raises(ValueError, match="REGEX=TYPE"):
        parse_override("no-equals-sign")
    with pytest.raises(ValueError, match="unknown type"):
        parse_override("attn=Q9_9")
    assert parse_override("attn=iq2_xxs") == ("attn", "IQ2_XXS")  # the grid types are made too
    with pytest.raises(ValueError, match="bad regex"):
        parse_override("attn[=Q8_0")


def moe_tensors(n_layers=32):
    """A Mixtral-like listing: attention, experts, shared expert, output."""
    listing = [("token_embd.weight", (32000, 4096)), ("output.weight", (32000, 4096))]
    for i in range(n_layers):
        p = f"blk.{i}."
        listing += [(p + "attn_q.weight", (4096, 4096)), (p + "attn_k.weight", (1024, 4096)),
                    (p + "attn_v.weight", (1024, 4096)), (p + "attn_output.weight", (4096, 4096)),
                    (p + "ffn_gate_exps.weight", (8, 14336, 4096)), (p + "ffn_up_exps.weight", (8, 14336, 4096)),
                    (p + "ffn_down_exps.weight", (8, 4096, 14336)), (p + "ffn_gate_inp.weight", (8, 4096))]
    return listing


def test_llama_quantize_mixes_choose_llama_cpps_types():
    """Each mix as llama_tensor_get_type_impl chooses it (llama.cpp b0c1e570), on a 32-layer
    model with 64 experts and GQA 4, and with 8 experts (Mixtral's special cases)."""
    listing = moe_tensors()

    def chosen(mix, experts=64, gqa=4):
        return types(Recipe(mix, 32, experts, False, n_gqa=gqa), listing)

    q2 = chosen("Q2_K")
    assert q2["blk.5.ffn_gate_exps.weight"] == "Q2_K" and q2["blk.5.ffn_down_exps.weight"] == "Q3_K"
    assert q2["blk.5.attn_v.weight"] == "Q4_K" and chosen("Q2_K", gqa=1)["blk.5.attn_v.weight"] == "Q3_K"
    assert q2["blk.5.attn_output.weight"] == "Q3_K" and q2["output.weight"] == "Q6_K" and q2["token_embd.weight"] == "Q2_K"
    q2s = chosen("Q2_K_S")
    assert (q2s["blk.3.ffn_down_exps.weight"], q2s["blk.4.ffn_down_exps.weight"]) == ("Q4_K", "Q2_K")
    q3m = chosen("Q3_K_M")
    assert [q3m[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert (q3m["blk.1.ffn_down_exps.weight"], q3m["blk.2.ffn_down_exps.weight"]) == ("Q5_K", "Q4_K")
    assert q3m["blk.9.attn_output.weight"] == "Q4_K" and q3m["blk.9.ffn_up_exps.weight"] == "Q3_K"
    q3l = chosen("Q3_K_L")
    assert q3l["blk.9.attn_v.weight"] == q3l["blk.9.ffn_down_exps.weight"] == q3l["blk.9.attn_output.weight"] == "Q5_K"
    assert chosen("Q3_K_S")["blk.9.attn_v.weight"] == "Q3_K"
    q4s = chosen("Q4_K_S")
    assert (q4s["blk.3.attn_v.weight"], q4s["blk.4.attn_v.weight"]) == ("Q5_K", "Q4_K")
    assert (q4s["blk.3.ffn_down_exps.weight"], q4s["blk.4.ffn_down_exps.weight"]) == ("Q5_K", "Q4_K")
    q5m = chosen("Q5_K_M")
    assert [q5m[f"blk.{i}.ffn_down_exps.weight"] for i in (3, 4, 6)] == ["Q6_K", "Q5_K", "Q6_K"]  # use_more_bits
    assert set(chosen("Q6_K").values()) == {"Q6_K", "F32"}
    q4_0 = chosen("Q4_0")
    assert q4_0["output.weight"] == "Q6_K" and q4_0["blk.0.ffn_down_exps.weight"] == "Q4_0"
    eight = chosen("Q3_K_M", experts=8)
    assert eight["blk.9.attn_v.weight"] == eight["blk.9.attn_k.weight"] == "Q8_0"
    assert eight["blk.9.attn_output.weight"] == "Q5_K" and chosen("Q3_K_L", experts=8)["blk.9.attn_output.weight"] == "Q3_K"
    assert all(chosen(m)["blk.0.ffn_gate_inp.weight"] == "F32" for m in ("Q2_K", "Q5_K_S", "Q4_1"))


def test_a_mix_on_rows_that_do_not_fill_super_blocks_falls_back_as_llama_cpp():
    r = Recipe("Q2_K", 4, 64, False)
    assert r.encoding("blk.0.ffn_gate_exps.weight", (64, 96, 288)) == "Q4_0"  # 288 weights: not 256-blocks
    assert r.encoding("blk.0.ffn_down_exps.weight", (64, 288, 96)) == "Q4_0"  # Q3_K → Q4_0 too
    assert r.encoding("blk.0.attn_q.weight", (288, 100)) == "F16"  # no 32-block either


def test_iq4_mxfp4_and_ternary_mixes_choose_llama_cpps_types():
    """IQ4_NL / IQ4_XS (attn_v up with GQA >= 4, the first n/8 ffn_down layers up without an
    imatrix, 8-expert rules), MXFP4_MOE (routed experts MXFP4, all else Q8_0) and the ternary
    mixes (token embeddings Q4_K), as llama_tensor_get_type_impl chooses them."""
    listing = moe_tensors()

    def chosen(mix, experts=64, gqa=4, imatrix=False):
        return types(Recipe(mix, 32, experts, False, n_gqa=gqa, has_imatrix=imatrix), listing)

    for mix in ("IQ4_NL", "IQ4_XS"):
        plain = chosen(mix)
        assert plain["blk.9.attn_v.weight"] == "Q5_K" and chosen(mix, gqa=2)["blk.9.attn_v.weight"] == mix
        assert (plain["blk.3.ffn_down_exps.weight"], plain["blk.4.ffn_down_exps.weight"]) == ("Q5_K", mix)
        assert chosen(mix, imatrix=True)["blk.3.ffn_down_exps.weight"] == mix
        assert plain["blk.9.ffn_up_exps.weight"] == plain["blk.9.attn_output.weight"] == mix
        assert plain["output.weight"] == "Q6_K" and plain["token_embd.weight"] == mix
        eight = chosen(mix, experts=8)
        assert eight["blk.9.attn_v.weight"] == eight["blk.9.attn_k.weight"] == "Q8_0"
        assert eight["blk.9.attn_output.weight"] == "Q5_K"
    mxfp4 = chosen("MXFP4_MOE")
    assert {mxfp4[f"blk.9.ffn_{m}_exps.weight"] for m in ("gate", "up", "down")} == {"MXFP4"}
    assert {mxfp4[n] for n in ("blk.9.attn_v.weight", "blk.9.attn_q.weight", "output.weight", "token_embd.weight")} == {"Q8_0"}
    for mix in ("TQ1_0", "TQ2_0"):
        ternary = chosen(mix)
        assert ternary["token_embd.weight"] == "Q4_K" and ternary["output.weight"] == "Q6_K"
        assert ternary["blk.9.ffn_down_exps.weight"] == ternary["blk.9.attn_q.weight"] == mix
    r = Recipe("IQ4_XS", 4, 64, False)
    assert r.encoding("blk.0.ffn_gate_exps.weight", (64, 96, 288)) == "IQ4_NL"  # not 256-blocks
    assert Recipe("TQ1_0", 4, 64, False).encoding("blk.0.ffn_gate_exps.weight", (64, 96, 288)) == "Q4_0"


def test_the_manifest_schema_knows_every_recipe_and_encoding():
    import json
    from pathlib import Path

    from colibri.formats.encodings import ENCODINGS
    from colibri.formats.recipe import RECIPES

    schema = json.loads((Path(__file__).parents[1] / "formats" / "manifest.schema.json").read_text())
    assert schema["properties"]["quant"]["properties"]["recipe"]["enum"] == [*RECIPES, "GGUF"]
    assert schema["$defs"]["encoding"]["enum"] == list(ENCODINGS)


def test_an_unknown_recipe_is_refused_listing_them(capsys):
    from colibri.cli import convert_main

    with pytest.raises(SystemExit):
        convert_main(["src", "out", "--quant", "Q9_K"])
    err = capsys.readouterr().err
    assert "'Q9_K' is not a recipe (choose from Q2_K" in err and "IQ2_XXS" in err


def test_llama_cpp_counts_tensors_by_layer_then_name():
    from colibri.formats.recipe import counted_positions

    names = [f"blk.{i}.{part}" for i in (10, 2, 0, 1, 9) for part in ("ffn_down_shexp.weight", "ffn_down_exps.weight",
                                                                      "attn_kv_b.weight", "attn_q_b.weight")]
    places = counted_positions(names)
    assert [places[f"blk.{i}.attn_kv_b.weight"] for i in (0, 1, 2, 9, 10)] == [0, 1, 2, 3, 4]  # 10 after 9, not after 1
    assert places["blk.2.ffn_down_exps.weight"] == 4 and places["blk.2.ffn_down_shexp.weight"] == 5
    assert "blk.0.attn_q_b.weight" not in places


def test_the_low_bit_mixes_count_ffn_down_tensors_against_the_layers():
    """In IQ1/IQ2 mixes llama.cpp bumps the first n_layer/8 ffn_down tensors, counting a layer's
    routed and shared experts apart: with 16 layers, the first two tensors, both in layer 0."""
    from types import SimpleNamespace

    config = SimpleNamespace(n_layers=16, n_experts=16, tie_word_embeddings=False, n_heads=8, n_kv_heads=8,
                             architecture="qwen3_moe")
    names = [f"blk.{i}.ffn_down_{kind}.weight" for i in range(16) for kind in ("exps", "shexp")]
    recipe = Recipe.for_model("IQ2_XXS", config, names)
    down = {n: recipe.encoding(n, (256, 256)) for n in names}
    assert [n for n, e in down.items() if e == "Q2_K"] == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_down_shexp.weight"]
    assert down["blk.1.ffn_down_exps.weight"] == "IQ2_XXS"
    assert recipe.encoding("output.weight", (1000, 256)) == "Q5_K" and recipe.encoding("token_embd.weight", (1000, 256)) == "Q2_K"
    assert recipe.encoding("blk.3.attn_kv_b.weight", (256, 256)) == "Q4_K"  # 16 experts
    assert recipe.encoding("blk.3.ffn_up_exps.weight", (256, 288)) == "IQ4_NL"  # rows of 288: llama.cpp's fallback
    assert recipe.needs_imatrix("blk.3.ffn_up_exps.weight", "IQ2_XXS") and not recipe.needs_imatrix("output.weight", "Q5_K")
