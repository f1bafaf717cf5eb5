"""compressed-tensors' pack-quantized INT4 weights, as Kimi-K2-Thinking and Kimi-K2.5/2.6 ship
their routed experts.

A weight `P.weight` [rows, cols] is stored as three tensors: `P.weight_packed` (I32 [rows,
cols / 8]: eight 4-bit values per int32, the first in the lowest bits, each the signed level
plus 8), `P.weight_scale` ([rows, cols / group], BF16, F16 or F32: one scale per group of
consecutive columns) and `P.weight_shape` ([2]: rows, cols). Weight = scale × level, levels
-8..7 (symmetric: no zero point). Read little-endian, the packed bytes hold the levels in
column order, two a byte, the first in the low nibble.

GGML's Q4_0 (`d · (nibble − 8)` per 32 weights, d an f16) holds these values exactly when the
group is 32 and each scale is an f16 (a BF16 scale is one from 2⁻¹⁷ to 65504, its 8
significant bits within f16's): `q4_0_blocks` rewrites the nibbles, no float in between.

Its FP8 scheme (Kimi-K2.5/2.6's attention) stores plain F8_E4M3 weights beside a
`P.weight_scale` (one per tensor, per row, or per 128 × 128 block), which the checkpoint reader
multiplies in as it does DeepSeek's `weight_scale_inv`; `scheme_problem` checks both schemes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
SCALE_DTYPES = ("BF16", "F16", "F32")
Q4_0_GROUP = 32
FP8_STRATEGIES = ("tensor", "channel", "block")


class PackedWeightError(ValueError):
    """Packed tensors that do not describe one weight; the message names them."""


@dataclass(frozen=True)
class PackedWeight:
    name: str  # the weight they stand for: P.weight
    packed: object  # TensorEntry of P.weight_packed
    scale: object  # TensorEntry of P.weight_scale
    shape_entry: object  # TensorEntry of P.weight_shape
    rows: int
    cols: int

    @property
    def group(self) -> int:
        return self.cols // self.scale.shape[1]

    @property
    def component_names(self) -> tuple[str, str, str]:
        return self.packed.name, self.scale.name, self.shape_entry.name


def scheme_problem(config: dict) -> str | None:
    """Why config.json's quantization_config describes weights other than symmetric INT4 in
    groups or 8-bit floats per tensor, row or 128 x 128 block (the ones read here), or None."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "compressed-tensors":
        return None
    groups = quantization.get("config_groups")
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            continue
        if weights.get("type", "int") == "float":  # FP8 weights are plain tensors with a `.weight_scale`
            if weights.get("num_bits", 8) != 8 or weights.get("strategy", "tensor") not in FP8_STRATEGIES \
                    or weights.get("strategy") == "block" and list(weights.get("block_structure") or []) != [128, 128]:
                return (f"quantization_config group {name}: float weights of {weights.get('num_bits')} bits, strategy "
                        f"{weights.get('strategy')!r}, blocks {weights.get('block_structure')} (supported: 8 bits "
                        f"per tensor, per channel, or in 128 x 128 blocks)")
            continue
        wanted = {"num_bits": 4, "symmetric": True, "strategy": "group"}
        wrong = [f"{k} {weights.get(k)!r}" for k, v in wanted.items() if weights.get(k, v) != v]
        if wrong:
            return f"quantization_config group {name}: {', '.join(wrong)} (supported: 4-bit symmetric groups)"
    return None


def find_packed(tensors: dict, read_shape) -> dict[str, PackedWeight]:
    """The packed weights among `tensors` (name -> TensorEntry), checked: each needs its scale
    and shape, a shape that agrees with both, and whole groups. `read_shape(entry)` gives the
    values of a weight_shape tensor."""
    found = {}
    for name, packed in tensors.items():
        if not name.endswith(PACKED):
            continue
        base = name[:-len(PACKED)]
        scale, shape_entry = tensors.get(base + SCALE), tensors.get(base + SHAPE)
        where = packed.file.name
        if scale is None or shape_entry is None:
            raise PackedWeightError(f"{where}: {name} lacks its {SCALE if scale is None else SHAPE}")
        if packed.dtype != "I32" or len(packed.shape) != 2:
            raise PackedWeightError(f"{where}: {name} is {packed.dtype} {list(packed.shape)}, not I32 [rows, cols / 8]")
        if shape_entry.dtype not in ("I32", "I64") or shape_entry.shape != (2,):
            raise PackedWeightError(f"{shape_entry.file.name}: {base + SHAPE} is {shape_entry.dtype} "
                                    f"{list(shape_entry.shape)}, not two integers")
        rows, cols = (int(v) for v in read_shape(shape_entry))
        if (rows, cols) != (packed.shape[0], packed.shape[1] * 8):
            raise PackedWeightError(f"{shape_entry.file.name}: {base + SHAPE} says [{rows}, {cols}], the packed data "
                                    f"holds [{packed.shape[0]}, {packed.shape[1] * 8}]")
        if scale.dtype not in SCALE_DTYPES or len(scale.shape) != 2 or scale.shape[0] != rows or not scale.shape[1] \
                or cols % scale.shape[1]:
            raise PackedWeightError(f"{scale.file.name}: {base + SCALE} is {scale.dtype} {list(scale.shape)}, not a "
                                    f"float [{rows}, {cols} / group] for whole groups")
        found[base + ".weight"] = PackedWeight(base + ".weight", packed, scale, shape_entry, rows, cols)
    return found


def nibbles(packed: np.ndarray, cols: int) -> np.ndarray:
    """The stored 4-bit values [rows, cols] (level + 8) of packed bytes [rows, cols / 2]."""
    packed = packed.reshape(-1, cols // 2)
    out = np.empty((packed.shape[0], cols), np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def levels(packed: np.ndarray, cols: int) -> np.ndarray:
    """int8 levels [rows, cols] (-8..7) of packed bytes [rows, cols / 2]."""
    return nibbles(packed, cols).astype(np.int8) - 8


def dequantize(packed: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """float32 [rows, cols]: scale × level, exact (a 4-bit level times a float32 scale)."""
    values = levels(packed, cols).astype(np.float32)
    return values * np.repeat(scales.astype(np.float32), cols // scales.shape[1], axis=1)


def q4_0_blocks(packed: np.ndarray, scales: np.ndarray, cols: int) -> np.ndarray:
    """Q4_0 bytes [rows, cols / 32 × 18] holding the same weights (group 32); a scale that is
    not an f16 value is rounded to the nearest one."""
    rows = packed.size // (cols // 2)
    values = nibbles(packed, cols).reshape(rows, cols // 32, 32)  # Q4_0's nibbles are the same level + 8
    blocks = np.empty((rows, cols // 32, 18), np.uint8)
    blocks[:, :, :2] = scales.astype(np.float32).astype(np.float16).reshape(rows, -1, 1).view(np.uint8)
    blocks[:, :, 2:] = values[:, :, :16] | (values[:, :, 16:] << 4)
    return blocks.reshape(rows, -1)
