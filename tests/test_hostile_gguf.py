"""GGUFs mutated the ways issue reports found silently accepted: each is refused with one line
naming the file, before anything is written."""

import gguf
import numpy as np
import pytest
from llama_cpp_gguf import write_reference_gguf
from test_gguf_import import refused


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
