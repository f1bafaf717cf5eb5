"""`colibri smoke`: baselines of tiny converted models, and the drift of other conversions from them."""

import argparse
import hashlib
import json

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import tiny_config, write_checkpoint
from colibri.verify.smoke import add_smoke_arguments, smoke_command

MAX_TOKENS = "8"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One qwen3_moe checkpoint in BF16, Q8_0 and Q4_K_M, plus a BF16 baseline of it."""
    root = tmp_path_factory.mktemp("smoke")
    src = write_checkpoint(root / "src", "qwen3_moe")
    dirs = {}
    for quant in ("BF16", "Q8_0", "Q4_K_M"):
        dirs[quant] = root / quant
        convert(str(src), dirs[quant], ConvertOptions(quant=quant, progress=False))
    baseline = root / "baseline.json"
    assert smoke([str(dirs["BF16"]), "--record", str(baseline), "--max-tokens", MAX_TOKENS])[0] == 0
    return dirs, baseline


def smoke(argv, capsys=None):
    """Run `colibri smoke ARGV`; returns (exit code, stdout, stderr) — the output only with capsys."""
    parser = argparse.ArgumentParser(prog="colibri smoke")
    add_smoke_arguments(parser)
    code = smoke_command(parser.parse_args([*argv, "--ram-budget", "8G"]))
    out = capsys.readouterr() if capsys else None
    return code, out and out.out, out and out.err


def test_baseline_holds_tokens_logits_and_provenance(models):
    dirs, baseline = models
    b = json.loads(baseline.read_text())
    assert b["model"]["manifest_sha256"] == hashlib.sha256((dirs["BF16"] / "colibri.json").read_bytes()).hexdigest()
    assert b["model"]["quant"]["recipe"] == "BF16" and b["settings"]["max_tokens"] == 8
    for key in ("prompt_tok_per_s", "generation_tok_per_s", "expert_hit_rate", "expert_bytes_read_per_token",
                "tool_version", "date"):
        assert key in b
    assert {"cpu", "cores", "ram_bytes", "os"} <= set(b["machine"])
    logits = np.load(baseline.with_suffix(".npz"))
    assert len(b["prompts"]) == 6
    for i, p in enumerate(b["prompts"]):
        assert p["prompt_ids"] and 0 < len(p["generated_ids"]) <= 8 and len(p["output_head"]) <= 200
        rows = logits[f"logits_{i}"]
        assert rows.dtype == np.float16 and rows.shape == (len(p["prompt_ids"]) + len(p["generated_ids"]) - 1, 512)
        assert np.all(rows.max(axis=1) == 0)


def test_own_baseline_gives_zero_kl_and_full_agreement(models, capsys):
    """Not exactly 0: the baseline's logits are stored as float16, so KL < 1e-6 (measured ~2e-8)."""
    dirs, baseline = models
    code, out, err = smoke([str(dirs["BF16"]), "--compare", str(baseline), "--json", "--max-kl", "0.001"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert {"mean_kl", "median_kl", "p99_kl", "max_kl", "rms_dp", "same_top1", "token_agreement", "first_divergence",
            "speed_ratio"} <= set(r)
    assert 0 <= r["mean_kl"] <= r["p99_kl"] <= r["max_kl"] < 1e-6 and r["median_kl"] < 1e-6
    assert r["rms_dp"] < 1e-6 and r["same_top1"] == 1.0
    assert r["token_agreement"] == 1.0 and r["first_divergence"] == [None] * 6
    assert r["speed_ratio"] > 0 and r["failed_bounds"] == []


def test_q8_0_drifts_less_than_q4_k_m_and_the_gate_fails(models, capsys):
    dirs, baseline = models
    code, out, err = smoke([str(dirs["Q8_0"]), "--compare", str(baseline), "--json"], capsys)
    assert code == 0, err
    q8 = json.loads(out)
    bound = f"{q8['mean_kl'] * 4:.3g}"
    code, out, err = smoke([str(dirs["Q4_K_M"]), "--compare", str(baseline), "--json", "--max-kl", bound,
                            "--min-top1", "0.5"], capsys)
    q4 = json.loads(out)
    assert 0 < q8["mean_kl"] * 4 < q4["mean_kl"] and q8["p99_kl"] < q4["p99_kl"]
    assert q8["same_top1"] > q4["same_top1"] > 0.5
    assert code == 1 and q4["failed_bounds"] == [f"--max-kl {float(bound):g}: mean KL divergence {q4['mean_kl']:.6g} is above it"]
    assert "--max-kl" in err and "--min-top1" not in err
    code, out, err = smoke([str(dirs["Q4_K_M"]), "--compare", str(baseline), "--min-top1", "0.99"], capsys)
    assert code == 1 and "FAIL --min-top1 0.99: same-top-1 rate" in out and "FAIL --max-kl" not in out
    assert "KL divergence     mean" in out and "same top-1" in out and "free-running" in out


@pytest.mark.parametrize("arch, config, message", [
    ("mixtral", None, "prompt 1 tokenizes differently"),
    ("qwen3_moe", {"vocab_size": 768}, "vocabularies differ (512 vs 768 tokens)"),
])
def test_baseline_of_another_tokenizer_is_refused(models, tmp_path, capsys, arch, config, message):
    _, baseline = models
    src = write_checkpoint(tmp_path / "src", arch, config=config and tiny_config(arch, **config))
    convert(str(src), tmp_path / "model", ConvertOptions(quant="Q8_0", progress=False))
    code, out, err = smoke([str(tmp_path / "model"), "--compare", str(baseline)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert str(baseline) in err and message in err and "same model" in err


def test_missing_or_corrupt_baseline_is_one_line(models, tmp_path, capsys):
    dirs, baseline = models
    model = str(dirs["Q8_0"])
    cases = {"missing.json": "no such baseline", "broken.json": "not a readable baseline",
             "other.json": "not a colibri smoke baseline", "tampered.json": "tampered.npz: does not match baseline",
             "lonely.json": "lonely.npz: cannot read the logits"}
    (tmp_path / "broken.json").write_text('{"format": "colibri-sm')
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    for name in ("tampered", "lonely"):
        (tmp_path / f"{name}.json").write_text(baseline.read_text())
    npz = baseline.with_suffix(".npz").read_bytes()
    (tmp_path / "tampered.npz").write_bytes(npz[: len(npz) // 2])
    for name, message in cases.items():
        code, out, err = smoke([model, "--compare", str(tmp_path / name)], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (name, err)


def test_prompts_file_and_misplaced_flags(models, tmp_path, capsys):
    dirs, _ = models
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Once upon a time", "The harbour at dusk"]))
    out_file = tmp_path / "mine.json"
    code, out, err = smoke([str(dirs["Q8_0"]), "--record", str(out_file), "--prompts", str(prompts), "--max-tokens", "3"], capsys)
    assert code == 0, err
    assert [p["text"] for p in json.loads(out_file.read_text())["prompts"]] == ["Once upon a time", "The harbour at dusk"]
    assert "recorded 2 prompts" in out and out_file.with_suffix(".npz").is_file()
    (tmp_path / "empty.txt").write_text("\n\n")
    code, out, err = smoke([str(dirs["Q8_0"]), "--record", str(out_file), "--prompts", str(tmp_path / "empty.txt")], capsys)
    assert code == 2 and "empty.txt: expected non-empty prompts" in err
    code, out, err = smoke([str(dirs["Q8_0"]), "--compare", str(out_file), "--prompts", str(prompts)], capsys)
    assert code == 2 and "--prompts does not apply to --compare" in err
