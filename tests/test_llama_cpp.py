"""llama.cpp loads what `colibri export-gguf` writes and computes our logits (optional).

Needs llama-cpp-python (`pip install -e '.[llama]'`, which builds llama.cpp from source);
skipped without it. A tiny model of every architecture is converted, exported, evaluated
by llama.cpp on the same tokens, and its logits compared with colibri's runtime on the
colibri model:

- F32, llama.cpp with an F32 KV cache: max |Δ| ≤ 1e-4 × the logits' standard deviation and
  the same argmax on every row (measured: ≤ 2e-6; both compute in float32 throughout).
  Kimi-K2 gets 1e-2 (6.4e-3 measured): its YaRN has beta_fast == beta_slow, where llama.cpp's
  ramp differs from transformers' (which our runtime follows; a DeepSeek-V3 with other betas
  matches to 2e-6).
- Q4_K_M: llama.cpp quantizes the activations to 8 bits in its K-quant dot products, so
  near-tied router choices flip: the median over tokens of max |Δ| / std ≤ 0.15 (measured
  0.04–0.08; Q8_0 gives 0.03–0.06, so it is the activations, not our blocks) and the argmax
  agrees on ≥ 80% of the tokens (measured ≥ 92%).
"""

import numpy as np
import pytest
from gguf_checks import EXPORT_REFUSED

from colibri.convert.colibri_to_gguf import export_gguf
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES, write_checkpoint
from colibri.runtime import open_model

llama_cpp = pytest.importorskip("llama_cpp", reason="the optional llama extra is not installed (pip install 'colibri-moe[llama]')")

TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, 512, 24)]
# gpt-oss: llama.cpp rounds the YaRN ramp to whole dimensions, gpt-oss (truncate: false) does not;
# with truncate true the two agree to 1.4e-6. GLM-5: llama.cpp's glm-dsa normalizes MLA's q_a and
# kv_a with rms_norm_eps (1e-5), transformers with 1e-6 (1.2e-4 here; with 1e-5 ours agree within 1e-4)
# Kimi-Linear: llama.cpp runs the KDA recurrence in chunks and L2-normalizes q and k with rms_norm_eps
# (1e-5), transformers token by token with 1e-6: 1.04e-4 here (9.9e-5 with our epsilon set to 1e-5)
# MiniMax-M3: llama.cpp's minimax-m3 runs its block-sparse attention with flash attention only
# (else dense, with a warning), whose float16 steps on the CPU cost it 2.9e-3 with Qwen3-MoE too
# (1.8e-6 without); ours agree with its dense attention within 1.6e-6 on the rows that see every block
F32_TOLERANCE = {"kimi_k2": 1e-2, "gpt_oss": 1e-3, "glm_moe_dsa": 1e-3, "kimi_linear": 1e-3, "minimax_m3_vl_text": 5e-3}
FLASH_ATTENTION = ("minimax_m3_vl_text",)


@pytest.fixture(autouse=True)
def plain_cpu_buffers(monkeypatch):
    """ggml's extra buffer types (AMX, repacked weights) die with SIGILL on the VMs this runs
    on (the CPU advertises AMX); they only change the weights' memory layout for speed."""
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", params)


def llama_cpp_logits(path, flash_attn: bool = False) -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False,
                            type_k=0, type_v=0, flash_attn=flash_attn)  # GGML_TYPE_F32 KV cache
    model.eval(TOKENS)
    logits = np.array(model.scores[: len(TOKENS)], dtype=np.float32)
    model.close()
    return logits


def compare(tmp_path_factory, arch, quant):
    root = tmp_path_factory.mktemp(f"llama-cpp-{arch}-{quant}")
    src = write_checkpoint(root / "src", arch)
    convert(str(src), root / "colibri", ConvertOptions(quant=quant, progress=False))
    export_gguf(root / "colibri", root / "model.gguf", progress=False)
    ours = open_model(root / "colibri", ctx=64, kv_quant="f32", ram_budget="8G").prefill(TOKENS)
    theirs = llama_cpp_logits(root / "model.gguf", arch in FLASH_ATTENTION)
    return ours, theirs, np.abs(theirs - ours).max(-1) / ours.std()


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in EXPORT_REFUSED])
def test_f32_logits_match_llama_cpp(tmp_path_factory, arch):
    ours, theirs, deviation = compare(tmp_path_factory, arch, "F32")
    assert deviation.max() <= F32_TOLERANCE.get(arch, 1e-4), deviation.max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in EXPORT_REFUSED])
