"""Checkpoints written by strangers: the issue's reproductions, then seeded fuzzing of every
parser a download goes through. Each bad input must end in exit code 1 with one line naming the
file, no traceback, in bounded time, and nothing left in OUT."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.cli import convert_main, main
from colibri.convert.synthetic import write_checkpoint

def fuzz(examples: int):
    """Seeded (derandomized) hypothesis settings: the same cases on every run and in CI."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("hostile") / "src", "qwen3_moe")


@pytest.fixture
def src(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "src")


def refused(argv, capsys, *words, out=None):
    """Run `convert SRC OUT ...` (exit 1, one line on stderr, no OUT) or `colibri verify...`
    (exit 1, its report naming the problem); `words` must appear, a traceback never."""
    if argv[0] == "convert":
        code = convert_main([*argv[1:], "--no-progress"])
    else:
        code = main(argv[1:])
    captured = capsys.readouterr()
    err, text = captured.err.strip(), captured.out + captured.err
    assert code == 1 and "Traceback" not in text, text
    if argv[0] == "convert":
        assert err.count("\n") == 0, err
    for word in words:
        assert word in text, (word, text)
    if out is not None:
        assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    return text


def edit_config(src, **changes):
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


# --- config.json values the runtime would misread or misindex -----------------------------

@pytest.mark.parametrize("changes, word", [
    ({"partial_rotary_factor": 2.0}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 7.8125}, "partial_rotary_factor"),
    ({"partial_rotary_factor": -0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"hidden_act": "nonsense"}, "hidden_act"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"num_experts_per_tok": 0}, "n_experts_used"),
    ({"num_experts_per_tok": 1000}, "n_experts_used"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling"),
    ({"rms_norm_eps": -1}, "norm_eps"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"vocab_size": "many"}, "config.json"),
    ({"num_attention_heads": 0}, "config.json"),
    ({"num_key_value_heads": [2]}, "config.json"),
    ({"num_hidden_layers": 2**40}, "num_hidden_layers"),  # planned its tables until memory ran out
    ({"num_experts": 10**9}, "num_experts"),
    ({"rope_theta": 2**70}, "rope_theta"),
])
def test_config_values_are_refused_naming_the_key(src, tmp_path, capsys, changes, word):
    edit_config(src, **changes)
    refused(["convert", str(src), str(tmp_path / "out")], capsys, "config.json", word, out=tmp_path / "out")
    refused(["colibri", "verify-source", "--quick", str(src)], capsys, word)


def test_json_nested_deep_and_huge_integers(src, tmp_path, capsys):
    (src / "config.json").write_text('{"a": ' + "[" * 1000 + "]" * 1000 + "}")
    refused(["convert", str(src), str(tmp_path / "out")], capsys, "config.json", "nested", out=tmp_path / "out")
    (src / "config.json").write_text('{"vocab_size": ' + "9" * 5001 + "}")
    refused(["convert", str(src), str(tmp_path / "out")], capsys, "config.json", out=tmp_path / "out")
    index = src / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 1000 + "]" * 1000 + "}")
    refused(["colibri", "verify-source", "--quick", str(src)], capsys, index.name, "nested")


# --- safetensors headers and the index --------------------------------------------------------

def shard(src):
    return sorted(src.glob("*.safetensors"))[0]


def header_of(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), length, raw[8 + length:]


def write_header(path, header, payload, shift=0):
    """A safetensors file with `header` (a dict, or JSON text) padded as safetensors pads it,
    its declared length off by `shift` bytes."""
    blob = (header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob) + shift) + blob + payload)


def first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("breakage, word", [
    (lambda h, name: h[name].update(data_offsets=[float(h[name]["data_offsets"][0]), h[name]["data_offsets"][1]]), "data_offsets"),
    (lambda h, name: h[name].update(data_offsets=[str(o) for o in h[name]["data_offsets"]]), "data_offsets"),
    (lambda h, name: h[name].update(dtype=["F32"]), "dtype"),
    (lambda h, name: h[name].update(shape=[2.5, 4]), "shape"),
    (lambda h, name: h[name].update(shape=[-1, 4]), "shape"),
])
def test_malformed_header_entries(src, tmp_path, capsys, breakage, word):
    path = shard(src)
    header, _, payload = header_of(path)
    breakage(header, first_tensor(header))
    write_header(path, header, payload)
    refused(["colibri", "verify-source", "--quick", str(src)], capsys, path.name, word)
    refused(["convert", str(src), str(tmp_path / "out")], capsys, path.name, word, out=tmp_path / "out")


def test_header_length_one_byte_short_is_not_read_shifted(src, tmp_path, capsys):
    path = shard(src)
    header, length, payload = header_of(path)
    raw = path.read_bytes()
    assert raw[8 + length - 1:8 + length] == b" "  # safetensors pads its header with spaces
    path.write_bytes(struct.pack("<Q", length - 1) + raw[8:])
    refused(["convert", str(src), str(tmp_path / "out")], capsys, path.name, "belong to no tensor", out=tmp_path / "out")


