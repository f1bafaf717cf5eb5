"""colibri-convert --target-size: each matrix's type chosen for the least measured damage within a
budget of file bytes (convert/target_size.py). Whether it beats llama-quantize's fixed mixes is
measured on the trained reference models (bench/quality.py --sized-like)."""

import json

import numpy as np
import pytest

from colibri.cli import convert_main, main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.pipeline import ConvertError
from colibri.convert.plan import make_plan
from colibri.convert.synthetic import write_checkpoint
from colibri.convert.target_size import Choice, choose, lower_hull, type_runs
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout
from colibri.formats.recipe import IMATRIX_TYPES
from colibri.runtime.imatrix_collect import ActivationSums


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
