"""`colibri-convert MODEL.gguf OUT`: GGUFs written as llama.cpp writes them import exactly,
and bad GGUFs are refused with one line naming the file, before anything is written.

The reference GGUFs come from `llama_cpp_gguf.write_reference_gguf` (gguf-py's
GGUFWriter fed as llama.cpp's converter feeds it, F32): importing one must give the very
model `--quant F32` makes from the same safetensors — the same bytes for every tensor and
expert, hence the same logits.
"""

import gguf
import numpy as np
import pytest
from gguf_checks import NOT_IMPORTABLE, logits, model_bytes
from llama_cpp_gguf import write_reference_gguf

from colibri.cli import convert_main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES
from colibri.formats.layout import ModelLayout


@pytest.fixture
def reference(checkpoint, tmp_path):
    """`reference(arch, **kw)`: (F32 checkpoint folder, the GGUF llama.cpp's converter makes of it)."""

    def make(arch, **options):
        src = checkpoint(arch, dtype="f32")
        return src, write_reference_gguf(src, tmp_path / f"{arch}.gguf", **options)

    return make


def run(argv, capsys):
    code = convert_main([*argv, "--no-progress"])
    return code, capsys.readouterr().err.strip()


def refused(capsys, tmp_path, source, *words, options=()):
    """Import `source` and check the refusal: exit 1, one line naming the file and the problem, no OUT."""
    code, err = run([str(source), str(tmp_path / "out"), *options], capsys)
    assert code == 1 and "\n" not in err, err
    for word in (source.name, *words):
        assert word in err, (word, err)
    assert not (tmp_path / "out").exists()
    return err


