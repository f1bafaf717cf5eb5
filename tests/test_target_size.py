"""colibri-convert --target-size: each matrix's type chosen for the least measured damage within a
budget of file bytes (convert/target_size.py). Whether it beats llama-quantize's fixed mixes is
measured on the trained reference models (bench/quality.py --sized-like)."""

import argparse
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri.cli import convert_main, kl_scorer, main
from colibri.cli.commands import add_convert_arguments
from colibri.cli.kl_scorer import ScoreJournal
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.pipeline import ConvertError
from colibri.convert.plan import make_plan
from colibri.convert.synthetic import write_checkpoint
from colibri.convert.target_size import MAX_TABLES, Choice, choose, lower_hull, refine, tensor_class, type_runs
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout
from colibri.formats.logprob_file import LogProbWriter
from colibri.formats.recipe import IMATRIX_TYPES
from colibri.runtime.imatrix_collect import ActivationSums
from colibri.verify.perplexity import perplexity


def test_the_hull_keeps_only_options_no_mix_of_two_others_beats():
    options = [("a", 100, 10.0), ("b", 200, 4.0), ("c", 300, 3.5), ("d", 400, 1.0), ("e", 250, 6.0)]
    # e costs more than b and does worse; c lies above the line from b to d
    assert [o[0] for o in lower_hull(options)] == ["a", "b", "d"]


def test_the_choice_takes_the_upgrades_that_remove_most_damage_a_byte_while_they_fit():
    cheap_to_mend = Choice("x", [("lo", 100, 50.0), ("hi", 200, 10.0)])  # 0.4 damage a byte
    dear_to_mend = Choice("y", [("lo", 100, 50.0), ("hi", 300, 20.0)])  # 0.15 a byte
    assert choose([cheap_to_mend, dear_to_mend], budget=300) == {"x": "hi", "y": "lo"}
    assert choose([cheap_to_mend, dear_to_mend], budget=500) == {"x": "hi", "y": "hi"}
    assert choose([cheap_to_mend, dear_to_mend], budget=250) == {"x": "lo", "y": "lo"}
    expert = Choice("z", [("lo", 800, 90.0), ("hi", 1600, 10.0)], expert=True)  # 8 experts, top-2: a quarter read
    assert choose([expert], budget=2000, read_budget=399, top_k=2, experts=8) == {"z": "lo"}
    assert choose([expert], budget=2000, read_budget=400, top_k=2, experts=8) == {"z": "hi"}
    with pytest.raises(ValueError):
        choose([cheap_to_mend], budget=99)


def test_the_table_prints_runs_of_layers():
    table = {"blk.0.ffn_down_exps.weight": "Q4_K", "blk.1.ffn_down_exps.weight": "IQ2_XS",
             "blk.2.ffn_down_exps.weight": "IQ2_XS", "blk.3.ffn_down_exps.weight": "Q4_K", "token_embd.weight": "Q6_K"}
    assert type_runs(table) == ["ffn_down_exps        L0 Q4_K, L1-2 IQ2_XS, L3 Q4_K", "token_embd           Q6_K"]


def test_kinds_of_tensor():
    assert [tensor_class(n) for n in ("blk.3.attn_kv_b.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_up_exps.weight",
                                      "blk.1.ffn_gate_shexp.weight", "blk.0.ffn_down.weight", "output.weight",
                                      "token_embd.weight")] == \
        ["attention", "expert down", "expert gate/up", "dense ffn", "dense ffn", "embeddings/output", "embeddings/output"]


def kinds_choices() -> list[Choice]:
    """Two tensors of each of three kinds, three types each: measured damage 8, 3, 1 at 100, 200, 400 bytes."""
    names = ["blk.0.attn_q.weight", "blk.1.attn_q.weight", "blk.0.ffn_down_exps.weight", "blk.1.ffn_down_exps.weight",
             "blk.0.ffn_up_exps.weight", "blk.1.ffn_up_exps.weight"]
    return [Choice(n, [("IQ2_XXS", 100, 8.0), ("IQ3_S", 200, 3.0), ("Q4_K", 400, 1.0)]) for n in names]


