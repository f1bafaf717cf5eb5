"""Bad input: one clear line naming the culprit, a non-zero exit, nothing written."""

import errno
import json
import pickle
import struct

import pytest

from colibri.cli import convert_main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.layout import AlignedFileWriter, ModelLayout


def run(argv, capsys):
    code = convert_main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.err.strip()


def rewrite_shard_without(path, drop: str):
    """Rewrite a safetensors shard without tensor `drop` (header and data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    kept, chunks, offset = {}, [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if name == "__metadata__":
            kept[name] = info
            continue
        if name == drop:
            continue
        start, end = info["data_offsets"]
        chunks.append(data[start:end])
        kept[name] = {**info, "data_offsets": [offset, offset + end - start]}
        offset += end - start
    blob = json.dumps(kept).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def shard_of(src, tensor: str):
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def test_missing_shard_is_named(checkpoint, tmp_path, capsys):
    src = checkpoint("mixtral")
    victim = shard_of(src, "lm_head.weight")
    victim.unlink()
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and victim.name in err and "missing" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_truncated_shard_gives_expected_and_actual_size(checkpoint, tmp_path, capsys):
    src = checkpoint("qwen3_moe")
    victim = shard_of(src, "model.embed_tokens.weight")
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 1000)
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and victim.name in err and "truncated" in err and str(size) in err and str(size - 1000) in err
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named(checkpoint, tmp_path, capsys):
    src = checkpoint("olmoe")
    name = "model.layers.1.self_attn.k_norm.weight"
    shard = shard_of(src, name)
    rewrite_shard_without(shard, name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and name in err and "lacks" in err
    assert not (tmp_path / "out").exists()


def test_index_naming_a_tensor_its_shard_lacks(checkpoint, tmp_path, capsys):
    src = checkpoint("olmoe")
    name = "model.layers.0.self_attn.q_norm.weight"
    rewrite_shard_without(shard_of(src, name), name)
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and name in err and shard_of(src, name).name in err


def test_unexpected_tensor_is_named(checkpoint, tmp_path, capsys):
    src = checkpoint("mixtral")
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] -= 1  # the last layer's tensors are now unexpected
    (src / "config.json").write_text(json.dumps(config))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and f"model.layers.{config['num_hidden_layers']}." in err and "unexpected" in err


def test_shape_contradicting_config(checkpoint, tmp_path, capsys):
    src = checkpoint("qwen2_moe")
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] //= 2
    (src / "config.json").write_text(json.dumps(config))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and "has shape" in err and "config.json implies" in err and "experts" in err


def test_unsupported_architecture_lists_supported(checkpoint, tmp_path, capsys):
    src = checkpoint("mixtral")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "jamba"
    (src / "config.json").write_text(json.dumps(config))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and "jamba" in err and "mixtral" in err and "deepseek_v3" in err and "glm4_moe" in err


class Boobytrap:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['COLIBRI_PICKLE_MARKER'], 'w').write('loaded')",))


def test_pickle_weights_are_refused_never_loaded(tmp_path, capsys, monkeypatch):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Boobytrap()))
    marker = tmp_path / "marker"
    monkeypatch.setenv("COLIBRI_PICKLE_MARKER", str(marker))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and "pytorch_model.bin" in err and "pickle" in err
    assert not marker.exists()


def test_out_holding_a_different_conversion(checkpoint, tmp_path, capsys):
    src = checkpoint("mixtral")
    out = tmp_path / "out"
    assert run([str(src), str(out), "--quant", "Q8_0"], capsys)[0] == 0
    before = (out / "colibri.json").read_bytes()
    code, err = run([str(src), str(out), "--quant", "Q4_K_M"], capsys)
    assert code != 0 and "different conversion" in err and "--force" in err
    assert (out / "colibri.json").read_bytes() == before
    assert run([str(src), str(out), "--quant", "Q4_K_M", "--force"], capsys)[0] == 0
    assert ModelLayout(out).manifest["quant"]["recipe"] == "Q4_K_M"


def test_out_not_empty_and_not_ours(checkpoint, tmp_path, capsys):
    src = checkpoint("mixtral")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = run([str(src), str(out)], capsys)
    assert code != 0 and "not empty" in err
    assert run([str(src), str(out), "--force"], capsys)[0] == 0
    assert (out / "notes.txt").read_text() == "mine"  # --force removes only our own files


def test_same_conversion_twice_is_a_quick_no_op(checkpoint, tmp_path):
    src = checkpoint("mixtral")
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    first = (tmp_path / "out" / "colibri.json").read_bytes()
    summary = convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    assert summary["units_resumed"] == 1 + len(ModelLayout(tmp_path / "out").expert_layers)
    assert (tmp_path / "out" / "colibri.json").read_bytes() == first


def test_disk_full_stops_cleanly_and_resumes(checkpoint, tmp_path, monkeypatch, capsys):
    src = checkpoint("qwen3_moe")
    out = tmp_path / "out"
    convert(str(src), tmp_path / "reference", ConvertOptions(progress=False))
    real_write = AlignedFileWriter.write
    calls = {"n": 0}

    def failing_write(self, data):
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(AlignedFileWriter, "write", failing_write)
    code, err = run([str(src), str(out), "--workers", "1"], capsys)
    assert code != 0 and "disk full" in err and "rerun" in err
    assert not (out / "colibri.json").exists() and not list(out.rglob("*.partial"))
    monkeypatch.setattr(AlignedFileWriter, "write", real_write)
    assert run([str(src), str(out), "--workers", "1"], capsys)[0] == 0
    for path in (tmp_path / "reference").rglob("*"):
        if path.is_file() and path.name != ".colibri-convert.json":
            assert (out / path.relative_to(tmp_path / "reference")).read_bytes() == path.read_bytes(), path


def test_not_enough_free_space_is_refused_up_front(checkpoint, tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    src = checkpoint("mixtral")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    code, err = run([str(src), str(tmp_path / "out")], capsys)
    assert code != 0 and "GB free" in err
    assert not (tmp_path / "out").exists()


def test_debug_shows_traceback(tmp_path, capsys):
    code = convert_main([str(tmp_path / "nowhere"), str(tmp_path / "out"), "--debug"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" in err and "no such file" in err
    code = convert_main([str(tmp_path / "nowhere"), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and err.count("\n") == 0
