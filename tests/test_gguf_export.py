"""`colibri export-gguf` and back: HF → colibri → GGUF → colibri is lossless.

Every resident tensor's bytes and every expert record of the re-imported model equal the
first conversion's, the config is the same, and our runtime's logits are identical (not
close: equal); GLM-5's quantized attn_kv_b, which llama.cpp's glm-dsa takes split and
transposed, comes back as F32 of the same values. Split output follows llama.cpp's naming and imports from its first part.
"""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf_checks import EXPORT_REFUSED, assert_same_model

from colibri.cli import main
from colibri.convert.arch import ADAPTERS
from colibri.convert.colibri_to_gguf import export_gguf
from colibri.convert.gguf_source import GGUFError
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES
from colibri.formats.layout import ModelLayout

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_round_trip_is_byte_identical(checkpoint, tmp_path, arch):
    src = checkpoint(arch)
    if arch in EXPORT_REFUSED:
        convert(str(src), tmp_path / "a", ConvertOptions(quant="Q4_K_M", progress=False))
        with pytest.raises(GGUFError, match=EXPORT_REFUSED[arch]):
            export_gguf(tmp_path / "a", tmp_path / "a.gguf", progress=False)
        assert not (tmp_path / "a.gguf").exists()
        return
    split = ADAPTERS[arch].gguf_split_kv_b  # attn_kv_b comes back F32 (test below): byte-identical at F32
    for quant in ("Q4_K_M", "F32") if arch in ("mixtral", "deepseek_v3") else ("F32",) if split else ("Q4_K_M",):
        first, gguf_file, again = tmp_path / f"{quant}-a", tmp_path / f"{quant}.gguf", tmp_path / f"{quant}-b"
        convert(str(src), first, ConvertOptions(quant=quant, progress=False))
        export_gguf(first, gguf_file, progress=False)
        summary = convert(str(gguf_file), again, ConvertOptions(progress=False))
        assert summary["quant"] == "GGUF" and summary["action"].startswith("imported")
        assert_same_model(first, again)
        manifest = ModelLayout(again).manifest
        assert manifest["quant"]["recipe"] == "GGUF"
        assert manifest["provenance"]["source_files"] == {gguf_file.name: {"size": gguf_file.stat().st_size, "sha256": None}}
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["tokenizer_files"])


