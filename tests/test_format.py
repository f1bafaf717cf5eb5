"""The layout's reader refuses what the spec says it must refuse; parsers survive fuzzing."""

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.formats.checkpoint import CheckpointError, read_header
from colibri.formats.encodings import EncodingError, row_bytes, tensor_bytes
from colibri.formats.config_check import expected_tensors
from colibri.formats.layout import FORMAT_VERSION, FormatError, ModelLayout, load_manifest, validate_manifest, write_manifest
from colibri.formats.model_config import ModelConfig

SHA = "0" * 64


CONFIG = {"architecture": "mixtral", "gguf_architecture": "LLAMA", "vocab_size": 8, "hidden_size": 256,
          "n_layers": 1, "n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "v_head_dim": 64, "norm_eps": 1e-5,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_dim": 64, "moe_layers": [0],
          "n_experts": 2, "n_experts_used": 1, "expert_ffn": 1}
MATRIX_BYTES = 256 * 4  # each expert matrix is F32 [1, 256] or [256, 1]


def minimal_manifest():
    """A complete one-layer model: output_norm first in resident.bin (F32 [256]), then every
    other tensor its config implies, and two experts of three F32 matrices in one layer."""
    tensors, offset = {}, 0
    names = sorted(expected_tensors(ModelConfig.from_dict(CONFIG)).items(), key=lambda kv: kv[0] != "output_norm.weight")
    for name, shape in names:
        nbytes = 4 * math.prod(shape)
        tensors[name] = {"file": "resident.bin", "offset": offset, "nbytes": nbytes, "encoding": "F32",
                         "shape": list(shape), "sha256": SHA}
        offset += -(-nbytes // 64) * 64
    shapes = {"gate": [1, 256], "up": [1, 256], "down": [256, 1]}
    return {
        "format": "colibri", "format_version": FORMAT_VERSION, "converter": {"name": "t", "version": "0"},
        "config": dict(CONFIG),
        "quant": {"recipe": "Q4_K_M", "overrides": [], "imatrix": None},
        "provenance": {"source": "x", "revision": None, "source_files": {}, "skipped_tensors": []},
        "files": {"resident.bin": {"size": offset}, "experts/blk.000.bin": {"size": 8192}},
        "tensors": tensors,
        "expert_layers": [{
            "layer": 0, "file": "experts/blk.000.bin", "offset": 0, "stride": 4096, "count": 2, "expert_bytes": 3 * MATRIX_BYTES,
            "matrices": {m: {"encoding": "F32", "shape": shapes[m], "offset": i * MATRIX_BYTES, "nbytes": MATRIX_BYTES}
                         for i, m in enumerate(("gate", "up", "down"))},
            "sha256": [SHA, SHA],
        }],
        "tokenizer_files": [],
    }


def test_sizes_follow_ggml_blocks():
    assert row_bytes("Q4_K", 512) == 288
    assert row_bytes("Q6_K", 256) == 210
    assert row_bytes("Q8_0", 64) == 68
    assert tensor_bytes("BF16", (3, 5)) == 30
    with pytest.raises(EncodingError, match="multiple of 256"):
        row_bytes("Q4_K", 300)
    assert row_bytes("Q3_K", 256) == 110 and row_bytes("Q4_0", 64) == 36
    assert row_bytes("IQ2_XXS", 512) == 132 and row_bytes("MXFP4", 64) == 34
    with pytest.raises(EncodingError, match="unknown encoding"):
        row_bytes("NVFP4", 256)


def test_minimal_manifest_is_valid_and_round_trips(tmp_path):
    manifest = minimal_manifest()
    validate_manifest(manifest)
    write_manifest(tmp_path, manifest)
    assert load_manifest(tmp_path) == manifest
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("breakage, message", [
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), "newer than this reader"),
    (lambda m: m["files"].update({"config.json": {"size": 2}}), "files/config.json has no sha256"),
    (lambda m: m.update(format="gguf"), "invalid manifest"),
    (lambda m: m["tensors"]["output_norm.weight"].update(nbytes=1000), "needs 1024"),
    (lambda m: m["tensors"]["output_norm.weight"].update(offset=3), "invalid manifest at tensors/output_norm.weight/offset"),
    (lambda m: m["expert_layers"][0].update(stride=4000), "invalid manifest"),
    (lambda m: m["expert_layers"][0]["matrices"]["up"].update(offset=0), "inconsistent offset"),
    (lambda m: m["expert_layers"][0].update(sha256=[SHA]), "1 checksums for 2 experts"),
    # a wide manifest's expert checksums are checked in a loop of their own; the schema's message stays
    (lambda m: m["expert_layers"][0]["sha256"].__setitem__(1, "A" * 64), "invalid manifest at expert_layers/0/sha256/1"),
    (lambda m: m["expert_layers"][0]["sha256"].__setitem__(1, 7), "invalid manifest at expert_layers/0/sha256/1"),
    (lambda m: m["expert_layers"][0].update(sha256="0" * 64), "invalid manifest at expert_layers/0/sha256"),
    (lambda m: m["files"].update({"../escape": {"size": 1}}), "invalid manifest"),
    (lambda m: m.update(extra=1), "invalid manifest"),
])
def test_reader_refuses_broken_manifests(breakage, message):
    manifest = minimal_manifest()
    breakage(manifest)
    with pytest.raises(FormatError, match=message):
        validate_manifest(manifest)


