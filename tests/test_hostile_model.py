"""A converted model folder from a stranger: values that would make a kernel write outside its
arrays, and links that lead outside the folder, are refused by verify and by open_model with one
line naming the file (issue reproductions)."""

import json
import os
import shutil

import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.formats.layout import FormatError, load_manifest, write_manifest
from colibri.runtime import open_model
from colibri.runtime.text import TokenizerError


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    src = write_checkpoint(root / "src", "qwen3_moe")
    convert(str(src), root / "model", ConvertOptions(quant="Q8_0", progress=False))
    return root / "model"


@pytest.fixture
def model(converted, tmp_path):
    return shutil.copytree(converted, tmp_path / "model")


def run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rewrite_config(model, **fields):
    """Change the manifest's config and write it back with a valid self-checksum (a stranger can)."""
    manifest = load_manifest(model)
    manifest["config"].update(fields)
    write_manifest(model, manifest)


@pytest.mark.parametrize("fields", [
    {"rope_dim": 10_000}, {"head_dim": 7}, {"n_experts_used": 99}, {"moe_layers": [0, 0]},
    {"hidden_size": 10**30}, {"norm_eps": -1.0}, {"rope_theta": 0.0}, {"vocab_size": 3},
])
def test_manifest_config_contradicting_the_tensors(model, capsys, fields):
    rewrite_config(model, **fields)
    with pytest.raises(FormatError, match=f"colibri.json: config: .*{next(iter(fields)).split('_')[0]}"):
        open_model(model, ram_budget="1G")
    for argv in (["verify", str(model)], ["run", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]):
        code, out, err = run(argv, capsys)
        assert code == 1 and "colibri.json" in out + err and "Traceback" not in err


@pytest.mark.parametrize("target", ["experts/blk.000.bin", "resident.bin", "tokenizer.json", "experts", "chat_template.jinja"])
def test_links_outside_the_folder(model, tmp_path, capsys, target):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = model / target
    moved = outside / victim.name
    if victim.exists():
        shutil.move(victim, moved)
    else:
        moved.write_text("{{ 'not the model template' }}")
    os.symlink(moved, victim)
    code, out, err = run(["verify", str(model)], capsys)
    assert code == 1 and "outside the model folder" in out + err and target.split("/")[0] in out + err
    with pytest.raises((FormatError, TokenizerError, OSError), match="outside the model folder"):
        m = open_model(model, ram_budget="1G")
        list(m.generate([{"role": "user", "content": "hi"}], max_tokens=1))
