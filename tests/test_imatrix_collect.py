"""`colibri imatrix`: the importance matrix of our runtime, as llama-imatrix collects it."""

import random

import gguf
import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.imatrix import Imatrix
from colibri.convert.plan import make_plan
from colibri.convert.quantize_q4k import dequantize, quantize
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout
from colibri.formats.recipe import MIXES
from colibri.cli.imatrix_command import read_chunks
from colibri.runtime import open_model
from colibri.runtime.model import MoE

CHUNK, CHUNKS = 32, 3


@pytest.fixture
def collected(checkpoint, tmp_path):
    """(checkpoint, Q8_0 model, text file, the imatrix `colibri imatrix` wrote for it)."""
    src = checkpoint("qwen3_moe", dtype="f32")
    convert(str(src), tmp_path / "m", ConvertOptions(quant="Q8_0", progress=False))
    words = "the river town woke slowly and bread bells rang over old roads at dawn".split()
    random.seed(0)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(random.choice(words) for _ in range(400)))
    out = tmp_path / "imatrix.gguf"
    assert main(["imatrix", str(tmp_path / "m"), "--text", str(text), "-o", str(out), "--chunk", str(CHUNK),
                 "--chunks", str(CHUNKS), "--no-progress"]) == 0
    return src, tmp_path / "m", text, out