def rewrite_gguf(src, dst, *, arch=None, drop=(), keys=None, tensor=None, types=None):
    """Copy a GGUF through gguf-py, without the keys/tensors in `drop`, with `keys` changed
    (same value type unless `types` names another) and each tensor passed through
    `tensor(name, data, type) -> (data, type)`."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, (keys or {}).get(field.name, field.contents()),
                             (types or {}).get(field.name, field.types[0]), sub_type)
    for t in reader.tensors:
        if t.name not in drop:
            data, kind = tensor(t.name, np.asarray(t.data), t.tensor_type) if tensor else (np.asarray(t.data), t.tensor_type)
            writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in NOT_IMPORTABLE])
def test_llama_cpp_gguf_equals_the_safetensors_conversion(reference, tmp_path, arch):
    src, gguf_file = reference(arch)
    convert(str(src), tmp_path / "st", ConvertOptions(quant="F32", progress=False))
    summary = convert(str(gguf_file), tmp_path / "gguf", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "st") == model_bytes(tmp_path / "gguf")
    want, got = logits(tmp_path / "st"), logits(tmp_path / "gguf")
    assert np.abs(got - want).max() <= 1e-6 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    config = ModelLayout(tmp_path / "gguf").config
    if arch.startswith(("deepseek", "kimi_k2")):  # llama.cpp splits kv_b; rebuilt exactly, stored F32
        assert "attn_kv_b of 3 layers rebuilt in F32" in summary["action"]
        assert ModelLayout(tmp_path / "gguf").tensors["blk.0.attn_kv_b.weight"].encoding == "F32"
        assert config.architecture == {"deepseek_v2": "deepseek_v2", "deepseek_v32": "deepseek_v32"}.get(arch, "deepseek_v3")
    if arch == "kimi_linear":  # its one MLA layer's kv_b too; the KDA layers are those of head_count_kv 0
        assert "attn_kv_b of 1 layers rebuilt in F32" in summary["action"]
        assert config.linear_layers == [0, 1] and config.nope_layers == [2] and config.linear_kind == "kda"
    if arch == "glm4_moe":  # llama.cpp keeps GLM's MTP layer; the import drops it
        assert config.mtp_layers_skipped == 1 and config.n_layers == 3
        assert summary["skipped_tensors"] > 0 and all(n.startswith("blk.3.") for n in ModelLayout(tmp_path / "gguf").manifest["provenance"]["skipped_tensors"])


def test_fused_gate_up_experts(reference, tmp_path):
    src, fused = reference("deepseek_v3", fuse_gate_up=True)
    assert "blk.1.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(fused).tensors}
    convert(str(src), tmp_path / "st", ConvertOptions(quant="F32", progress=False))
    convert(str(fused), tmp_path / "gguf", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "st") == model_bytes(tmp_path / "gguf")


def test_gguf_py_split_set_imports_like_one_file(reference, tmp_path, capsys):
    _, whole = reference("mixtral")
    src, _ = reference("mixtral", split_max_size=1_500_000)
    parts = sorted(tmp_path.glob("mixtral-0000*-of-*.gguf"))
    assert len(parts) >= 3
    convert(str(whole), tmp_path / "one", ConvertOptions(progress=False))
    convert(str(parts[-1]), tmp_path / "split", ConvertOptions(progress=False))  # any part names the set
    assert model_bytes(tmp_path / "one") == model_bytes(tmp_path / "split")

    # two of the parts renamed as a complete 2-part set: their split.count still says otherwise
    for i, part in enumerate(parts[:2], 1):
        (tmp_path / f"short-{i:05d}-of-00002.gguf").write_bytes(part.read_bytes())
    refused(capsys, tmp_path, tmp_path / "short-00001-of-00002.gguf", f"split.count is {len(parts)}")


def test_truncated_gguf(reference, tmp_path, capsys):
    _, source = reference("qwen3_moe")
    size = source.stat().st_size
    with open(source, "r+b") as f:
        f.truncate(size - 1000)
    refused(capsys, tmp_path, source, "truncated", str(size - 1000), str(size))


def test_not_a_gguf(tmp_path, capsys):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGML" + bytes(1000))
    refused(capsys, tmp_path, source, "not a GGUF file", "magic")


def test_unsupported_architecture_lists_the_supported(reference, tmp_path, capsys):
    _, source = reference("olmoe")
    other = rewrite_gguf(source, tmp_path / "jamba.gguf", arch="jamba")
    refused(capsys, tmp_path, other, "unsupported architecture 'jamba'", "qwen3moe", "deepseek2", "glm4moe")


def test_a_llama4_gguf_that_rotates_every_layer_but_the_last_is_refused(checkpoint, tmp_path, capsys):
    """llama.cpp's llama4 with sliding_window 0 (its converter writes it when no layer is chunked,
    for MobileLLM) rotates every layer but the last, which no Llama 4 config says."""
    from colibri.convert.synthetic import tiny_config

    src = checkpoint("llama4_text", dtype="f32", config=tiny_config("llama4_text", layer_types=["full_attention"] * 4))
    refused(capsys, tmp_path, write_reference_gguf(src, tmp_path / "mobile.gguf"), "sliding_window 0", "MobileLLM")


def test_a_glm5_next_gguf_without_a_gate_bound_decays_as_kimi_linear_and_one_without_the_tail_is_refused(
        reference, tmp_path, capsys):
    """llama.cpp's glm5-next graph takes Kimi-Linear's decay when kda.gate_lower_bound is absent
    (its converter writes the key only when the config has one), and always selects the tail."""
    _, source = reference("glm5_next_text")
    unbounded = rewrite_gguf(source, tmp_path / "unbounded.gguf", drop=("glm5-next.kda.gate_lower_bound",))
    assert run([str(unbounded), str(tmp_path / "kimi")], capsys)[0] == 0
    assert ModelLayout(tmp_path / "kimi").config.linear_gate_lower_bound == 0.0
    assert ModelLayout(tmp_path / "kimi").config.hyper_head_mean
    no_tail = rewrite_gguf(source, tmp_path / "no-tail.gguf", keys={"glm5-next.attention.indexer.kpool_select_tail": False})
    refused(capsys, tmp_path, no_tail, "kpool_select_tail is not true")


def test_llama_without_experts_is_refused(reference, tmp_path, capsys):
    _, source = reference("mixtral")
    dense = rewrite_gguf(source, tmp_path / "dense.gguf", drop=("llama.expert_count",))
    refused(capsys, tmp_path, dense, "llama without experts", "dense model")


def test_missing_tensor_and_missing_key(reference, tmp_path, capsys):
    _, source = reference("qwen3_moe")
    lacking = rewrite_gguf(source, tmp_path / "lacks-tensor.gguf", drop=("blk.1.attn_k_norm.weight",))
    refused(capsys, tmp_path, lacking, "lacks tensor blk.1.attn_k_norm.weight")
    lacking = rewrite_gguf(source, tmp_path / "lacks-key.gguf", drop=("qwen3moe.expert_used_count",))
    refused(capsys, tmp_path, lacking, "lacks metadata key qwen3moe.expert_used_count")


def test_tensor_contradicting_the_metadata(reference, tmp_path, capsys):
    _, source = reference("deepseek_v3")
    wrong = rewrite_gguf(source, tmp_path / "wrong.gguf", keys={"deepseek2.expert_feed_forward_length": 128})
    refused(capsys, tmp_path, wrong, "blk.1.ffn_gate_shexp.weight has shape [256, 256], the metadata implies [128, 256] (and 11 more)")


def test_types_the_kernels_cannot_compute_are_listed(reference, tmp_path, capsys):
    _, source = reference("mixtral")

    def to_nvfp4(name, data, kind):  # any bytes of NVFP4's size: the types are refused before a block is read
        if (data.ndim == 2 or "_exps" in name) and data.shape[-1] % 64 == 0:
            shape = (*data.shape[:-1], data.shape[-1] // 64 * 36)
            return np.zeros(shape, np.uint8), gguf.GGMLQuantizationType.NVFP4
        return data, kind

    nvfp4 = rewrite_gguf(source, tmp_path / "nvfp4.gguf", tensor=to_nvfp4)
    err = refused(capsys, tmp_path, nvfp4, "tensors have types colibri cannot compute", "supported: F32, F16", "Q6_K",
                  "(NVFP4)")
    assert all(kind in err for kind in ("Q4_0", "Q2_K", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ1_M"))  # among the supported


def test_a_gguf_holding_every_type_imports_and_runs_as_its_dequantized_weights(checkpoint, tmp_path):
    """Every quantized type the kernels compute, spread over the tensors (experts and resident
    ones): the GGUF imports, verifies and exports back byte for byte, and its logits are those
    of the same weights dequantized to F32 (up to the int8 activations of the fast path)."""
    from colibri.convert.colibri_to_gguf import FILE_TYPES, export_gguf
    from colibri.convert.quantize_q4k import IMATRIX_NEEDED, quantize
    from colibri.runtime.kernels import FAST_ENCODINGS
    from colibri.verify.model_check import verify_model

    from colibri.convert.synthetic import tiny_config

    src = checkpoint("mixtral", dtype="f32", config=tiny_config("mixtral", num_hidden_layers=6))
    source = write_reference_gguf(src, tmp_path / "mixtral.gguf")  # enough tensors for every type
    chosen = {}

    def quantized(name, data, kind):
        if not ((data.ndim == 2 or "_exps" in name) and "norm" not in name and "ffn_gate_inp" not in name):
            return data, kind
        fitting = [e for e in FAST_ENCODINGS if data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[e]][0] == 0]
        encoding = fitting[len(chosen) % len(fitting)]
        chosen[name] = encoding
        imatrix = np.ones(data.shape[-1], np.float32) if encoding in IMATRIX_NEEDED else None
        return quantize(data, encoding, imatrix), gguf.GGMLQuantizationType[encoding]

    def dequantized(name, data, kind):
        if name not in chosen:
            return data, kind
        return gguf.quants.dequantize(data, kind).astype(np.float32), gguf.GGMLQuantizationType.F32

    mixed = rewrite_gguf(source, tmp_path / "mixed.gguf", tensor=quantized)
    plain = rewrite_gguf(mixed, tmp_path / "plain.gguf", tensor=dequantized)
    assert set(chosen.values()) == set(FAST_ENCODINGS) and set(FAST_ENCODINGS) <= set(FILE_TYPES)
    convert(str(mixed), tmp_path / "q", ConvertOptions(progress=False))
    convert(str(plain), tmp_path / "f", ConvertOptions(progress=False))
    layout = ModelLayout(tmp_path / "q")
    held = {t.encoding for t in layout.tensors.values()} | {
        m.encoding for t in layout.expert_layers.values() for m in t.matrices.values()}
    assert set(FAST_ENCODINGS) <= held
    assert verify_model(tmp_path / "q", progress=False).ok
    export_gguf(tmp_path / "q", tmp_path / "again.gguf", progress=False)
    convert(str(tmp_path / "again.gguf"), tmp_path / "again", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "again") == model_bytes(tmp_path / "q")
    got, want = logits(tmp_path / "q"), logits(tmp_path / "f")
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.995 and np.median(cosine) >= 0.999, cosine  # 6 layers of int8 activations
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_gguf_in_q4_0_or_q4_1_imports_and_runs(reference, tmp_path, kind):
    """Blocks as gguf-py (llama.cpp's reference quantizer) writes them are kept byte for byte
    and computed: logits close to the F32 model's."""
    src, source = reference("mixtral")
    qtype = gguf.GGMLQuantizationType[kind]

    def quantized(name, data, old):
        if (data.ndim == 2 or "_exps" in name) and data.shape[-1] % 32 == 0 and "norm" not in name:
            return gguf.quants.quantize(data, qtype), qtype
        return data, old

    converted = rewrite_gguf(source, tmp_path / f"{kind}.gguf", tensor=quantized)
    convert(str(converted), tmp_path / "q", ConvertOptions(progress=False))
    layout = ModelLayout(tmp_path / "q")
    assert {t.encoding for t in layout.tensors.values() if len(t.shape) == 2} == {kind}
    assert {m.encoding for table in layout.expert_layers.values() for m in table.matrices.values()} == {kind}
    reader = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(converted).tensors}
    assert np.array_equal(layout.tensor_data("blk.0.attn_v.weight"), reader["blk.0.attn_v.weight"].reshape(-1))
    convert(str(src), tmp_path / "f32", ConvertOptions(quant="F32", progress=False))
    want, got = logits(tmp_path / "f32"), logits(tmp_path / "q")
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert np.median(cosine) >= 0.95, cosine  # every matrix, embeddings and routers too, in 4 bits


def test_quant_options_do_not_apply_to_a_gguf(reference, tmp_path, capsys):
    _, source = reference("mixtral")
    refused(capsys, tmp_path, source, "never re-quantized", options=("--quant", "Q8_0"))