def test_q4_k_m_logits_stay_close_to_llama_cpp(tmp_path_factory, arch):
    ours, theirs, deviation = compare(tmp_path_factory, arch, "Q4_K_M")
    assert np.median(deviation) <= 0.15, np.median(deviation)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8


def test_deepseek_v4_release_runs_in_llama_cpp_with_its_fp4_experts_as_mxfp4(tmp_path):
    """DeepSeek-V4 as the release stores it (FP8 attention, FP4 experts): our conversion keeps
    the experts as MXFP4 blocks, and llama.cpp runs our export of it as we do."""
    from oracle_models import build_with_transformers, oracle_available, to_deepseek_v4_release

    available, reason = oracle_available()
    if not available:
        pytest.skip(reason)
    release = to_deepseek_v4_release(build_with_transformers(tmp_path / "src", "deepseek_v4"), tmp_path / "release")
    convert(str(release), tmp_path / "colibri", ConvertOptions(quant="Q8_0", progress=False))
    export_gguf(tmp_path / "colibri", tmp_path / "model.gguf", progress=False)
    ours = open_model(tmp_path / "colibri", ctx=64, kv_quant="f32", ram_budget="8G").prefill(TOKENS)
    theirs = llama_cpp_logits(tmp_path / "model.gguf")
    deviation = np.abs(theirs - ours).max(-1) / ours.std()
    assert np.median(deviation) <= 0.15, np.median(deviation)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8


def test_split_export_loads_in_llama_cpp(tmp_path):
    convert(str(write_checkpoint(tmp_path / "src", "qwen3_moe")), tmp_path / "colibri", ConvertOptions(progress=False))
    export_gguf(tmp_path / "colibri", tmp_path / "one.gguf", progress=False)
    export_gguf(tmp_path / "colibri", tmp_path / "split.gguf", split_max_size=600_000, progress=False)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) >= 3
    assert np.array_equal(llama_cpp_logits(parts[0]), llama_cpp_logits(tmp_path / "one.gguf"))


def test_perplexity_matches_llama_cpp_on_our_export(tmp_path):
    """`colibri perplexity` on a Q8_0 model against llama.cpp on its export: the same chunks,
    each evaluated by llama.cpp from an empty cache and scored as llama-perplexity scores them
    (the last ctx − 1 − ctx/2 tokens); within 0.5%."""
    from colibri.verify.perplexity import leading_bos, perplexity

    ctx = 64
    convert(str(write_checkpoint(tmp_path / "src", "qwen3_moe")), tmp_path / "colibri", ConvertOptions(quant="Q8_0", progress=False))
    export_gguf(tmp_path / "colibri", tmp_path / "model.gguf", progress=False)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 512, 6 * ctx)]
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(6)]
    model = open_model(tmp_path / "colibri", ctx=ctx, parallel=2, ram_budget="8G")
    ours = perplexity(model, chunks, 2)["ppl"]
    bos = leading_bos(model.tokenizer)
    model.close()
    theirs = llama_cpp.Llama(model_path=str(tmp_path / "model.gguf"), logits_all=True, n_ctx=ctx, n_threads=2, verbose=False)
    nll, first = [], ctx // 2
    for chunk in chunks:
        theirs.reset()
        theirs.eval(([bos] if bos is not None else chunk[:1]) + chunk[1:])
        rows = np.array(theirs.scores[first:ctx - 1], dtype=np.float64)
        log_norm = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
        nll.append(log_norm - rows[np.arange(len(rows)), chunk[first + 1:]])
    theirs.close()
    assert ours == pytest.approx(np.exp(np.concatenate(nll).mean()), rel=5e-3)


