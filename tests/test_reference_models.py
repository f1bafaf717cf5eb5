"""The committed reference models (models/, trained on CPython's standard library): a conversion
scores the held-out text as transformers did when the card was written, fewer bits cost more KL
on real text, and `colibri demo` runs one and completes Python."""

import json
from pathlib import Path

import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert

MODELS = Path(__file__).resolve().parents[1] / "models"
REFERENCE = ["stdlib-qwen3-moe", "stdlib-deepseek-v3"]
HELDOUT = MODELS / "data" / "stdlib-heldout.txt"


def perplexity(model: Path, capsys, *argv: str) -> dict:
    assert main(["perplexity", str(model), "--json", "--no-progress", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", REFERENCE)
def test_a_bf16_conversion_scores_held_out_text_as_transformers_did(name, tmp_path, capsys):
    """training.json's `heldout_ppl_first16` is transformers' perplexity of the saved weights on the
    first 16 windows of the held-out text; ours on the conversion equals it."""
    card = json.loads((MODELS / name / "training.json").read_text())
    convert(str(MODELS / name), tmp_path / "bf16", ConvertOptions(quant="BF16", progress=False))
    ours = perplexity(tmp_path / "bf16", capsys, "--text", str(HELDOUT), "--chunks", "16", "--kv-quant", "f32")
    assert ours["ppl"] == pytest.approx(card["heldout_ppl_first16"], rel=1e-5)
    assert ours["ppl"] < 100  # a trained model: a random one scores in the thousands on a 4096-token vocabulary


@pytest.mark.parametrize("name", REFERENCE)
def test_kl_from_bf16_grows_as_the_bits_shrink(name, tmp_path, capsys):
    base = tmp_path / "base.logits"
    convert(str(MODELS / name), tmp_path / "BF16", ConvertOptions(quant="BF16", progress=False))
    perplexity(tmp_path / "BF16", capsys, "--text", str(HELDOUT), "--chunks", "8", "--save-base", str(base))
    kl = {}
    for recipe in ("Q8_0", "Q4_K_M", "Q3_K_M", "Q2_K"):
        convert(str(MODELS / name), tmp_path / recipe, ConvertOptions(quant=recipe, progress=False))
        kl[recipe] = perplexity(tmp_path / recipe, capsys, "--kl-base", str(base))["kld_mean"]
    assert kl["Q8_0"] < kl["Q4_K_M"] < kl["Q3_K_M"] < kl["Q2_K"], kl
    # the KV cache's storage alone (the base ran with f16): q8_0 moves the predictions a little, far
    # less than Q4_K_M weights, and more than an f32 cache does
    cache = {kv: perplexity(tmp_path / "BF16", capsys, "--kl-base", str(base), "--kv-quant", kv) for kv in ("q8_0", "f32")}
    assert cache["f32"]["kld_mean"] < cache["q8_0"]["kld_mean"] < kl["Q4_K_M"] / 5, (cache, kl)
    assert cache["q8_0"]["same_top_p"] > 0.98


def test_demo_completes_python_with_the_trained_model(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path), "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert f"the checkpoint: {MODELS / 'stdlib-qwen3-moe'}" in printed
    answers = sorted((tmp_path / "answers").glob("*.out"))
    assert len(answers) == 6
    # after "def read_config(path):\n" a model that learned Python indents the body
    assert (tmp_path / "answers" / "doc0.txt.out").read_text().startswith("    ")
