"""GGUFs mutated the ways issue reports found silently accepted: each is refused with one line
naming the file, before anything is written."""

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_cpp_gguf import write_reference_gguf
from test_gguf_import import refused, rewrite_gguf


@pytest.fixture
def source(checkpoint, tmp_path):
    return write_reference_gguf(checkpoint("qwen3_moe", dtype="f32"), tmp_path / "model.gguf")


def field_position(path, part) -> int:
    """The byte position in the file of one part (a numpy view) of a GGUFReader field."""
    reader = gguf.GGUFReader(path)
    return part(reader).ctypes.data - reader.data.ctypes.data


def poke(path, position: int, value: int, dtype=np.uint64):
    with open(path, "r+b") as f:
        f.seek(position)
        f.write(np.array([value], dtype).tobytes())


def tensor_part(index: int, part: int):
    return lambda reader: reader.tensors[index].field.parts[part]


def relative_offset(path, index: int) -> int:
    return int(gguf.GGUFReader(path).tensors[index].field.parts[5][0])


@pytest.mark.parametrize("change", ["+1", "+32", "-32", "same as the previous", "wrapping past 2**64"])
def test_shifted_tensor_offset(source, tmp_path, capsys, change):
    index = 3
    offset = relative_offset(source, index)
    new = {"+1": offset + 1, "+32": offset + 32, "-32": offset - 32,
           "same as the previous": relative_offset(source, index - 1),
           "wrapping past 2**64": offset + 2**64 - 32 if offset >= 32 else 2**64 - 32}[change]
    poke(source, field_position(source, tensor_part(index, 5)), new % 2**64)
    refused(capsys, tmp_path, source, "starts at data offset")


def test_last_tensor_past_the_end(source, tmp_path, capsys):
    count = len(gguf.GGUFReader(source).tensors)
    poke(source, field_position(source, tensor_part(count - 1, 5)), 2**64 - 64)
    refused(capsys, tmp_path, source)


@pytest.mark.parametrize("new_type", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0,
                                      gguf.GGMLQuantizationType.BF16])
def test_tensor_type_swapped_for_another_valid_one(source, tmp_path, capsys, new_type):
    reader = gguf.GGUFReader(source)
    index = next(i for i, t in enumerate(reader.tensors[:-1]) if t.tensor_type == gguf.GGMLQuantizationType.F32
                 and t.shape[0] % 32 == 0)
    poke(source, field_position(source, tensor_part(index, 4)), int(new_type), np.uint32)
    refused(capsys, tmp_path, source, reader.tensors[index + 1].name)


def test_shape_that_is_not_whole_blocks(source, tmp_path, capsys):
    reader = gguf.GGUFReader(source)
    index = next(i for i, t in enumerate(reader.tensors) if len(t.shape) == 2)
    poke(source, field_position(source, tensor_part(index, 3)), 0)
    refused(capsys, tmp_path, source, "shape")


def test_metadata_string_that_is_not_utf8(source, tmp_path, capsys):
    reader = gguf.GGUFReader(source)
    field = reader.get_field("general.architecture")
    position = field.parts[-1].ctypes.data - reader.data.ctypes.data
    with open(source, "r+b") as f:
        f.seek(position)
        f.write(b"\xff")
    refused(capsys, tmp_path, source)


@pytest.mark.parametrize("key, value, kind", [
    ("qwen3moe.rope.freq_base", 1_232_348_160, gguf.GGUFValueType.UINT32),  # a float's bits read as an integer
    ("qwen3moe.block_count", 2.0, gguf.GGUFValueType.FLOAT32),
    ("qwen3moe.expert_count", True, gguf.GGUFValueType.BOOL),
    ("qwen3moe.attention.layer_norm_rms_epsilon", "1e-6", gguf.GGUFValueType.STRING),
])
def test_metadata_key_of_the_wrong_type(source, tmp_path, capsys, key, value, kind):
    """llama.cpp refuses a key whose type is not the one its loader reads; so do we."""
    wrong = rewrite_gguf(source, tmp_path / "wrong.gguf", keys={key: value}, types={key: kind})
    refused(capsys, tmp_path, wrong, f"metadata {key} is")


def test_norm_stored_block_quantized(source, tmp_path, capsys):
    def q3_k(name, data, kind):
        if name == "output_norm.weight":
            return np.zeros(110 * data.shape[0] // 256, np.uint8), gguf.GGMLQuantizationType.Q3_K
        return data, kind

    wrong = rewrite_gguf(source, tmp_path / "q3k-norm.gguf", tensor=q3_k)
    refused(capsys, tmp_path, wrong, "vectors stored block-quantized", "output_norm.weight (Q3_K)")


@pytest.fixture(scope="module")
def pristine_gguf(tmp_path_factory):
    from colibri.convert.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("gguf-fuzz")
    return write_reference_gguf(write_checkpoint(root / "src", "mixtral", dtype="f32"), root / "model.gguf")


@settings(max_examples=400, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_gguf_header(pristine_gguf, tmp_path_factory, data):
    """Bytes of the header (metadata and tensor infos) overwritten at random: planning the
    import refuses with a one-line GGUFError naming the file, or succeeds; never anything else."""
    from colibri.convert.gguf_to_colibri import gguf_job
    from colibri.convert.pipeline import ConvertError, ConvertOptions

    raw = bytearray(pristine_gguf.read_bytes())
    header_end = int(gguf.GGUFReader(pristine_gguf).data_offset)
    infos = header_end - 64 * 40  # the tensor infos sit at the end of the header
    for _ in range(data.draw(st.integers(1, 6))):
        where = data.draw(st.integers(0, 24) | st.integers(max(infos, 0), header_end - 1) | st.integers(0, header_end - 1))
        raw[where] = data.draw(st.integers(0, 255))
    case = tmp_path_factory.mktemp("gguf") / "model.gguf"
    case.write_bytes(bytes(raw))
    try:
        gguf_job(str(case), ConvertOptions(progress=False))
    except ConvertError as e:
        assert "\n" not in str(e) and "model.gguf" in str(e), str(e)
