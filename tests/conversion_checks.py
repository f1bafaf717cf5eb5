"""Checks shared by the conversion tests: the output equals our quantizer of the source."""

import hashlib

import gguf
import numpy as np

from colibri.convert.plan import make_plan
from colibri.convert.quantize_q4k import quantize
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import EXPERT_MATRICES, ModelLayout
from colibri.formats.recipe import Recipe


def decode(data: np.ndarray, encoding: str, shape) -> np.ndarray:
    """Decode stored bytes with gguf's own (independent) dequantizer."""
    return gguf.quants.dequantize(data.reshape(shape[0], -1), gguf.GGMLQuantizationType[encoding]).reshape(shape)


def source_expert(ckpt: Checkpoint, src, e: int) -> list[np.ndarray]:
    if src.fused:
        gate_up_name, down_name = src.names.fused_names
        return list(src.names.split_fused(ckpt.read(gate_up_name)[e], ckpt.read(down_name)[e]))
    return [ckpt.read(n) for n in src.names.per_expert_names(e)]


def check_conversion(source_dir, out, quant):
    ckpt = Checkpoint(source_dir)
    plan = make_plan(ckpt)
    layout = ModelLayout(out)
    c = plan.config
    recipe = Recipe(quant, c.n_layers, c.n_experts, c.tie_word_embeddings, n_gqa=c.n_heads // max(c.n_kv_heads, 1),
                    architecture=c.architecture)
    assert set(layout.tensors) == {t.name for t in plan.resident}
    assert sorted(layout.expert_layers) == c.moe_layers
    for t in plan.resident:
        info = layout.tensors[t.name]
        data = layout.tensor_data(t.name)
        assert info.encoding == recipe.encoding(t.name, t.shape), t.name
        assert hashlib.sha256(data).hexdigest() == info.sha256
        source = t.select(ckpt.read(t.source))
        assert np.array_equal(data, quantize(source, info.encoding).reshape(-1)), t.name
        if quant == "F32":
            assert np.array_equal(decode(data, "F32", t.shape), source)
    for src in plan.expert_layers:
        table = layout.expert_layers[src.layer]
        assert table.stride % 4096 == 0 and table.count == c.n_experts
        for m, name in src.canonical.items():
            assert table.matrices[m].encoding == recipe.encoding(name, src.shapes[m])
        for e in range(src.count):
            record = layout.expert_data(src.layer, e)
            assert hashlib.sha256(record).hexdigest() == table.sha256[e]
            for m, source in zip(EXPERT_MATRICES, source_expert(ckpt, src, e)):
                stored = layout.expert_matrix_data(src.layer, e, m)
                assert np.array_equal(stored, quantize(source, table.matrices[m].encoding).reshape(-1)), (src.layer, e, m)
                if quant == "F32":
                    assert np.array_equal(decode(stored, "F32", source.shape), source)
    for name in layout.manifest["tokenizer_files"]:
        assert (out / name).read_bytes() == (source_dir / name).read_bytes()
