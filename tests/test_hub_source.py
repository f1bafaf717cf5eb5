"""SRC as a hub repo id: resolved from the local Hugging Face cache when offline."""

import hashlib
import shutil

import huggingface_hub.constants as hub_constants
import pytest

from colibri.convert.hf_to_colibri import ConvertError, ConvertOptions, convert
from colibri.formats.layout import ModelLayout


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def fake_hub_cache(cache, repo_id, source, revision="0123456789abcdef0123456789abcdef01234567"):
    """The HF cache layout: blobs named by content hash, snapshot files as symlinks to them."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot, blobs = repo / "snapshots" / revision, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in source.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blobs / digest)
        (snapshot / path.name).symlink_to(f"../../blobs/{digest}")
    return revision


def test_repo_id_from_offline_cache(checkpoint, tmp_path, offline_cache):
    src = checkpoint("olmoe")
    revision = fake_hub_cache(offline_cache, "someorg/tiny-olmoe", src)
    convert("someorg/tiny-olmoe", tmp_path / "out", ConvertOptions(quant="Q8_0", progress=False))
    provenance = ModelLayout(tmp_path / "out").manifest["provenance"]
    assert provenance["source"] == "someorg/tiny-olmoe" and provenance["revision"] == revision
    files = provenance["source_files"]
    assert files and all(len(f["sha256"]) == 64 for f in files.values())  # taken from the blob names


def test_unknown_repo_offline_is_a_clear_error(tmp_path, offline_cache):
    with pytest.raises(ConvertError, match="someorg/absent: cannot download .* not in the local Hugging Face cache"):
        convert("someorg/absent", tmp_path / "out", ConvertOptions(progress=False))
    assert not (tmp_path / "out").exists()
