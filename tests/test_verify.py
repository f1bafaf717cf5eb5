"""`colibri verify-source` and `colibri verify`: clean inputs pass, every corruption is named."""

import argparse
import json
import random
import re
import shutil
import struct
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
from huggingface_hub import HfApi
from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

from colibri.convert.colibri_to_gguf import export_gguf
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import ARCHITECTURES, tiny_config, write_checkpoint
from colibri.formats.checkpoint import INDEX_NAME, CheckpointError
from colibri.formats.encodings import SCALE_OFFSETS
from colibri.formats.layout import JOURNAL_NAME, MANIFEST_NAME, FormatError, ModelLayout
from test_hub_source import fake_hub_cache, offline_cache  # noqa: F401 (a fixture)
from colibri.verify.cli import add_verify_arguments, add_verify_source_arguments, verify_command, verify_source_command
from colibri.verify.model_check import verify_model
from colibri.verify.sha_check import ERROR, SUMS_NAME, WARNING, verify_source

JSON_WHITESPACE = b" \t\n\r"


def source_report(src, **kwargs):
    return verify_source(str(src), progress=False, **kwargs)


def model_report(out, **kwargs):
    return verify_model(out, progress=False, jobs=2, **kwargs)


def errors(report) -> str:
    return "\n".join(map(str, report.of(ERROR)))


def flip(path, position: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ mask]))