def true_damage(table) -> float:
    """The damage the logits see: attention's measured damage costs 6 times its measure, the down
    matrices' a third of theirs."""
    damage = {"IQ2_XXS": 8.0, "IQ3_S": 3.0, "Q4_K": 1.0}
    weight = {"attention": 6.0, "expert down": 1 / 3, "expert gate/up": 1.0}
    return sum(weight[tensor_class(name)] * damage[t] for name, t in table.items())


def test_refinement_finds_the_weighting_the_scorer_prefers():
    choices, scored = kinds_choices(), []

    def score(table):
        scored.append(dict(table))
        return true_damage(table)

    def fit(weighed):
        return choose(weighed, 1500)

    table, trials = refine(choices, fit, score)
    measured = fit(choices)
    assert trials[0].weights == {} and trials[0].score == true_damage(measured) and trials[0].kept
    assert len(trials) == len(scored) and all(scored.count(t) == 1 for t in scored)  # no table scored twice
    assert true_damage(table) < true_damage(measured)
    assert true_damage(table) == min(t.score for t in trials) == [t.score for t in trials if t.kept][-1]
    sizes = {"IQ2_XXS": 100, "IQ3_S": 200, "Q4_K": 400}
    assert sum(sizes[t] for t in table.values()) <= 1500
    every = (dict(zip(table, types)) for types in itertools.product(sizes, repeat=len(table)))
    assert true_damage(table) == min(true_damage(t) for t in every if sum(sizes[e] for e in t.values()) <= 1500)


def test_refinement_scores_at_most_max_tables():
    def search(**cap) -> list:
        falling = iter(range(100, 0, -1))  # every table scores better: only the cap or the weightings end it
        return refine(kinds_choices(), lambda weighed: choose(weighed, 1500), lambda table: next(falling), **cap)[1]

    assert len(search()) <= MAX_TABLES
    assert len(search(max_tables=3)) == 3
    assert len(search(max_tables=1)) == 1 and search(max_tables=1)[0].weights == {}  # the measured table alone


