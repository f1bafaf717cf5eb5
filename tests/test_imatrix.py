"""`colibri-convert --imatrix FILE`: llama-imatrix's GGUF weights ggml's quantizers, as llama-quantize does."""

import gguf
import numpy as np
import pytest

from colibri.cli import convert_main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.imatrix import Imatrix
from colibri.convert.plan import make_plan
from colibri.convert.quantize_q4k import quantize
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout


def write_imatrix(path, entries, counts=7.0, kind="imatrix"):
    """An importance-matrix GGUF as llama-imatrix writes it: NAME.in_sum2 [matrices, row]
    and NAME.counts [matrices, 1], F32, names sorted."""
    writer = gguf.GGUFWriter(path, arch=None)
    writer.add_string("general.type", kind)
    writer.add_array("imatrix.datasets", ["test.txt"])
    writer.add_uint32("imatrix.chunk_count", 4)
    writer.add_uint32("imatrix.chunk_size", 512)
    for name in sorted(entries):
        sums = entries[name]
        writer.add_tensor(name + ".in_sum2", sums.astype(np.float32))
        writer.add_tensor(name + ".counts", np.full((sums.shape[0], 1), counts, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def importance(sums, counts=7.0):
    """llama-quantize's importance of a column: the float32 sum over the float32 count."""
    return sums.astype(np.float32) / np.float32(counts)


@pytest.fixture
def source(checkpoint, tmp_path):
    """(checkpoint folder, its plan, an imatrix GGUF covering every quantized tensor)."""
    src = checkpoint("qwen3_moe", dtype="f32")
    plan = make_plan(Checkpoint(src))
    rng = np.random.default_rng(0)
    entries = {t.name: rng.uniform(0.1, 5.0, (1, t.shape[-1])) for t in plan.resident if len(t.shape) == 2}
    for layer in plan.expert_layers:
        for m, name in layer.canonical.items():
            entries[name] = rng.uniform(0.1, 5.0, (layer.count, layer.shapes[m][1]))
    return src, plan, write_imatrix(tmp_path / "imatrix.gguf", entries), entries


def test_the_imatrix_weights_every_tensor_as_llama_quantize(source, tmp_path):
    src, plan, imatrix_file, entries = source
    convert(str(src), tmp_path / "with", ConvertOptions(quant="Q3_K_M", imatrix=imatrix_file, progress=False))
    convert(str(src), tmp_path / "without", ConvertOptions(quant="Q3_K_M", progress=False))
    layout, plain = ModelLayout(tmp_path / "with"), ModelLayout(tmp_path / "without")
    assert layout.manifest["quant"]["imatrix"].startswith("imatrix.gguf sha256=")
    ckpt = Checkpoint(src)
    attn_q = next(t for t in plan.resident if t.name == "blk.0.attn_q.weight")
    want = quantize(ckpt.read(attn_q.source), layout.tensors[attn_q.name].encoding, importance(entries[attn_q.name][0]))
    assert np.array_equal(layout.tensor_data(attn_q.name), want.reshape(-1))
    assert not np.array_equal(layout.tensor_data(attn_q.name), plain.tensor_data(attn_q.name))
    experts = plan.expert_layers[0]
    table = layout.expert_layers[experts.layer]
    down = ckpt.read(experts.names.per_expert_names(3)[2])
    want = quantize(down, table.matrices["down"].encoding, importance(entries[experts.canonical["down"]][3]))
    assert np.array_equal(layout.expert_matrix_data(experts.layer, 3, "down"), want.reshape(-1))
    from colibri.verify.model_check import verify_model

    assert verify_model(tmp_path / "with", progress=False).ok


def test_with_an_imatrix_q4_0_guards_the_first_ffn_down_layers(source, tmp_path):
    src, plan, imatrix_file, _ = source
    from colibri.formats.recipe import Recipe

    c = plan.config
    assert Recipe("Q4_0", 16, c.n_experts, False, has_imatrix=True).encoding("blk.1.ffn_down_exps.weight", (8, 64, 256)) == "Q4_1"
    assert Recipe("Q4_0", 16, c.n_experts, False).encoding("blk.1.ffn_down_exps.weight", (8, 64, 256)) == "Q4_0"


def test_bad_importance_matrices_are_refused_in_one_line(source, tmp_path, capsys):
    src, plan, imatrix_file, entries = source

    def refused(path, *words):
        code = convert_main([str(src), str(tmp_path / "out"), "--imatrix", str(path), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert code == 1 and "\n" not in err and path.name in err, err
        for word in words:
            assert word in err, (word, err)
        assert not (tmp_path / "out" / "colibri.json").exists()

    refused(write_imatrix(tmp_path / "model.gguf", entries, kind="model"), "not an importance matrix")
    short = {name: sums[:, :-32] for name, sums in entries.items()}
    refused(write_imatrix(tmp_path / "short.gguf", short), "columns", "rows of")
    negative = {name: -sums for name, sums in entries.items()}
    refused(write_imatrix(tmp_path / "negative.gguf", negative), "negative or non-finite")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
    refused(tmp_path / "junk.gguf")


def test_an_imatrix_does_not_apply_to_a_gguf(tmp_path, capsys):
    (tmp_path / "m.gguf").write_bytes(b"x")
    code = convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--imatrix", str(tmp_path / "i.gguf"), "--no-progress"])
    assert code == 1 and "--imatrix" in capsys.readouterr().err


def test_entries_are_read_lazily_and_counted(source):
    _, plan, imatrix_file, entries = source
    imatrix = Imatrix(imatrix_file)
    assert set(imatrix.entries) == set(entries) and "blk.0.nothing.weight" not in imatrix
    assert imatrix.importance("blk.0.nothing.weight", 64) is None
    name = plan.expert_layers[0].canonical["gate"]
    assert np.array_equal(imatrix.importance(name, entries[name].shape[1], 2), importance(entries[name][2]))


def test_q2_k_s_needs_an_imatrix_as_in_llama_quantize(source, tmp_path, capsys):
    src, _, imatrix_file, _ = source
    code = convert_main([str(src), str(tmp_path / "out"), "--quant", "Q2_K_S", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "--quant Q2_K_S needs --imatrix" in err and not (tmp_path / "out").exists()
    convert(str(src), tmp_path / "q2ks", ConvertOptions(quant="Q2_K_S", imatrix=imatrix_file, progress=False))
    assert ModelLayout(tmp_path / "q2ks").manifest["quant"]["recipe"] == "Q2_K_S"