def test_a_split_kv_b_comes_back_as_its_values(checkpoint, tmp_path):
    """GLM-5's attn_kv_b goes out as llama.cpp's attn_k_b (F32, transposed per head) and
    attn_v_b (its rows copied), and comes back as F32 holding the same values; the other
    tensors and the experts come back byte for byte."""
    from gguf_checks import model_bytes

    from colibri.convert.quantize_q4k import dequantize

    convert(str(checkpoint("glm_moe_dsa")), tmp_path / "a", ConvertOptions(quant="Q4_K_M", progress=False))
    export_gguf(tmp_path / "a", tmp_path / "a.gguf", progress=False)
    names = {t.name for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    assert "blk.0.attn_k_b.weight" in names and "blk.0.attn_v_b.weight" in names and "blk.0.attn_kv_b.weight" not in names
    convert(str(tmp_path / "a.gguf"), tmp_path / "b", ConvertOptions(progress=False))
    first, again = ModelLayout(tmp_path / "a"), ModelLayout(tmp_path / "b")
    kv_b = [n for n in first.tensors if n.endswith(".attn_kv_b.weight")]
    for name in kv_b:
        t = first.tensors[name]
        assert t.encoding != "F32" and again.tensors[name].encoding == "F32"
        values = dequantize(first.tensor_data(name).reshape(t.shape[0], -1), t.encoding, t.shape[1])
        assert np.array_equal(again.tensor_data(name).view(np.float32).reshape(t.shape), values)
    a, b = model_bytes(tmp_path / "a"), model_bytes(tmp_path / "b")
    assert {n: v for n, v in a.items() if n not in kv_b} == {n: v for n, v in b.items() if n not in kv_b}


def test_llama_qk_rows_are_permuted_in_the_gguf(checkpoint, tmp_path):
    """The exported Q/K rows are in llama.cpp's order, the other tensors' as stored."""
    convert(str(checkpoint("mixtral")), tmp_path / "m", ConvertOptions(quant="F32", progress=False))
    export_gguf(tmp_path / "m", tmp_path / "m.gguf", progress=False)
    layout, reader = ModelLayout(tmp_path / "m"), gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    c = layout.config
    for name, heads in (("blk.0.attn_q.weight", c.n_heads), ("blk.0.attn_k.weight", c.n_kv_heads)):
        ours = layout.tensor_data(name).view(np.float32).reshape(layout.tensors[name].shape)
        llama = ours.reshape(heads, 2, c.head_dim // 2, -1).swapaxes(1, 2).reshape(ours.shape)  # LlamaModel.permute
        assert np.array_equal(tensors[name], llama) and not np.array_equal(tensors[name], ours)
    v = layout.tensor_data("blk.0.attn_v.weight").view(np.float32).reshape(layout.tensors["blk.0.attn_v.weight"].shape)
    assert np.array_equal(tensors["blk.0.attn_v.weight"], v)
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert gate.shape == (c.n_experts, c.expert_ffn, c.hidden_size)
    assert np.array_equal(gate[3].view(np.uint8).reshape(-1), layout.expert_matrix_data(1, 3, "gate"))
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.ALL_F32


def test_split_export_imports_from_its_first_part(checkpoint, tmp_path, capsys):
    convert(str(checkpoint("qwen3_moe")), tmp_path / "a", ConvertOptions(progress=False))
    assert main(["export-gguf", str(tmp_path / "a"), str(tmp_path / "q.gguf"), "--split-max-size", "600K", "--no-progress"]) == 0
    parts = sorted(tmp_path.glob("q-*.gguf"))
    assert len(parts) >= 3 and not (tmp_path / "q.gguf").exists()
    assert [p.name for p in parts] == [f"q-{i:05d}-of-{len(parts):05d}.gguf" for i in range(1, len(parts) + 1)]
    assert parts[0].name in capsys.readouterr().out
    assert not list(tmp_path.glob(".*partial*"))
    convert(str(parts[0]), tmp_path / "b", ConvertOptions(progress=False))
    assert_same_model(tmp_path / "a", tmp_path / "b")
    assert sorted(ModelLayout(tmp_path / "b").manifest["provenance"]["source_files"]) == [p.name for p in parts]

    parts[1].unlink()
    code = main(["convert", str(parts[0]), str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and parts[1].name in err and "missing" in err and "\n" not in err
    assert not (tmp_path / "c").exists()


def test_import_resumes_byte_identical(checkpoint, tmp_path):
    """A killed import (units journalled, no manifest) resumes and ends byte-identical."""
    convert(str(checkpoint("deepseek_v3")), tmp_path / "a", ConvertOptions(progress=False))
    export_gguf(tmp_path / "a", tmp_path / "d.gguf", progress=False)
    convert(str(tmp_path / "d.gguf"), tmp_path / "b", ConvertOptions(progress=False, workers=2))
    reference = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    (tmp_path / "b" / "colibri.json").unlink()
    (tmp_path / "b" / "experts" / "blk.002.bin").unlink()
    summary = convert(str(tmp_path / "d.gguf"), tmp_path / "b", ConvertOptions(progress=False))
    assert summary["units_resumed"] == 2  # the resident file and layer 1; layer 2 redone
    assert {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()} == reference


def test_model_imported_from_the_cli_passes_verify(checkpoint, tmp_path):
    convert(str(checkpoint("glm4_moe")), tmp_path / "a", ConvertOptions(progress=False))
    export_gguf(tmp_path / "a", tmp_path / "g.gguf", progress=False)
    command = [sys.executable, "-m", "colibri.cli"]
    subprocess.run([*command, "convert", str(tmp_path / "g.gguf"), str(tmp_path / "b"), "--no-progress"], check=True, capture_output=True)
    result = subprocess.run([*command, "verify", str(tmp_path / "b"), "--json", "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout)["ok"]


def test_export_refuses_what_is_not_a_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["export-gguf", str(tmp_path / "empty"), str(tmp_path / "x.gguf"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "no manifest" in err and "\n" not in err
    assert not list(tmp_path.glob("*x*"))