def read_entries(path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    fields = {name: reader.fields[name].contents() for name in ("general.type", "imatrix.datasets",
                                                                "imatrix.chunk_count", "imatrix.chunk_size")}
    names = {n.removesuffix(".in_sum2") for n in tensors if n.endswith(".in_sum2")}
    return fields, {n: (tensors[n + ".in_sum2"], tensors[n + ".counts"][:, 0]) for n in names}


def test_sums_are_the_squares_of_what_each_matrix_multiplies(collected):
    """Read back by gguf, each entry equals a numpy reference from the activations the same
    chunks feed each matrix: every attention and router matrix over all tokens, each expert's
    gate and up over the rows routed to it, and its down over the SwiGLU of those rows."""
    _, model_dir, text, out = collected
    fields, entries = read_entries(out)
    assert fields == {"general.type": "imatrix", "imatrix.datasets": [text.name], "imatrix.chunk_count": CHUNKS,
                      "imatrix.chunk_size": CHUNK}
    model = open_model(model_dir, ctx=CHUNK, ram_budget="8G")
    seen, routed = {}, []
    for name, matrix in model.decoder.weights.matrices.items():
        if name.startswith("blk."):
            matrix.observe = lambda x, name=name: seen.setdefault(name, []).append(x.astype(np.float64))
    for *_, ffn in model.decoder.layers:
        if isinstance(ffn, MoE):
            ffn.observe = lambda moe, h, ids: routed.append((moe.layer, h.astype(np.float64), ids.copy()))
    for ids in read_chunks(model.tokenizer, text, CHUNK, CHUNKS):
        model.reset()
        model.prefill(ids)
    layout = ModelLayout(model_dir)
    expert_names = {f"blk.{layer}.ffn_{m}_exps.weight" for layer in layout.expert_layers for m in ("gate", "up", "down")}
    assert set(entries) == set(seen) | expert_names
    for name, xs in seen.items():
        x = np.concatenate(xs)
        sums, counts = entries[name]
        assert counts.tolist() == [len(x)] == [CHUNK * CHUNKS]
        np.testing.assert_allclose(sums[0], (x * x).sum(0), rtol=1e-5)
    for p in ("blk.0.attn_", "blk.1.attn_"):  # q, k and v multiply the same input
        assert np.array_equal(entries[p + "q.weight"][0], entries[p + "k.weight"][0])
        assert np.array_equal(entries[p + "q.weight"][0], entries[p + "v.weight"][0])
    for layer, table in layout.expert_layers.items():
        h = np.concatenate([h for seen_layer, h, _ in routed if seen_layer == layer])
        ids = np.concatenate([ids for seen_layer, _, ids in routed if seen_layer == layer])
        gate_sums, gate_counts = entries[f"blk.{layer}.ffn_gate_exps.weight"]
        down_sums, down_counts = entries[f"blk.{layer}.ffn_down_exps.weight"]
        assert gate_sums.shape == (table.count, h.shape[1]) and gate_counts.sum() == ids.size
        for expert in range(table.count):
            x = h[(ids == expert).any(axis=1)]
            assert gate_counts[expert] == down_counts[expert] == len(x)
            np.testing.assert_allclose(gate_sums[expert], (x * x).sum(0), rtol=1e-5)
            np.testing.assert_array_equal(entries[f"blk.{layer}.ffn_up_exps.weight"][0][expert], gate_sums[expert])
            weights = {m: dequantize(layout.expert_matrix_data(layer, expert, m).reshape(info.shape[0], -1),
                                     info.encoding, info.shape[1]).astype(np.float64)
                       for m, info in table.matrices.items()}
            g, u = x @ weights["gate"].T, x @ weights["up"].T
            a = g / (1 + np.exp(-g)) * u  # the SwiGLU the down projection multiplies, in float64
            np.testing.assert_allclose(down_sums[expert], (a * a).sum(0), rtol=5e-2, atol=1e-3 * (a * a).sum(0).max())
    model.close()


def test_a_conversion_with_it_quantizes_as_ggml_with_that_imatrix(collected, tmp_path):
    src, _, _, out = collected
    convert(str(src), tmp_path / "with", ConvertOptions(quant="IQ4_XS", imatrix=out, progress=False))
    convert(str(src), tmp_path / "without", ConvertOptions(quant="IQ4_XS", progress=False))
    layout, plain = ModelLayout(tmp_path / "with"), ModelLayout(tmp_path / "without")
    _, entries = read_entries(out)
    name = "blk.1.attn_output.weight"
    sums, counts = entries[name]
    weights = Checkpoint(src).read(next(t.source for t in make_plan(Checkpoint(src)).resident if t.name == name))
    want = quantize(weights, layout.tensors[name].encoding, sums[0].astype(np.float32) / np.float32(counts[0]))
    assert np.array_equal(layout.tensor_data(name), want.reshape(-1))
    assert not np.array_equal(layout.tensor_data(name), plain.tensor_data(name))
    assert Imatrix(out).importance(name, sums.shape[1]) is not None
    record = layout.manifest["quant"]["imatrix"]
    assert record.startswith("imatrix.gguf sha256=") and record.endswith(" text=calibration.txt")


@pytest.mark.parametrize("mix", ["IQ2_XXS", "IQ1_M", "IQ3_XXS"])
def test_a_grid_mix_needs_it_and_then_converts_verifies_and_runs(collected, tmp_path, capsys, mix):
    """llama-quantize quantizes the grid types only with an importance matrix: without one the
    mix is refused before anything is written; with ours it converts, verifies and runs."""
    from colibri.convert.pipeline import ConvertError

    src, _, _, out = collected
    with pytest.raises(ConvertError, match=f"--quant {mix} needs --imatrix FILE"):
        convert(str(src), tmp_path / "plain", ConvertOptions(quant=mix, progress=False))
    assert not (tmp_path / "plain").exists()
    convert(str(src), tmp_path / "grid", ConvertOptions(quant=mix, imatrix=out, progress=False))
    layout = ModelLayout(tmp_path / "grid")
    assert {t.matrices["gate"].encoding for t in layout.expert_layers.values()} == {MIXES[mix]}
    assert main(["verify", str(tmp_path / "grid")]) == 0  # its types are the recipe's, its bytes intact
    logits = open_model(tmp_path / "grid", ctx=16, ram_budget="8G").prefill([5, 17, 33, 2])
    assert np.isfinite(logits).all()


def test_unusable_text_is_one_line_naming_it(collected, tmp_path, capsys):
    _, model_dir, _, _ = collected
    short = tmp_path / "short.txt"
    short.write_text("the river")
    assert main(["imatrix", str(model_dir), "--text", str(short), "-o", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "short.txt" in err and "fewer than one chunk of --chunk 512" in err and "\n" not in err
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    assert main(["imatrix", str(model_dir), "--text", str(tmp_path / "bad.txt"), "-o", str(tmp_path / "x.gguf")]) == 1
    assert "bad.txt: cannot read as UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def imatrix_of(checkpoint, arch, tmp_path):
    """(the F32 checkpoint of `arch`, `colibri imatrix` of its Q8_0 conversion (folder `m`) over
    a short text, that file's entries)."""
    src = checkpoint(arch, dtype="f32")
    convert(str(src), tmp_path / "m", ConvertOptions(quant="Q8_0", progress=False))
    (tmp_path / "text.txt").write_text(" ".join(["the river town woke slowly at dawn"] * 40))
    out = tmp_path / "imatrix.gguf"
    assert main(["imatrix", str(tmp_path / "m"), "--text", str(tmp_path / "text.txt"), "-o", str(out), "--chunk",
                 str(CHUNK), "--chunks", "2", "--no-progress"]) == 0
    return src, out, read_entries(out)[1]


def test_mla_s_kv_b_gets_its_entry_though_absorbed_it_never_runs_as_a_product(checkpoint, tmp_path):
    """MLA multiplies kv_b into the queries and the context, never the latent; its entry is the
    normalized latent every token stores, so the grid mixes that type kv_b can be made from ours."""
    src, out, entries = imatrix_of(checkpoint, "deepseek_v3", tmp_path)
    sums, counts = entries["blk.0.attn_kv_b.weight"]
    assert counts.tolist() == entries["blk.0.attn_kv_a_mqa.weight"][1].tolist() and counts[0] > 0
    assert sums.shape[-1] == ModelLayout(tmp_path / "m").config.kv_lora_rank and (sums > 0).all()
    convert(str(src), tmp_path / "grid", ConvertOptions(quant="IQ3_XXS", imatrix=out, progress=False))


def test_deepseek_v4_s_grouped_output_and_head_mixing_get_entries(checkpoint, tmp_path):
    """DeepSeek-V4's attn_output_a runs per group of heads and its head's mixing outside the
    layers; both get entries (the groups pooled), so its low-bit mixes can be made from ours."""
    src, out, entries = imatrix_of(checkpoint, "deepseek_v4", tmp_path)
    c = ModelLayout(tmp_path / "m").config
    tokens = entries["blk.1.attn_q_a.weight"][1][0]
    sums, counts = entries["blk.1.attn_output_a.weight"]
    assert counts[0] == c.output_groups * tokens and sums.shape[-1] == c.n_heads * c.head_dim // c.output_groups
    assert entries["output_hc_fn.weight"][1][0] == tokens and (entries["output_hc_fn.weight"][0] > 0).all()
    assert "blk.1.attn_compressor_ape.weight" not in entries  # added to logits, no product
    convert(str(src), tmp_path / "grid", ConvertOptions(quant="IQ2_XXS", imatrix=out, progress=False))
    assert ModelLayout(tmp_path / "grid").tensors["blk.1.attn_output_a.weight"].encoding == "IQ2_XXS"