def weight_file_bytes(path) -> int:
    files = json.loads((path / "colibri.json").read_text())["files"]
    return sum(f["size"] for name, f in files.items() if name == "resident.bin" or name.startswith("experts/"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint, an importance matrix for it, and its Q4_K_M and IQ2_XXS sizes."""
    root = tmp_path_factory.mktemp("sized")
    src = write_checkpoint(root / "src", "qwen3_moe")
    plan, rng, sums = make_plan(Checkpoint(src)), np.random.default_rng(2), ActivationSums()
    sums.sums = {t.name: rng.uniform(0.1, 5.0, (1, t.shape[-1])) for t in plan.resident if len(t.shape) == 2}
    for layer in plan.expert_layers:
        sums.sums.update({n: rng.uniform(0.1, 5.0, (layer.count, layer.shapes[m][1])) for m, n in layer.canonical.items()})
    sums.counts = {name: rng.integers(1, 20, len(rows)) for name, rows in sums.sums.items()}
    sums.write(root / "imatrix.gguf", ["random"], chunk_count=1, chunk_size=512)
    sizes = {}
    for mix in ("Q4_K_M", "IQ2_XXS"):
        convert(str(src), root / mix, ConvertOptions(quant=mix, imatrix=root / "imatrix.gguf", progress=False))
        sizes[mix] = weight_file_bytes(root / mix)
    return src, root / "imatrix.gguf", sizes


def test_a_sized_conversion_fits_its_target_records_its_table_and_verifies(model, tmp_path, capsys):
    src, imatrix, sizes = model
    target = (sizes["Q4_K_M"] + sizes["IQ2_XXS"]) // 2
    out = tmp_path / "sized"
    assert convert_main([str(src), str(out), "--target-size", str(target), "--imatrix", str(imatrix), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "types chosen for the size" in printed and "ffn_down_exps" in printed and "read a token" in printed
    assert 0.9 * target <= weight_file_bytes(out) <= target  # it spends the budget, never more
    layout = ModelLayout(out)
    overrides = dict(layout.manifest["quant"]["overrides"])
    experts = {t.matrices[m].encoding for t in layout.expert_layers.values() for m in ("gate", "up", "down")}
    assert overrides[r"^blk\.0\.ffn_down_exps\.weight$"] == layout.expert_layers[0].matrices["down"].encoding
    assert len(experts) > 1  # a mix, not one type
    assert main(["verify", str(out)]) == 0  # the recorded table reproduces every type
    again = tmp_path / "again"
    convert(str(src), again, ConvertOptions(target_size=target, imatrix=imatrix, progress=False))
    assert ModelLayout(again).manifest["quant"] == layout.manifest["quant"]  # measured, not random: the same table


def test_without_an_importance_matrix_the_types_that_need_one_are_not_chosen(model, tmp_path):
    src, _, sizes = model
    convert(str(src), tmp_path / "plain", ConvertOptions(target_size=sizes["Q4_K_M"] * 3 // 4, progress=False))
    layout = ModelLayout(tmp_path / "plain")
    chosen = {enc for _, enc in layout.manifest["quant"]["overrides"]}
    assert chosen and not chosen & set(IMATRIX_TYPES)


def test_the_read_per_token_bound_holds(model, tmp_path):
    src, imatrix, sizes = model
    loose = tmp_path / "loose"
    convert(str(src), loose, ConvertOptions(target_size=sizes["Q4_K_M"], imatrix=imatrix, progress=False))
    read = sum(t.expert_bytes for t in ModelLayout(loose).expert_layers.values())
    bounded = tmp_path / "bounded"
    summary = convert(str(src), bounded, ConvertOptions(target_size=sizes["Q4_K_M"], imatrix=imatrix, progress=False,
                                                        max_read_per_token=read * 2 * 3 // 4))  # top-2
    assert summary["expert_bytes_per_token"] <= read * 2 * 3 // 4 < 2 * read


def test_a_target_below_the_smallest_types_is_one_line_and_writes_nothing(model, tmp_path, capsys):
    src, imatrix, _ = model
    assert convert_main([str(src), str(tmp_path / "out"), "--target-size", "100K", "--imatrix", str(imatrix),
                         "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--target-size 0.1M: the smallest types make" in err and "allow more" in err and "\n" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConvertError, match="give --target-size too"):
        convert(str(src), tmp_path / "out", ConvertOptions(max_read_per_token=1 << 20, progress=False))


KL_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i} of a plain text\n" for i in range(200))


@pytest.fixture(scope="module")
def kl_base(model, tmp_path_factory):
    """A base file: the F32 conversion's log-probabilities on two chunks of 96 tokens."""
    src, _, _ = model
    root = tmp_path_factory.mktemp("kl")
    convert(str(src), root / "F32", ConvertOptions(quant="F32", progress=False))
    (root / "text.txt").write_text(KL_TEXT)
    assert main(["perplexity", str(root / "F32"), "--text", str(root / "text.txt"), "--ctx", "96", "--chunks", "2",
                 "--save-base", str(root / "base.logits"), "--no-progress"]) == 0
    return root / "base.logits"


class Crash(Exception):
    pass


def test_kl_scored_tables_keep_the_least_kl_and_leave_no_scratch(model, kl_base, tmp_path, capsys, monkeypatch):
    src, imatrix, sizes = model
    capsys.readouterr()
    out = tmp_path / "ranked"
    target = (sizes["Q4_K_M"] + sizes["IQ2_XXS"]) // 2
    args = [str(src), str(out), "--target-size", str(target), "--imatrix", str(imatrix),
            "--kl-base", str(kl_base), "--kl-tables", "4", "--workers", "1", "--json", "--no-progress"]
    scorings, crash_after = [], [2]

    def scoring(*a, **k):  # verify.perplexity, counted; the first run dies after its second table
        if len(scorings) == crash_after[0]:
            raise Crash
        scorings.append(perplexity(*a, **k)["kld_mean"])
        return {"kld_mean": scorings[-1], "tokens": 0}

    monkeypatch.setattr(kl_scorer, "perplexity", scoring)
    with pytest.raises(Crash):
        convert_main(args)
    assert len(scorings) == 2 and (tmp_path / ".ranked-scores.json").is_file()  # each score journalled as it came
    crash_after[0] = None
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for name, pid in ((".ranked-scoring-killed", ended.pid), (".ranked-scoring-running", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner.pid").write_text(str(pid))  # a killed run's scratch, and a live one's
    capsys.readouterr()
    assert convert_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    ranking = summary["ranking"]
    assert [t["score"] for t in ranking] == scorings  # the rerun scored only the tables the crash left
    assert ranking[0]["weights"] == {} and ranking[0]["kept"] and len(ranking) == 4  # its search would go on
    kept = [t["score"] for t in ranking if t["kept"]]
    assert kept == sorted(kept, reverse=True) and kept[-1] == min(t["score"] for t in ranking)
    assert weight_file_bytes(out) <= target and main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["perplexity", str(out), "--kl-base", str(kl_base), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["kld_mean"] == kept[-1]  # OUT is the table that scored it
    # our scratch, the killed run's and the journal are gone:
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ranked-scoring-running", "ranked"]


def test_a_journal_of_scores_holds_only_its_own_conversions(tmp_path):
    path = tmp_path / "scores.json"
    journal = ScoreJournal(path, {"source": "a"})
    journal.put([("blk", "Q4_K")], 0.25)
    assert ScoreJournal(path, {"source": "a"}).get([("blk", "Q4_K")]) == 0.25
    assert ScoreJournal(path, {"source": "a"}).get([("blk", "Q5_K")]) is None
    assert ScoreJournal(path, {"source": "b"}).get([("blk", "Q4_K")]) is None  # another conversion's
    assert ScoreJournal(path, {"source": "a"}, fresh=True).get([("blk", "Q4_K")]) is None  # --force
    path.write_text("{not json")
    assert ScoreJournal(path, {"source": "a"}).get([("blk", "Q4_K")]) is None


def test_a_bad_kl_base_is_one_line_and_writes_nothing(model, tmp_path, capsys):
    src, imatrix, sizes = model
    (tmp_path / "base.logits").write_bytes(b"not a base file at all")
    args = [str(src), str(tmp_path / "out"), "--imatrix", str(imatrix), "--kl-base", str(tmp_path / "base.logits"),
            "--no-progress"]
    assert convert_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "give --target-size too" in err and "\n" not in err
    assert convert_main([*args[:4], "--kl-tables", "4", "--no-progress"]) == 1
    assert "--kl-tables bounds the tables --kl-base scores" in capsys.readouterr().err
    assert convert_main([*args, "--target-size", str(sizes["Q4_K_M"]), "--kl-tables", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("--kl-tables 0: must be at least 1") and "\n" not in err
    assert convert_main([*args, "--target-size", str(sizes["Q4_K_M"])]) == 1
    err = capsys.readouterr().err.strip()
    assert "base.logits" in err and "\n" not in err
    writer = LogProbWriter(tmp_path / "base.logits", 8, 100, [[1] * 8, [2] * 8])  # a base of another vocabulary
    for _ in range(2):
        writer.add(np.zeros((3, 100), np.float32))
    writer.commit()
    assert convert_main([*args, "--target-size", str(sizes["Q4_K_M"])]) == 1
    err = capsys.readouterr().err.strip()
    assert "base.logits: a vocabulary of 100 tokens" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.logits"]


def test_the_kl_tables_help_gives_the_cap_refine_keeps():
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    assert f"(default: {MAX_TABLES})" in next(a.help for a in parser._actions if a.dest == "kl_tables")