@pytest.mark.parametrize("weight_map, word", [
    ({"model.embed_tokens.weight": 7}, "not a file name"),
    ({"model.embed_tokens.weight": "../../../etc/passwd"}, "not a file name"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "not a file name"),
    ("not an object", "weight_map"),
])
def test_index_entries_that_are_not_shard_names(src, tmp_path, capsys, weight_map, word):
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(["colibri", "verify-source", "--quick", str(src)], capsys, word)
    refused(["convert", str(src), str(tmp_path / "out")], capsys, word, out=tmp_path / "out")


def test_two_converts_into_one_out(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('held', flush=True); time.sleep(60)"),
        str(out / ".colibri-convert.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused(["convert", str(src), str(out)], capsys, "another colibri-convert", f"pid {holder.pid}")
        assert not (out / "resident.bin").exists() and not list(out.glob("*.partial"))
    finally:
        holder.kill()
        holder.wait()


# --- seeded fuzzing --------------------------------------------------------------------------

@fuzz(1500)
@given(data=st.data())
def test_fuzzed_safetensors_header(pristine, tmp_path_factory, capsys, data):
    """A shard header with one field replaced by an arbitrary JSON value, its length shifted, a
    byte flipped or the JSON nested deep: the reader refuses it in one line naming the file, or
    reads it exactly as declared; converting the folder exits 1 in one line and leaves no OUT
    (the tensors are never those config.json asks for)."""
    from colibri.formats.checkpoint import CheckpointError, read_header

    case = tmp_path_factory.mktemp("header")
    shutil.copy(pristine / "config.json", case / "config.json")
    path = case / "model.safetensors"
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}, "__metadata__": {"format": "pt"}}
    payload = bytes(24)
    how = data.draw(st.sampled_from(["field", "entry", "length", "flip", "deep", "payload"]))
    shift = 0
    if how == "field":
        name = data.draw(st.sampled_from(["a", "b", "__metadata__"]))
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        header[name] = {**header[name], key: data.draw(json_values)}
    elif how == "entry":
        header[data.draw(st.sampled_from(["a", "b", "c"]))] = data.draw(json_values)
    elif how == "length":
        shift = data.draw(st.integers(-16, 16).filter(bool))
    elif how == "deep":
        depth = data.draw(st.integers(60, 3000))
        header = json.dumps(header).replace('"shape": [2, 2]', '"shape": ' + "[" * depth + "]" * depth, 1)
    elif how == "payload":
        payload = payload[: data.draw(st.integers(0, 23))] + bytes(data.draw(st.integers(0, 1)) * 8)
    write_header(path, header, payload, shift)
    if how == "flip":
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(raw))
    try:
        entries = read_header(path)
    except CheckpointError as e:
        assert str(e).startswith(path.name) and "\n" not in str(e)
    else:
        size = path.stat().st_size
        ends = sorted((e.offset, e.offset + e.nbytes) for e in entries.values())
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and (not ends or ends[-1][1] == size)
    refused(["convert", str(case), str(case / "out")], capsys, out=case / "out")


@fuzz(500)
@given(weight_map=st.dictionaries(st.text(max_size=12), json_values, max_size=4) | json_values)
def test_fuzzed_index(src, capsys, weight_map):  # every case rewrites the whole index
    """An index with an arbitrary weight map: one line from verify-source, never a traceback."""
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code = main(["verify-source", "--quick", str(src)])
    out = capsys.readouterr()
    assert code == 1 and "Traceback" not in out.err


@fuzz(1000)
@given(key=st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "rms_norm_eps",
                            "rope_theta", "rope_scaling", "partial_rotary_factor", "hidden_act", "tie_word_embeddings",
                            "max_position_embeddings", "eos_token_id", "decoder_sparse_step", "mlp_only_layers",
                            "norm_topk_prob", "sliding_window", "use_sliding_window", "model_type"]),
       value=json_values)
def test_fuzzed_config(src, pristine, capsys, key, value):
    """config.json with one key set to an arbitrary JSON value: refused in one line before
    anything is written, or planned exactly as for a sound config."""
    shutil.copy(pristine / "config.json", src / "config.json")
    edit_config(src, **{key: value})
    code = main(["verify-source", "--quick", str(src)])
    out = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in out.err
    if code == 1:
        assert out.out.count("error:") >= 1


@pytest.mark.parametrize("seed", range(2))
def test_fuzzed_config_converts_or_refuses_cleanly(src, tmp_path, capsys, seed):
    """A few fuzzed configs all the way through convert: OUT exists only when it succeeded."""
    import random

    rng = random.Random(seed)
    keys = ["num_experts_per_tok", "rope_theta", "rms_norm_eps", "partial_rotary_factor", "num_key_value_heads"]
    for i in range(4):
        edit_config(src, **{rng.choice(keys): rng.choice([0, -1, 1.5, "x", None, [], 10**9, 2])})
        out = tmp_path / f"out{i}"
        code = convert_main([str(src), str(out), "--no-progress", "--quant", "Q8_0"])
        err = capsys.readouterr().err
        assert "Traceback" not in err and code in (0, 1)
        assert out.exists() == (code == 0) and not list(out.glob("**/*.partial"))
        if code == 0:
            assert main(["verify", "--quick", str(out)]) == 0
            capsys.readouterr()
