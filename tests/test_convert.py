"""Conversion of every architecture, source dtype, expert layout and --quant.

Each stored block must equal our quantizer applied to the source tensor (and our
quantizer equals ggml's: see test_quantize_golden.py), every checksum must hold, the
per-tensor types must be the recipe's, and F32 output must decode to the source exactly.
"""

import numpy as np
import pytest
from conversion_checks import check_conversion

from colibri.convert.arch import adapter_for
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES
from colibri.formats.checkpoint import E4M3_TO_F32, Checkpoint
from colibri.formats.layout import ModelLayout

QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_and_quant(checkpoint, tmp_path, arch, quant):
    src = checkpoint(arch, dtype="bf16")
    summary = convert(str(src), tmp_path / "out", ConvertOptions(quant=quant, progress=False))
    check_conversion(src, tmp_path / "out", quant)
    assert summary["architecture"] == arch
    assert "tokenizer.json" in ModelLayout(tmp_path / "out").manifest["tokenizer_files"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_other_source_dtypes(checkpoint, tmp_path, arch, dtype):
    src = checkpoint(arch, dtype=dtype)
    convert(str(src), tmp_path / "out", ConvertOptions(quant="Q4_K_M", progress=False))
    check_conversion(src, tmp_path / "out", "Q4_K_M")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "glm4_moe"])
def test_fused_experts_equal_per_expert(checkpoint, tmp_path, arch):
    per_expert = checkpoint(arch, seed=3)
    fused = checkpoint(arch, seed=3, fused_experts=True)
    assert any(n.endswith("experts.gate_up_proj") for n in Checkpoint(fused).tensors)
    for name, src in (("a", per_expert), ("b", fused)):
        convert(str(src), tmp_path / name, ConvertOptions(quant="Q4_K_M", progress=False))
    check_conversion(fused, tmp_path / "b", "Q4_K_M")
    for layer in ModelLayout(tmp_path / "a").expert_layers.values():
        assert (tmp_path / "a" / layer.file).read_bytes() == (tmp_path / "b" / layer.file).read_bytes()


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k2", "mimo_v2_flash"])  # as their releases are stored
def test_fp8_source(checkpoint, tmp_path, arch):
    src = checkpoint(arch, dtype="fp8")
    ckpt = Checkpoint(src)
    fp8 = [n for n, t in ckpt.tensors.items() if t.dtype == "F8_E4M3"]
    assert fp8 and all(n.removesuffix(".weight") + ".weight_scale_inv" in ckpt.tensors for n in fp8)
    name = next(n for n in fp8 if "experts.0.down_proj" in n)
    raw = ckpt.read_raw(name).reshape(ckpt.tensors[name].shape)
    scale = ckpt.read(name.removesuffix(".weight") + ".weight_scale_inv")
    expected = E4M3_TO_F32[raw] * np.kron(scale, np.ones((128, 128), np.float32))[: raw.shape[0], : raw.shape[1]]
    assert np.array_equal(ckpt.read(name), expected)
    convert(str(src), tmp_path / "out", ConvertOptions(quant="Q8_0", progress=False))
    check_conversion(src, tmp_path / "out", "Q8_0")


def test_e4m3_decoding_table():
    assert E4M3_TO_F32[0x38] == 1.0 and E4M3_TO_F32[0xB8] == -1.0
    assert E4M3_TO_F32[0x7E] == 448.0 and E4M3_TO_F32[0x01] == 2.0**-9
    assert np.isnan(E4M3_TO_F32[0x7F]) and np.isnan(E4M3_TO_F32[0xFF])
    assert E4M3_TO_F32[0x08] == 2.0**-6  # smallest normal


def test_workers_give_identical_output(checkpoint, tmp_path):
    src = checkpoint("qwen2_moe")
    convert(str(src), tmp_path / "one", ConvertOptions(workers=1, progress=False))
    convert(str(src), tmp_path / "two", ConvertOptions(workers=2, progress=False))
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file() and p.name != ".colibri-convert.json"}
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in (tmp_path / "two").rglob("*") if p.is_file() and p.name != ".colibri-convert.json"}
    assert one == two


