"""Checkpoints saved by `transformers` itself convert with every --quant (oracle extra).

These are the real `save_pretrained` layouts (names, shards, config style of the installed
transformers), not our synthetic imitation of them. F32 conversions must read back
bit-identical to the saved weights; every other block must equal our quantizer of them.
"""

import numpy as np
import pytest
from conversion_checks import check_conversion, decode, source_expert
from oracle_models import build_with_transformers, oracle_available

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.plan import make_plan
from colibri.convert.synthetic import ARCHITECTURES
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout

available, reason = oracle_available()
pytestmark = [pytest.mark.oracle, pytest.mark.skipif(not available, reason=reason)]

QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(arch, **kw)`: a transformers-built checkpoint, built once per module."""
    cache = {}

    def build(arch, **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"hf-{arch}")
            cache[key] = build_with_transformers(folder / "ckpt", arch, **kwargs)
        return cache[key]

    return build


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_checkpoints_convert_with_every_quant(saved, tmp_path, arch, dtype):
    src = saved(arch, dtype=dtype)
    for quant in QUANTS:
        out = tmp_path / quant
        convert(str(src), out, ConvertOptions(quant=quant, progress=False))
        check_conversion(src, out, quant)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_f32_conversion_reads_back_bit_identical(saved, tmp_path, arch):
    src = saved(arch, dtype="bf16")
    convert(str(src), tmp_path / "out", ConvertOptions(quant="F32", progress=False))
    ckpt, layout = Checkpoint(src), ModelLayout(tmp_path / "out")
    plan = make_plan(ckpt)
    for t in plan.resident:
        assert np.array_equal(decode(layout.tensor_data(t.name), "F32", t.shape), t.select(ckpt.read(t.source))), t.name
    src_layer = plan.expert_layers[0]
    for e in range(src_layer.count):
        for matrix, source in zip(("gate", "up", "down"), source_expert(ckpt, src_layer, e)):
            stored = layout.expert_matrix_data(src_layer.layer, e, matrix)
            assert np.array_equal(decode(stored, "F32", src_layer.shapes[matrix]), source)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen3_next"])
def test_fused_expert_checkpoints_give_the_same_expert_files(saved, tmp_path, arch):
    convert(str(saved(arch)), tmp_path / "a", ConvertOptions(quant="Q4_K_M", progress=False))
    fused = saved(arch, fused_experts=True)
    convert(str(fused), tmp_path / "b", ConvertOptions(quant="Q4_K_M", progress=False))
    check_conversion(fused, tmp_path / "b", "Q4_K_M")
    for layer in ModelLayout(tmp_path / "a").expert_layers.values():
        assert (tmp_path / "a" / layer.file).read_bytes() == (tmp_path / "b" / layer.file).read_bytes()


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k2", "minimax_m2", "qwen3_next"])
def test_fp8_checkpoints_convert(saved, tmp_path, arch):
    src = saved(arch, fp8=True)
    assert any(t.dtype == "F8_E4M3" for t in Checkpoint(src).tensors.values())
    for quant in QUANTS:
        convert(str(src), tmp_path / quant, ConvertOptions(quant=quant, progress=False))
        check_conversion(src, tmp_path / quant, quant)
