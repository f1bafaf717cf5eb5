"""convert.quantize_q4k against the bytes of ggml's own C quantizers (golden vectors)."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from colibri.convert.quantize_q4k import dequantize, quantize

GOLDEN_FILE = Path(__file__).resolve().parent / "data" / "ggml_quants_golden.npz"
MISSING = "golden-file-missing"


def _golden_keys(path: Path, wanted) -> list[str]:
    """Keys `CASE/type` and `CASE/type+imatrix` of `path` with `wanted(type)`, or [MISSING]
    so that the tests fail."""
    if not path.exists():
        return [MISSING]
    with np.load(path) as data:
        keys = data.files
    return sorted(k for k in keys if k.count("/") == 1 and wanted(k.split("/")[1].removesuffix("+imatrix")))


def _load_golden(path: Path) -> dict:
    if not path.exists():
        pytest.fail(f"golden vectors not found at {path} (tests/data/README.md says how they are made)")
    with np.load(path) as data:
        return dict(data)


QUANTIZED_KEYS = _golden_keys(GOLDEN_FILE, lambda kind: kind not in ("input", "imatrix"))
PLAIN_KEYS = [k for k in QUANTIZED_KEYS if "+" not in k]


@pytest.fixture(scope="module")
def golden():
    return _load_golden(GOLDEN_FILE)


def _quantize_case(golden, key):
    """Our bytes for golden key `CASE/type[+imatrix]`, and the qtype name."""
    case, variant = key.split("/")
    qtype = variant.removesuffix("+imatrix").upper()
    imatrix = golden[f"{case}/imatrix"] if variant.endswith("+imatrix") else None
    return quantize(golden[f"{case}/input"], qtype, imatrix), qtype


def _assert_same_bits(actual, expected, what):
    assert actual.shape == expected.shape, what
    differ = np.flatnonzero((actual.view(np.uint32) != expected.view(np.uint32)).any(axis=-1))
    assert differ.size == 0, f"{what}: rows {differ[:10].tolist()} differ"


@pytest.mark.parametrize("key", QUANTIZED_KEYS)
def test_bytes_match_ggml(golden, key):
    ours, _ = _quantize_case(golden, key)
    expected = golden[key]
    assert ours.dtype == np.uint8 and ours.shape == expected.shape
    differ = np.flatnonzero((ours != expected).any(axis=-1))
    assert differ.size == 0, f"{key}: rows {differ[:10].tolist()} differ from ggml's bytes"


@pytest.mark.parametrize("key", QUANTIZED_KEYS)
def test_dequantize_matches_gguf_py(golden, key):
    ours, qtype = _quantize_case(golden, key)
    n = golden[f"{key.split('/')[0]}/input"].shape[-1]
    reference = gguf.quants.dequantize(ours, gguf.GGMLQuantizationType[qtype])
    _assert_same_bits(dequantize(ours, qtype, n), reference, f"{key} vs gguf-py")


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_dequantize_matches_ggml(golden, key):
    qtype = key.split("/")[1].upper()
    expected = golden[f"{key}/dequant"]
    _assert_same_bits(dequantize(golden[key], qtype, expected.shape[-1]), expected, f"{key} vs ggml")


def test_float_types_round_trip():
    rng = np.random.default_rng(0)  # magnitudes 1e-4 .. 1e4: normal numbers in F16 and BF16
    x = (rng.choice([-1.0, 1.0], (8, 512)) * 10.0 ** rng.uniform(-4, 4, (8, 512))).astype(np.float32)
    assert np.array_equal(dequantize(quantize(x, "F32"), "F32", 512), x)
    f16 = dequantize(quantize(x, "F16"), "F16", 512)
    assert np.array_equal(f16, x.astype(np.float16).astype(np.float32))
    assert np.all(np.abs(f16 - x) <= np.abs(x) * 2.0**-11)
    bf16 = dequantize(quantize(x, "BF16"), "BF16", 512)
    assert np.all(np.abs(bf16 - x) <= np.abs(x) * 2.0**-8)


def test_bf16_rounds_to_even_and_quiets_nan():
    bits = np.array([0x3F808000,   # 1 + 2**-8: tie, rounds down to the even 0x3F80
                     0x3F818000,   # tie, rounds up to the even 0x3F82
                     0x3F808001,   # just above the tie: rounds up
                     0x7F800001,   # signalling NaN: made quiet
                     0xFF800000],  # -inf stays
                    dtype=np.uint32)
    encoded = quantize(bits.view(np.float32), "BF16").view(np.uint16)
    assert encoded.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7FC0, 0xFF80]


def test_leading_dimensions_and_q8_0_ignores_imatrix():
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    imatrix = np.linspace(0.1, 2.0, 64, dtype=np.float32)
    data = quantize(x, "Q8_0")
    assert data.shape == (2, 3, 68)
    assert np.array_equal(quantize(x, "Q8_0", imatrix), data)
    assert dequantize(data, "Q8_0", 64).shape == (2, 3, 64)


@pytest.mark.parametrize("qtype, n, block", [("Q4_K", 300, 256), ("Q6_K", 128, 256),
                                             ("Q8_0", 48, 32), ("Q5_1", 100, 32)])
def test_row_length_must_fill_whole_blocks(qtype, n, block):
    with pytest.raises(ValueError, match=f"{n} is not a multiple of {block}"):
        quantize(np.zeros((2, n), np.float32), qtype)
    with pytest.raises(ValueError, match=f"{n} is not a multiple of {block}"):
        dequantize(np.zeros((2, 10), np.uint8), qtype, n)


ALL_TYPES_FILE = Path(__file__).resolve().parent / "data" / "ggml_quants_golden_all.npz"
# the types convert.quantize_q4k makes
OURS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
        "TQ1_0", "TQ2_0", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")


@pytest.fixture(scope="module")
def golden_all():
    return _load_golden(ALL_TYPES_FILE)


@pytest.mark.parametrize("key", _golden_keys(ALL_TYPES_FILE, lambda kind: kind in OURS))
def test_bytes_match_ggml_0c1e570(golden_all, key):
    """The same against the file ggml 0.25.3 made for every type, with and without an imatrix."""
    ours, qtype = _quantize_case(golden_all, key)
    variant = key.split("/")[1]
    differ = np.flatnonzero((ours != golden_all[key]).any(axis=-1))
    assert differ.size == 0, f"{key}: rows {differ[:10].tolist()} differ from ggml's bytes"
    if "+" not in variant:
        expected = golden_all[f"{key}/dequant"]
        _assert_same_bits(dequantize(golden_all[key], qtype, expected.shape[-1]), expected, f"{key} vs ggml")