@pytest.mark.parametrize("qtype", ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"])
def test_grid_quantizers_equal_ggml_s_on_fresh_rows(qtype):
    """The grid quantizers against libggml-base's `ggml_quantize_chunk` on rows the golden file does
    not hold: another seed and width, values rounded to a coarse grid (ties in IQ1's sort), a zero
    sub-block and a row of one sign, with and without an importance matrix where ggml takes none."""
    import importlib.util
    from pathlib import Path

    import gguf

    from colibri.convert.quantize_q4k import IMATRIX_NEEDED, quantize

    spec = importlib.util.spec_from_file_location("make_golden", Path(__file__).parent / "data" / "make_golden.py")
    make_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_golden)
    ggml = make_golden.Ggml(make_golden.find_library())
    rng = np.random.default_rng(11)
    x = rng.standard_t(3, (12, 768)).astype(np.float32)
    x[3] = np.round(x[3] * 4) / 4
    x[5, 32:64] = 0
    x[7] = np.abs(x[7])
    imatrix = (rng.random(768) + 0.05).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    for weights in ([imatrix] if qtype in IMATRIX_NEEDED else [imatrix, None]):
        ours, theirs = quantize(x, qtype, weights), ggml.quantize(kind, x, weights)
        differ = np.flatnonzero((ours != theirs).any(axis=-1))
        assert differ.size == 0, f"{qtype} imatrix={weights is not None}: rows {differ.tolist()} differ"


def random_importance(src, path):
    """An importance matrix in llama-imatrix's format for every matrix of checkpoint `src`
    (the grid mixes need one): per-column weights drawn uniformly, per expert for experts."""
    from colibri.convert.plan import make_plan
    from colibri.formats.checkpoint import Checkpoint
    from colibri.runtime.imatrix_collect import ActivationSums

    plan, rng, sums = make_plan(Checkpoint(src)), np.random.default_rng(5), ActivationSums()
    sums.sums = {t.name: rng.uniform(0.1, 5.0, (1, t.shape[-1])) for t in plan.resident if len(t.shape) == 2}
    for layer in plan.expert_layers:
        sums.sums.update({name: rng.uniform(0.1, 5.0, (layer.count, layer.shapes[m][1])) for m, name in layer.canonical.items()})
    sums.counts = {name: np.full(len(rows), 7) for name, rows in sums.sums.items()}
    sums.write(path, ["random"], chunk_count=4, chunk_size=512)
    return path


# together their tensors hold all seven grid types (the IQ3_XXS mix holds IQ2_S and IQ3_S too)
@pytest.mark.parametrize("mix", ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
def test_grid_mixes_export_to_gguf_llama_cpp_runs_and_import_back_byte_for_byte(tmp_path, mix):
    from gguf_checks import model_bytes

    from colibri.formats.layout import ModelLayout

    src = write_checkpoint(tmp_path / "src", "qwen3_moe")
    convert(str(src), tmp_path / "colibri", ConvertOptions(quant=mix, imatrix=random_importance(src, tmp_path / "imatrix.gguf"),
                                                           progress=False))
    layout = ModelLayout(tmp_path / "colibri")
    assert {t.matrices["gate"].encoding for t in layout.expert_layers.values()} == {mix}
    export_gguf(tmp_path / "colibri", tmp_path / "model.gguf", progress=False)
    ours = open_model(tmp_path / "colibri", ctx=64, kv_quant="f32", ram_budget="8G").prefill(TOKENS)
    theirs = llama_cpp_logits(tmp_path / "model.gguf")
    deviation = np.abs(theirs - ours).max(-1) / ours.std()  # llama.cpp rounds the activations to 8 bits here too
    assert np.median(deviation) <= 0.15 and (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8, np.median(deviation)
    convert(str(tmp_path / "model.gguf"), tmp_path / "back", ConvertOptions(progress=False))
    assert model_bytes(tmp_path / "back") == model_bytes(tmp_path / "colibri")
