"""A converted model folder from a stranger: values that would make a kernel write outside its
arrays, and links that lead outside the folder, are refused by verify and by open_model with one
line naming the file (issue reproductions)."""

import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def refused_by_open_and_verify(model, capsys, pattern: str, word: str) -> None:
    """open_model raises a FormatError matching `pattern`; verify exits 1 naming `word`, no traceback."""
    with pytest.raises(FormatError, match=pattern):
        open_model(model, ctx=64, ram_budget="8G")
    code, out, err = run(["verify", str(model)], capsys)
    assert code == 1 and word in out + err and "Traceback" not in err


def rewrite_config(model, **fields):
    """Change the manifest's config and write it back with a valid self-checksum (a stranger can)."""
    manifest = load_manifest(model)
    manifest["config"].update(fields)
    write_manifest(model, manifest)


@pytest.mark.parametrize("fields", [
    {"rope_dim": 10_000}, {"head_dim": 7}, {"n_experts_used": 99}, {"moe_layers": [0, 0]},
    {"hidden_size": 10**30}, {"norm_eps": -1.0}, {"rope_theta": 0.0}, {"vocab_size": 3},
    # values the architecture does not use are checked all the same (a Qwen3-MoE has no linear layers)
    {"gguf_architecture": -1}, {"gguf_architecture": "NOT_AN_ARCH"}, {"gguf_architecture": ["LLAMA"]},
    {"architecture": "x" * (1 << 20)},
    {"linear_k_heads": -1}, {"linear_k_head_dim": 10**400}, {"linear_v_heads": 2**63}, {"swiglu_alpha": "1"},
    {"rope_dim": 0},
])
def test_manifest_config_contradicting_the_tensors(model, capsys, fields):
    rewrite_config(model, **fields)
    with pytest.raises(FormatError, match=f"colibri.json: config: .*{next(iter(fields)).split('_')[0]}"):
        open_model(model, ctx=64, ram_budget="8G")
    for argv in (["verify", str(model)], ["run", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]):
        code, out, err = run(argv, capsys)
        assert code == 1 and "colibri.json" in out + err and "Traceback" not in err


@pytest.mark.parametrize("top", ["7", '"colibri"', "null", "[]"])
def test_manifest_that_is_no_object(model, capsys, top):
    (model / "colibri.json").write_text(top)
    refused_by_open_and_verify(model, capsys, "colibri.json: the manifest is .*, not a JSON object", "not a JSON object")


def test_tensors_sharing_bytes(model, capsys):
    """output.weight pointed at token_embd.weight's bytes: each record lies inside its file, but
    verify refused it while open_model ran it into non-finite logits."""
    manifest = load_manifest(model)
    tensors = manifest["tensors"]
    tensors["output.weight"]["offset"] = tensors["token_embd.weight"]["offset"] + 64
    write_manifest(model, manifest)
    refused_by_open_and_verify(model, capsys, "colibri.json: tensor .* share bytes of resident.bin", "share bytes")