def test_mtp_layers_are_skipped_and_reported(checkpoint, tmp_path):
    src = checkpoint("deepseek_v3")
    ckpt = Checkpoint(src)
    n_layers = ckpt.config["num_hidden_layers"]
    mtp = [n for n in ckpt.tensors if n.startswith(f"model.layers.{n_layers}.")]
    assert mtp, "the fixture should carry a multi-token-prediction layer"
    summary = convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    assert summary["mtp_layers_skipped"] == 1 and summary["skipped_tensors"] == len(mtp)
    manifest = ModelLayout(tmp_path / "out").manifest
    assert set(mtp) <= set(manifest["provenance"]["skipped_tensors"])


def test_normalized_configs(checkpoint):
    ds = adapter_for(Checkpoint(checkpoint("deepseek_v3")).config).normalize(Checkpoint(checkpoint("deepseek_v3")).config)
    assert ds.attention == "mla" and ds.router == "sigmoid" and ds.router_bias and ds.rope_interleaved
    glm_ckpt = Checkpoint(checkpoint("glm4_moe"))
    glm = adapter_for(glm_ckpt.config).normalize(glm_ckpt.config)
    assert glm.rope_dim < glm.head_dim and glm.attn_bias and glm.moe_layers[0] >= 1
    q2_ckpt = Checkpoint(checkpoint("qwen2_moe"))
    q2 = adapter_for(q2_ckpt.config).normalize(q2_ckpt.config)
    assert q2.shared_expert_gate and q2.attn_bias and not q2.router_norm_topk


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q2_K", "Q3_K"])
def test_overrides_to_the_newer_types_convert_verify_and_run(checkpoint, tmp_path, kind):
    """Q4_0, Q4_1, Q2_K and Q3_K as --override targets: ggml's blocks in the layout, checked
    by `verify`, multiplied by the kernels."""
    from colibri.formats.recipe import parse_override
    from colibri.runtime import open_model
    from colibri.verify.model_check import verify_model

    src = checkpoint("qwen3_moe")
    out = tmp_path / kind
    convert(str(src), out, ConvertOptions(quant="Q8_0", overrides=[parse_override(f"ffn_.*_exps={kind}")], progress=False))
    layout = ModelLayout(out)
    assert {m.encoding for t in layout.expert_layers.values() for m in t.matrices.values()} == {kind}
    assert verify_model(out, progress=False).ok
    m = open_model(out, ctx=64, ram_budget="8G")
    logits = m.prefill([5, 6, 7, 8])
    assert np.isfinite(logits).all() and m.stats()["expert_bytes_read"] > 0
    m.close()


@pytest.mark.parametrize("arch, mix", [("qwen3_moe", "Q2_K"), ("deepseek_v3", "Q3_K_M"), ("mixtral", "Q5_K_S"),
                                       ("qwen3_moe", "Q4_0")])
def test_llama_quantize_mixes_convert_verify_and_run(checkpoint, tmp_path, arch, mix):
    """A mix end to end: each tensor in the type the recipe chose, ggml's bytes for it
    (`check_conversion`), `verify` clean, and the model runs."""
    from colibri.formats.recipe import MIXES
    from colibri.runtime import open_model
    from colibri.verify.model_check import verify_model

    src = checkpoint(arch)
    out = tmp_path / mix
    summary = convert(str(src), out, ConvertOptions(quant=mix, progress=False))
    check_conversion(src, out, mix)
    layout = ModelLayout(out)
    assert layout.manifest["quant"]["recipe"] == mix
    experts = {m.encoding for t in layout.expert_layers.values() for m in t.matrices.values()}
    assert MIXES[mix] in experts
    assert verify_model(out, progress=False).ok
    m = open_model(out, ctx=64, ram_budget="8G")
    assert np.isfinite(m.prefill([5, 6, 7, 8])).all()
    m.close()
    assert summary["output_bytes"] > 0
