"""A conversion killed with SIGKILL and rerun produces byte-identical output; the finished
journal is covered by the manifest."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.pipeline import ConvertError
from colibri.convert.synthetic import tiny_config, write_checkpoint
from colibri.formats.layout import ModelLayout

JOURNAL = ".colibri-convert.json"


def model_files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != JOURNAL}


def journalled_units(out):
    try:
        return len(json.loads((out / JOURNAL).read_text())["units"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def start_conversion(src, out, workers):
    command = [sys.executable, "-m", "colibri.cli", "convert", str(src), str(out), "--no-progress", "--workers", str(workers)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_sigkill_then_rerun_is_byte_identical(tmp_path):
    config = tiny_config("mixtral", num_hidden_layers=12, intermediate_size=1024)
    src = write_checkpoint(tmp_path / "src", "mixtral", config=config)
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert start_conversion(src, reference, workers=1).wait() == 0

    for workers in (1, 2):  # kill a single-process run, then kill the resumed run with workers
        process = start_conversion(src, out, workers)
        deadline = time.monotonic() + 120
        target = journalled_units(out) + 2
        while journalled_units(out) < target and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.poll() is None, "conversion finished before it could be killed; make the fixture bigger"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        assert not (out / "colibri.json").exists()
        assert 0 < journalled_units(out) < 13

    rerun = start_conversion(src, out, workers=2)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr.decode()
    assert "resumed" in stdout.decode()
    assert model_files(out) == model_files(reference)
    assert (out / JOURNAL).read_bytes() == (reference / JOURNAL).read_bytes()  # the manifest records its sha256
    assert not list(out.rglob("*.partial"))


def test_finished_journal_is_checksummed_and_trusted_only_intact(checkpoint, tmp_path):
    src, out = str(checkpoint("mixtral")), tmp_path / "out"
    convert(src, out, ConvertOptions(progress=False))
    raw = (out / JOURNAL).read_bytes()
    assert ModelLayout(out).manifest["files"][JOURNAL] == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    manifest = (out / "colibri.json").read_bytes()
    (out / JOURNAL).write_bytes(raw.replace(b'"sha256": [\n', b'"sha256":  [\n', 1))  # still valid JSON, same units
    with pytest.raises(ConvertError, match=f"{JOURNAL}: differs from the sha256 colibri.json records; use --force"):
        convert(src, out, ConvertOptions(progress=False))
    convert(src, out, ConvertOptions(progress=False, force=True))
    assert (out / JOURNAL).read_bytes() == raw and (out / "colibri.json").read_bytes() == manifest