def test_vector_stored_block_quantized(model, capsys):
    manifest = load_manifest(model)
    norm = manifest["tensors"]["output_norm.weight"]
    norm.update(encoding="Q3_K", nbytes=110 * norm["shape"][0] // 256)  # Q3_K: 110 bytes a block of 256
    write_manifest(model, manifest)
    with pytest.raises(FormatError, match="output_norm.weight: a vector stored as Q3_K"):
        open_model(model, ctx=64, ram_budget="8G")


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
        m = open_model(model, ctx=64, ram_budget="8G")
        list(m.generate([{"role": "user", "content": "hi"}], max_tokens=1))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=1000, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_manifest(converted, tmp_path_factory, capsys, data):
    """One value anywhere in a real manifest replaced (checksum made valid again, as a stranger
    can): the reader refuses it with a FormatError, or every record it accepts is consistent;
    verify never raises."""
    from colibri.formats.layout import ModelLayout

    manifest = load_manifest(converted)
    node, depth = manifest, data.draw(st.integers(1, 5))
    for _ in range(depth - 1):
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        child = node[data.draw(st.sampled_from(keys))] if keys else None
        if not isinstance(child, (dict, list)) or not child:
            break
        node = child
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    if not keys:
        return
    node[data.draw(st.sampled_from(keys))] = data.draw(json_values)
    case = tmp_path_factory.mktemp("manifest")
    try:
        write_manifest(case, manifest)
    except FormatError:
        return  # the writer validates too: such a manifest never reaches a reader from us
    try:
        layout = ModelLayout(case)
    except FormatError as e:
        assert "\n" not in str(e) and "colibri.json" in str(e)
    else:
        assert layout.problems() == []
    assert main(["verify", "--quick", str(case)]) == 1  # the data files are not there
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("text", ['{"a": ' + "[" * 1000 + "]" * 1000 + "}", '{"format_version": ' + "7" * 5001 + "}",
                                  '{"format": NaN}', "\xff\xfe"])
def test_manifest_that_is_no_json_a_reader_takes(model, capsys, text):
    (model / "colibri.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe")
    refused_by_open_and_verify(model, capsys, "colibri.json", "colibri.json")


def test_override_regex_that_backtracks_forever(model, capsys):
    """A manifest's quant.overrides `(.*.*)*Z` hung verify; the same pattern given to the converter."""
    manifest = load_manifest(model)
    manifest["quant"]["overrides"] = [["(.*.*)*Z", "Q8_0"]]
    write_manifest(model, manifest)
    code, out, err = run(["verify", "--quick", str(model)], capsys)
    assert code == 1 and "exponential time" in out
    from colibri.cli import convert_main

    with pytest.raises(SystemExit):
        convert_main([str(model), str(model.parent / "out"), "--override", "(ffn_.+)+down=Q8_0"])
    assert "exponential time" in capsys.readouterr().err


@pytest.mark.parametrize("name, text, word", [
    ("tokenizer.json", "{not json", "tokenizer.json"),
    ("chat_template.jinja", "{% for %}", "invalid"),
    ("tokenizer_config.json", "[1, 2]", "JSON object"),
])
def test_verify_loads_the_text_files_as_the_runtime_will(model, capsys, name, text, word):
    manifest = load_manifest(model)
    (model / name).write_text(text)
    import hashlib

    manifest["files"][name] = {"size": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    manifest["tokenizer_files"] = sorted(set(manifest["tokenizer_files"]) | {name})
    write_manifest(model, manifest)  # a stranger's model: consistent checksums, broken contents
    code, out, err = run(["verify", "--quick", str(model)], capsys)
    assert code == 1 and name in out and word in out, out


def test_deepseek_v4_token_table_naming_an_expert_it_lacks(tmp_path):
    """A hash layer's token → experts table is an index into the layer's experts: an id past
    them (checksums rewritten, as a stranger can) is refused at load, naming the file."""
    import hashlib

    import numpy as np

    convert(str(write_checkpoint(tmp_path / "src", "deepseek_v4")), tmp_path / "model",
            ConvertOptions(quant="Q8_0", progress=False))
    manifest = load_manifest(tmp_path / "model")
    entry = manifest["tensors"]["blk.0.ffn_gate_tid2eid.weight"]
    with open(tmp_path / "model" / entry["file"], "r+b") as f:
        f.seek(entry["offset"])
        table = np.frombuffer(f.read(entry["nbytes"]), np.float32).copy()
        table[5] = manifest["config"]["n_experts"]
        f.seek(entry["offset"])
        f.write(table.tobytes())
    entry["sha256"] = hashlib.sha256(table.tobytes()).hexdigest()
    write_manifest(tmp_path / "model", manifest)
    with pytest.raises(FormatError, match="resident.bin: blk.0.ffn_gate_tid2eid.weight holds expert ids outside"):
        open_model(tmp_path / "model", ctx=64, ram_budget="8G")
