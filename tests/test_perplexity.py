"""`colibri perplexity`: llama-perplexity's chunks and scores, the same bits at any --parallel,
base files that round-trip, and one-line refusals of bad texts and base files."""

import json
import math
import struct

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.logprob_file import LogProbFile, decode_rows, encode_rows
from colibri.runtime import open_model
from colibri.verify.perplexity import leading_bos, perplexity, text_chunks

CTX = 96
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # the {i}th line of a plain text\n" for i in range(400))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from colibri.convert.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("ppl")
    src = write_checkpoint(root / "src", "qwen3_moe")
    models = {}
    for quant in ("F32", "Q4_K_M"):
        convert(str(src), root / quant, ConvertOptions(quant=quant, progress=False))
        models[quant] = root / quant
    (root / "text.txt").write_text(TEXT)
    return models, root / "text.txt"


def reference_ppl(model, chunks, bos) -> float:
    """Each chunk alone through the one-sequence prompt path, every position's logits, scored as
    llama-perplexity scores (the last ctx − 1 − ctx/2 tokens, each from the position before)."""
    first, nll = len(chunks[0]) // 2, []
    for chunk in chunks:
        model.reset()
        logits = model.prefill(([bos] if bos is not None else chunk[:1]) + chunk[1:]).astype(np.float64)
        rows = logits[first:len(chunk) - 1]
        log_norm = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
        nll.append(log_norm - rows[np.arange(len(rows)), chunk[first + 1:]])
    return math.exp(np.concatenate(nll).mean())


def test_chunks_and_scores_are_llama_perplexity_s(converted):
    models, text = converted
    model = open_model(models["F32"], ctx=CTX, parallel=3)
    chunks = text_chunks(model.tokenizer, text, CTX, 5)
    ids = model.tokenizer.encode(TEXT)
    assert [c for chunk in chunks for c in chunk] == ids[:5 * CTX]  # whole chunks of the text, in order
    result = perplexity(model, chunks, 3)
    assert result["tokens"] == 5 * (CTX - 1 - CTX // 2)
    assert result["ppl"] == pytest.approx(reference_ppl(model, chunks, leading_bos(model.tokenizer)), rel=1e-5)
    model.close()


def test_parallel_changes_no_bit(converted):
    models, text = converted
    results = []
    for parallel in (1, 4):
        model = open_model(models["Q4_K_M"], ctx=CTX, parallel=parallel)
        results.append(perplexity(model, text_chunks(model.tokenizer, text, CTX, 5), parallel))
        model.close()
    assert results[0] == results[1]


def test_a_saved_base_compares_as_llama_perplexity_kl_divergence(converted, tmp_path, capsys):
    models, text = converted
    base = tmp_path / "base.logits"
    assert main(["perplexity", str(models["F32"]), "--text", str(text), "--ctx", str(CTX), "--chunks", "4",
                 "--save-base", str(base), "--json", "--no-progress"]) == 0
    saved = json.loads(capsys.readouterr().out)
    f = LogProbFile(base)
    assert (f.n_ctx, f.n_vocab, len(f.chunks)) == (CTX, 512, 4)
    assert not list(tmp_path.glob("*.partial"))

    assert main(["perplexity", str(models["F32"]), "--kl-base", str(base), "--json", "--no-progress"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["ppl"] == saved["ppl"] and same["kld_mean"] < 1e-6 and same["same_top_p"] > 0.99
    assert same["ppl_base"] == pytest.approx(saved["ppl"], rel=1e-4)  # the base's codes hold its log-probabilities

    assert main(["perplexity", str(models["Q4_K_M"]), "--kl-base", str(base), "--json", "--no-progress"]) == 0
    quantized = json.loads(capsys.readouterr().out)
    assert quantized["kld_mean"] > 100 * same["kld_mean"] and quantized["kld_max"] >= quantized["kld_p99"] >= quantized["kld_median"]
    assert set(quantized) >= {"ppl", "ppl_stderr", "kld_mean", "kld_median", "kld_p99", "kld_max", "same_top_p"}

    assert main(["perplexity", str(models["Q4_K_M"]), "--kl-base", str(base), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "Mean    KLD:" in printed and "Same top p:" in printed and "PPL(Q)/PPL(base)" in printed


def test_encoded_rows_keep_log_probabilities_within_half_a_step():
    logits = np.random.default_rng(0).normal(0, 4, (6, 1001)).astype(np.float32)
    logits[2] = 1.5  # a flat row: scale 0, every code 0
    rows = encode_rows(logits)
    assert rows.shape == (6, 2 * 501 + 4)
    exact = logits - logits.max(1, keepdims=True)
    exact = exact - np.log(np.exp(exact).sum(1, keepdims=True))
    decoded = decode_rows(rows, 1001)
    scale = rows[:, :4].copy().view(np.float32)[:, 0]
    near = exact > exact.max(1, keepdims=True) - 16
    assert np.all(np.abs(decoded - exact)[near] <= (scale[:, None] / 2 + 1e-5).repeat(1001, 1)[near])
    assert np.allclose(decoded[2], -np.log(1001), atol=1e-5)


@pytest.mark.parametrize("damage, words", [
    (lambda raw: b"_notlog_" + raw[8:], "not a log-probability file"),
    (lambda raw: raw[:-2], "its header implies"),
    (lambda raw: raw[:8] + struct.pack("<i", 1 << 30) + raw[12:], "out of range"),
    (lambda raw: raw[:20] + struct.pack("<i", 99999) + raw[24:], "outside its 512-token vocabulary"),
])
def test_a_damaged_base_file_is_refused_in_one_line(converted, tmp_path, capsys, damage, words):
    models, text = converted
    base = tmp_path / "base.logits"
    main(["perplexity", str(models["F32"]), "--text", str(text), "--ctx", str(CTX), "--chunks", "2",
          "--save-base", str(base), "--no-progress"])
    capsys.readouterr()
    base.write_bytes(damage(base.read_bytes()))
    assert main(["perplexity", str(models["F32"]), "--kl-base", str(base), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(base) in err and words in err, err


def test_bad_texts_and_options_are_one_line(converted, tmp_path, capsys):
    models, text = converted
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    for argv, words in (
        (["--text", str(short)], "needs at least"),
        (["--text", str(binary)], "cannot read as UTF-8"),
        (["--text", str(tmp_path / "absent.txt")], "absent.txt"),
        ([], "--text FILE is needed"),
        (["--text", str(text), "--chunks", "0"], "--chunks 0"),
    ):
        assert main(["perplexity", str(models["F32"]), *argv, "--no-progress"]) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