def shards_of(src):
    return sorted(set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values()))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A mixtral checkpoint, and a DeepSeek-V3 one converted to Q4_K_M whose every file has padding
    (Q4_K, Q5_0, Q5_K, Q6_K, Q8_0 and F32 tensors; expert records shorter than their stride)."""
    root = tmp_path_factory.mktemp("verify")
    src = write_checkpoint(root / "src", "mixtral", seed=3)
    deepseek = write_checkpoint(root / "deepseek", "deepseek_v3", config=tiny_config("deepseek_v3", moe_intermediate_size=192))
    convert(str(deepseek), root / "q4km", ConvertOptions(quant="Q4_K_M", progress=False))
    return src, root / "q4km"


@pytest.fixture
def source(pristine, tmp_path):
    return shutil.copytree(pristine[0], tmp_path / "src")


@pytest.fixture
def model(pristine, tmp_path):
    return shutil.copytree(pristine[1], tmp_path / "model")


# --- verify-source: clean -------------------------------------------------------------------


def test_clean_source_with_written_sums(source):
    first = source_report(source, write_sums_file=True)
    assert first.ok and "not verified" in str(first.findings)
    assert all(f["sha256"] and f["verified_against"] is None for f in first.files.values())
    again = source_report(source)
    assert again.ok and not again.findings
    assert {f["verified_against"] for f in again.files.values()} == {"SHA256SUMS"}
    assert {n: f["sha256"] for n, f in again.files.items()} == {n: f["sha256"] for n, f in first.files.items()}
    if shutil.which("sha256sum"):  # the file is sha256sum's own format
        subprocess.run(["sha256sum", "--check", "--quiet", SUMS_NAME], cwd=source, check=True)


def test_clean_source_from_offline_hf_cache(source, offline_cache):  # noqa: F811
    fake_hub_cache(offline_cache, "someorg/tiny-mixtral", source)
    report = source_report("someorg/tiny-mixtral")
    assert report.ok and not report.findings
    assert {f["verified_against"] for f in report.files.values()} == {"hf-cache"}
    snapshot = next(offline_cache.glob("models--someorg--tiny-mixtral/snapshots/*"))
    assert source_report(snapshot).ok  # the snapshot folder itself: same blob names


def test_hf_cache_blob_corruption_is_named(source, offline_cache):  # noqa: F811
    fake_hub_cache(offline_cache, "someorg/tiny-mixtral", source)
    shard = shards_of(source)[1]
    blob = next(offline_cache.glob(f"models--someorg--tiny-mixtral/snapshots/*/{shard}")).resolve()
    flip(blob, blob.stat().st_size - 5, 0x10)
    report = source_report("someorg/tiny-mixtral")
    assert not report.ok and re.search(rf"{shard}: sha256 \w+ does not match its HF cache blob name", errors(report))


def test_hub_lfs_hashes_come_first(source, offline_cache, monkeypatch):  # noqa: F811
    fake_hub_cache(offline_cache, "someorg/tiny-mixtral", source)
    first, second = shards_of(source)
    lfs = {s: SimpleNamespace(sha256=b.resolve().name, size=b.stat().st_size) for s in (first, second)
           for b in offline_cache.glob(f"models--someorg--tiny-mixtral/snapshots/*/{s}")}
    lfs[second].sha256 = "0" * 64  # the hub disagrees about this one
    siblings = [RepoSibling(s, v.size, None, BlobLfsInfo(v.size, v.sha256, 130)) for s, v in lfs.items()]
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo, revision=None, files_metadata=False: SimpleNamespace(siblings=siblings))
    report = source_report("someorg/tiny-mixtral")
    assert report.files[first]["verified_against"] == "hub"
    assert not report.ok and f"{second}: sha256" in errors(report) and "the hub's LFS sha256" in errors(report)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    report = source_report("someorg/tiny-mixtral")
    assert report.ok and "hub unreachable" in str(report.findings)
    assert {f["verified_against"] for f in report.files.values()} == {"hf-cache"}


# --- verify-source: corruption -------------------------------------------------------------


def test_truncated_shards_are_named_with_both_sizes(source):
    rng = random.Random(1)
    for _ in range(8):
        shard = source / rng.choice(shards_of(source))
        data = shard.read_bytes()
        (header_len,) = struct.unpack("<Q", data[:8])
        cut = rng.choice([rng.randrange(0, 8 + header_len), rng.randrange(8 + header_len + 1, len(data))])
        shard.write_bytes(data[:cut])
        report = source_report(source, quick=True)
        assert not report.ok and f"{shard.name}: " in errors(report), cut
        if cut > 8 + header_len:
            assert f"truncated: header declares {len(data)} bytes, file has {cut}" in errors(report)
        shard.write_bytes(data)
    assert source_report(source).ok


def test_missing_and_renamed_shards(source):
    first, second = shards_of(source)
    (source / first).unlink()
    report = source_report(source)
    assert not report.ok and f"{first}: missing, though {INDEX_NAME} names it" in errors(report)
    (source / second).rename(source / "renamed.safetensors")
    report = source_report(source)
    assert f"{second}: missing" in errors(report)
    assert "warning: renamed.safetensors: not named in" in "\n".join(map(str, report.findings))


def test_changed_data_byte_is_caught_by_sha256sums(source):
    assert source_report(source, write_sums_file=True).ok
    rng = random.Random(2)
    for _ in range(10):
        shard = source / rng.choice(shards_of(source))
        (header_len,) = struct.unpack("<Q", shard.read_bytes()[:8])
        position, mask = rng.randrange(8 + header_len, shard.stat().st_size), rng.randrange(1, 256)
        flip(shard, position, mask)
        report = source_report(source)
        assert not report.ok and f"{shard.name}: sha256" in errors(report) and "does not match SHA256SUMS" in errors(report)
        flip(shard, position, mask)
    assert source_report(source).ok


def test_changed_header_byte_is_caught_by_the_header_checks(source):
    rng = random.Random(3)
    for _ in range(20):
        shard = source / rng.choice(shards_of(source))
        raw = shard.read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        meta_start = raw.index(b'"__metadata__"')
        meta_end = raw.index(b"}", meta_start) + 2  # metadata is free text: no check can see a change there
        position = rng.choice([p for p in range(8 + header_len) if not meta_start <= p < meta_end])
        mask = rng.randrange(1, 256)
        if raw[position] in JSON_WHITESPACE and raw[position] ^ mask in JSON_WHITESPACE:
            continue  # equivalent JSON
        flip(shard, position, mask)
        report = source_report(source, quick=True)  # no hashing: the structure alone must tell
        assert not report.ok and f"{shard.name}: " in errors(report), (position, mask, errors(report))
        flip(shard, position, mask)


def test_index_problems(source):
    index = source / INDEX_NAME
    text = index.read_text()
    first, second = shards_of(source)
    name = next(n for n, s in json.loads(text)["weight_map"].items() if s == first)
    entry = f'"{name}": "{first}"'
    index.write_text(text.replace('"weight_map": {', '"weight_map": {' + entry + ", ", 1))
    assert f"{INDEX_NAME}: lists {name} more than once" in errors(source_report(source, quick=True))
    index.write_text(text.replace(entry, f'"{name}": "{second}"'))
    report = source_report(source, quick=True)
    assert f"{first}: holds tensor {name}, which {INDEX_NAME} places elsewhere" in errors(report)
    assert f"{second}: lacks tensor {name}, which {INDEX_NAME} places there" in errors(report)
    index.write_text("{not json")
    assert f"{INDEX_NAME}: not a valid safetensors index" in errors(source_report(source, quick=True))


def test_tensors_are_checked_against_config(source):
    config = json.loads((source / "config.json").read_text())
    config["num_local_experts"] += 1
    (source / "config.json").write_text(json.dumps(config))
    report = source_report(source, quick=True)
    assert not report.ok and re.search(r"config.json: checkpoint lacks tensor model\.layers\.\d+\.block_sparse_moe\.experts\.\d+", errors(report))


def test_extra_shard_is_a_warning(source):
    shutil.copy(source / shards_of(source)[0], source / "stray.safetensors")
    report = source_report(source)
    assert report.ok and "stray.safetensors" in str(report.findings)


def test_write_sums_refuses_a_broken_checkpoint(source):
    (source / shards_of(source)[0]).unlink()
    report = source_report(source, write_sums_file=True)
    assert not report.ok and not (source / SUMS_NAME).exists()


# --- verify: clean --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_clean_models_pass(arch, tmp_path):
    src = write_checkpoint(tmp_path / "src", arch, dtype="fp8" if arch in ("deepseek_v3", "kimi_k2") else "bf16")
    for quant in ("Q4_K_M", "BF16") if arch in ("mixtral", "deepseek_v3") else ("Q4_K_M",):
        convert(str(src), tmp_path / quant, ConvertOptions(quant=quant, progress=False))
        report = model_report(tmp_path / quant)
        assert report.ok and not report.findings, (arch, quant, report.text())


# --- verify: corruption ---------------------------------------------------------------------


def expected_location(layout, file, position):
    """What a finding about a flip at `position` of `file` must say."""
    for table in layout.expert_layers.values():
        if table.file == file:
            expert, within = divmod(position - table.offset, table.stride)
            if within < table.expert_bytes:
                start = table.offset + expert * table.stride
                return f"{file}: layer {table.layer} expert {expert} (bytes {start}..{start + table.expert_bytes}): sha256 mismatch"
            return f"{file}: layer {table.layer} expert {expert} padding: non-zero padding bytes (1), first at byte {position}"
    for t in layout.tensors.values():
        if t.file == file and t.offset <= position < t.offset + t.nbytes:
            return f"{file}: tensor {t.name} (bytes {t.offset}..{t.offset + t.nbytes}): sha256 mismatch"
    return f"non-zero padding bytes (1), first at byte {position}"


def padding_positions(layout, file):
    """Byte offsets of `file` that hold no data."""
    size = layout.manifest["files"][file]["size"]
    if file.startswith("experts/"):
        table = next(t for t in layout.expert_layers.values() if t.file == file)
        return [p for p in range(size) if (p - table.offset) % table.stride >= table.expert_bytes]
    used = set()
    for t in layout.tensors.values():
        used.update(range(t.offset, t.offset + t.nbytes))
    return [p for p in range(size) if p not in used]


def test_random_byte_flips_are_named(model):
    layout = ModelLayout(model)
    files = ["resident.bin", *(t.file for t in layout.expert_layers.values())]
    padding = {f: padding_positions(layout, f) for f in files}
    assert all(padding.values())  # there is padding to corrupt in every file
    rng = random.Random(4)
    for trial in range(30):
        file = files[trial % len(files)]
        size = (model / file).stat().st_size
        position = rng.choice(padding[file]) if trial % 3 == 0 else rng.randrange(size)
        mask = rng.randrange(1, 256)
        flip(model / file, position, mask)
        report = model_report(model)
        assert not report.ok and expected_location(layout, file, position) in errors(report), (file, position, report.text())
        flip(model / file, position, mask)
    assert model_report(model).ok


@pytest.fixture(scope="module")
def imported(pristine, tmp_path_factory):
    """The DeepSeek model exported to GGUF and imported back (tokenizer files rebuilt from metadata)."""
    root = tmp_path_factory.mktemp("imported")
    export_gguf(pristine[1], root / "m.gguf", progress=False)
    convert(str(root / "m.gguf"), root / "model", ConvertOptions(progress=False))
    return root / "model"


def model_file_names(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("which", ["converted", "imported"])
def test_a_flip_in_every_file_is_named(which, pristine, imported, tmp_path):
    """Every file of the folder, the manifest and the journal included: each flip fails verify
    and names the file (and, in tensor and expert files, the place)."""
    model = shutil.copytree(pristine[1] if which == "converted" else imported, tmp_path / "model")
    layout = ModelLayout(model)
    names = model_file_names(model)
    loose = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", JOURNAL_NAME}
    assert loose - {"config.json"} <= set(names) and {"resident.bin", MANIFEST_NAME} <= set(names)
    rng = random.Random(6)
    for file in names:
        size = (model / file).stat().st_size
        big = file in layout.manifest["files"] and "sha256" not in layout.manifest["files"][file]
        positions = {0, size - 1, *(rng.randrange(size) for _ in range(6 if big else 2))}
        for position in sorted(positions):
            mask = rng.randrange(1, 256)
            flip(model / file, position, mask)
            report = model_report(model)
            text = errors(report)
            assert not report.ok and f"error: {file}: " in text, (file, position, text)
            if big:
                assert expected_location(layout, file, position) in text, (file, position, text)
            elif file != MANIFEST_NAME:
                assert f"error: {file}: whole file (bytes 0..{size}): sha256 mismatch" in text
            flip(model / file, position, mask)
    assert model_report(model).ok


def test_unlisted_files_are_reported(model):
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (model / "notes.txt").write_text("mine")
    for report in (model_report(model), model_report(model, quick=True)):
        assert "error: chat_template.jinja: not listed in the manifest" in errors(report)
        assert "warning: notes.txt: not listed in the manifest" in str(report.of(WARNING)[0])
    (model / "chat_template.jinja").unlink()
    report = model_report(model)
    assert report.ok and [f.file for f in report.findings] == ["notes.txt"]


def as_format_1(model):
    """Rewrite a format-2 manifest the way format 1 wrote it: no self_sha256, files without
    sha256, the journal unlisted."""
    manifest = ModelLayout(model).manifest
    manifest["format_version"] = 1
    manifest["files"] = {name: {"size": f["size"]} for name, f in manifest["files"].items() if name != JOURNAL_NAME}
    (model / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_format_1_model_opens_and_verify_names_what_it_cannot_check(model, pristine):
    from gguf_checks import logits

    as_format_1(model)
    assert ModelLayout(model).manifest["format_version"] == 1
    assert (logits(model) == logits(pristine[1])).all()
    report = model_report(model)
    uncovered = "config.json, generation_config.json, tokenizer.json, tokenizer_config.json, .colibri-convert.json, colibri.json"
    assert report.ok and [str(f) for f in report.findings] == [
        f"warning: colibri.json: format version 1 records no checksum for {uncovered}: their contents are not checked (convert again for format 2)"]
    config = model / "tokenizer_config.json"
    flip(config, config.read_bytes().index(b'"tokenizer_class": "') + 20, 0x20)  # a letter's case: still valid JSON
    assert model_report(model).ok  # what format 1 cannot see
    flip(model / "experts" / "blk.001.bin", 10, 1)
    assert "error: experts/blk.001.bin: layer 1 expert 0 (bytes" in errors(model_report(model))
    assert len(model_report(model, quick=True).of(WARNING)) == 1


def test_manifest_byte_flips_fail(model):
    raw = (model / MANIFEST_NAME).read_bytes()
    starts = [(m.start(), m.group(1)) for m in re.finditer(rb'\n "(\w+)": ', raw)] + [(len(raw), b"")]
    # self_sha256 covers every key, provenance, converter and config included (they have no second copy)
    spans = [(a, b) for (a, key), (b, _) in zip(starts, starts[1:])]
    rng = random.Random(5)
    trials = 0
    while trials < 25:
        start, end = rng.choice(spans)
        position, mask = rng.randrange(start + 1, end), rng.randrange(1, 256)
        if raw[position] in JSON_WHITESPACE and raw[position] ^ mask in JSON_WHITESPACE:
            continue
        trials += 1
        flip(model / MANIFEST_NAME, position, mask)
        report = model_report(model)
        assert not report.ok, (position, raw[position - 20 : position + 20], mask)
        flip(model / MANIFEST_NAME, position, mask)
    assert model_report(model).ok


def test_nan_scale_names_layer_expert_and_matrix(model):
    layout = ModelLayout(model)
    table = layout.expert_layers[1]
    down = table.matrices["down"]
    position = table.expert_offset(5) + down.offset + SCALE_OFFSETS[down.encoding][0]
    with open(model / table.file, "r+b") as f:
        f.seek(position)
        f.write(b"\x00\x7e")  # f16 NaN as the first block's d
    text = errors(model_report(model))
    assert f"{table.file}: layer 1 expert 5 (bytes" in text
    assert f"{table.file}: layer 1 expert 5 down: blocks with a NaN/Inf scale (1), first at byte {position - SCALE_OFFSETS[down.encoding][0]}" in text


def test_inf_in_float_tensor(tmp_path, pristine):
    convert(str(pristine[0]), tmp_path / "bf16", ConvertOptions(quant="BF16", progress=False))
    layout = ModelLayout(tmp_path / "bf16")
    t = layout.tensors["blk.0.attn_q.weight"]
    with open(tmp_path / "bf16" / t.file, "r+b") as f:
        f.seek(t.offset + 10)
        f.write(b"\x80\x7f")  # bf16 +Inf
    assert f"tensor blk.0.attn_q.weight: NaN/Inf values (1), first at byte {t.offset + 10}" in errors(model_report(tmp_path / "bf16"))


def test_expert_ids_outside_the_experts_are_found(tmp_path):
    src = write_checkpoint(tmp_path / "src", "deepseek_v4")
    convert(str(src), tmp_path / "v4", ConvertOptions(quant="Q8_0", progress=False))
    layout = ModelLayout(tmp_path / "v4")
    assert layout.config.hash_layers and model_report(tmp_path / "v4").ok
    t = layout.tensors[f"blk.{layout.config.hash_layers[0]}.ffn_gate_tid2eid.weight"]
    with open(tmp_path / "v4" / t.file, "r+b") as f:
        f.seek(t.offset + 8)
        f.write(np.float32(layout.config.n_experts).tobytes())  # one past the last expert
    found = f"tensor {t.name}: values that are not expert ids 0..{layout.config.n_experts - 1} (1), first at byte {t.offset + 8}"
    assert found in errors(model_report(tmp_path / "v4"))


def test_missing_manifest_is_an_unfinished_conversion(model):
    (model / MANIFEST_NAME).unlink()
    report = model_report(model)
    assert not report.ok and "colibri.json: no manifest" in errors(report) and "unfinished conversion" in errors(report)


def test_encodings_must_follow_the_recorded_recipe(model):
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    manifest["quant"]["overrides"] = [["ffn_up_exps", "Q8_0"]]
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert re.search(r"encodings contradict recipe Q4_K_M: blk\.\d+\.ffn_up_exps\.weight is Q4_K, not Q8_0", errors(model_report(model, quick=True)))


def test_quick_checks_sizes_not_contents(model):
    expert_file = model / "experts" / "blk.001.bin"
    flip(expert_file, 100, 1)
    assert model_report(model, quick=True).ok and not model_report(model).ok
    size = expert_file.stat().st_size
    with open(expert_file, "r+b") as f:
        f.truncate(size - 4096)
    assert f"experts/blk.001.bin: truncated: has {size - 4096} bytes, the manifest says {size}" in errors(model_report(model, quick=True))
    expert_file.unlink()
    assert "experts/blk.001.bin: missing" in errors(model_report(model, quick=True))


# --- command line ---------------------------------------------------------------------------


def run_cli(add_arguments, command, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return command(parser.parse_args(argv))


def test_cli_json_and_exit_codes(source, model, capsys):
    assert run_cli(add_verify_source_arguments, verify_source_command, [str(source), "--json", "--write-sums"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and set(out) >= {"ok", "errors", "warnings", "files"} and (source / SUMS_NAME).is_file()
    assert all(len(f["sha256"]) == 64 for f in out["files"].values())
    flip(model / "resident.bin", 200, 1)
    assert run_cli(add_verify_arguments, verify_command, [str(model), "--json", "--jobs", "3"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["errors"][0]["file"] == "resident.bin"
    assert run_cli(add_verify_arguments, verify_command, [str(model), "--no-progress"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAILED (1 error): ")
    with pytest.raises(SystemExit):
        run_cli(add_verify_source_arguments, verify_source_command, [str(source), "--quick", "--write-sums"])


def test_cli_user_errors_name_the_argument(tmp_path):
    with pytest.raises(CheckpointError, match=r"^nowhere/at-all/x: no such folder, and not a Hugging Face repo id$"):
        run_cli(add_verify_source_arguments, verify_source_command, ["nowhere/at-all/x"])
    with pytest.raises(FormatError, match=rf"^{tmp_path / 'absent'}: no such folder$"):
        run_cli(add_verify_arguments, verify_command, [str(tmp_path / "absent")])


def test_repo_not_in_cache_is_a_user_error(offline_cache):  # noqa: F811
    with pytest.raises(CheckpointError, match="someorg/absent: not in the local Hugging Face cache"):
        source_report("someorg/absent")