def test_missing_and_garbage_manifest(tmp_path):
    with pytest.raises(FormatError, match="unfinished conversion"):
        load_manifest(tmp_path)
    (tmp_path / "colibri.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_manifest_checks_itself(tmp_path):
    manifest = minimal_manifest()
    write_manifest(tmp_path, manifest)
    path = tmp_path / "colibri.json"
    raw = path.read_bytes()
    assert json.loads(raw)["self_sha256"] != "0" * 64  # the other checksums here are zeros; only its own slot is filled
    position = raw.index(b'"Q4_K_M"') + 3  # Q4_K_M -> Q5_K_M: still a valid recipe
    path.write_bytes(raw[:position] + b"5" + raw[position + 1 :])
    with pytest.raises(FormatError, match="colibri.json: sha256 mismatch: the manifest changed after it was written"):
        load_manifest(tmp_path)
    path.write_bytes(json.dumps(manifest).encode())
    with pytest.raises(FormatError, match="no self_sha256"):
        load_manifest(tmp_path)


def test_format_1_manifest_is_read(tmp_path):
    """Format 1: no self_sha256, and files without a sha256 (tokenizer files unchecked)."""
    manifest = minimal_manifest()
    manifest["format_version"] = 1
    manifest["files"]["config.json"] = {"size": 2}
    manifest["tokenizer_files"] = ["config.json"]
    (tmp_path / "colibri.json").write_text(json.dumps(manifest))
    assert load_manifest(tmp_path) == manifest


def test_reader_locates_experts_and_checks_file_sizes(tmp_path):
    manifest = minimal_manifest()
    (tmp_path / "experts").mkdir()
    resident = np.zeros(manifest["files"]["resident.bin"]["size"], np.uint8)
    resident[:1024] = np.arange(256, dtype=np.float32).view(np.uint8)
    (tmp_path / "resident.bin").write_bytes(resident.tobytes())
    data = np.zeros(8192, np.uint8)
    data[4096:4096 + 3 * MATRIX_BYTES] = 7
    (tmp_path / "experts/blk.000.bin").write_bytes(data.tobytes())
    write_manifest(tmp_path, manifest)
    layout = ModelLayout(tmp_path)
    assert np.array_equal(layout.tensor_data("output_norm.weight").view(np.float32), np.arange(256, dtype=np.float32))
    assert (layout.expert_data(0, 1) == 7).all() and layout.expert_data(0, 1).size == 3 * MATRIX_BYTES
    assert layout.expert_matrix_data(0, 1, "down").size == MATRIX_BYTES
    with pytest.raises(IndexError):
        layout.expert_data(0, 2)
    (tmp_path / "experts/blk.000.bin").write_bytes(data[:5000].tobytes())
    with pytest.raises(FormatError, match="expected 8192 bytes, found 5000"):
        ModelLayout(tmp_path).expert_data(0, 0)


def write_safetensors(path, header: dict, payload: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)


def test_header_checks(tmp_path):
    f = tmp_path / "a.safetensors"
    write_safetensors(f, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16))
    assert read_header(f)["w"].shape == (2, 2)
    write_safetensors(f, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(10))
    with pytest.raises(CheckpointError, match="a.safetensors: truncated: header declares .* file has"):
        read_header(f)
    write_safetensors(f, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match="needs 24"):
        read_header(f)
    write_safetensors(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(f)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_header_parser_fuzz_never_crashes(tmp_path, data):
    f = tmp_path / "fuzz.safetensors"
    f.write_bytes(data)
    try:
        read_header(f)
    except CheckpointError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(key_path=st.lists(st.sampled_from(["tensors", "expert_layers", "files", "config", "quant", 0, "matrices", "gate", "output_norm.weight"]), min_size=1, max_size=4),
       value=json_values)
def test_manifest_fuzz_is_refused_cleanly_or_accepted(key_path, value):
    manifest = minimal_manifest()
    node = manifest
    for key in key_path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(node, dict):
        node[key_path[-1]] = value
    try:
        validate_manifest(manifest)
    except FormatError:
        pass
