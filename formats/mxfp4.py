"""MXFP4 tensors as gpt-oss and DeepSeek-V4 checkpoints store them, and their GGML MXFP4 blocks.

A gpt-oss weight `P` is two uint8 tensors: `P_blocks` [..., groups, 16], 32 FP4 (E2M1) codes a
group, two a byte (the even element in the low nibble), and `P_scales` [..., groups], one E8M0
exponent a group (value = E2M1[code] × 2^(scale − 127)). DeepSeek-V4's routed experts hold the
same as `P.weight` (I8 or U8 [rows, cols / 2]) and `P.scale` (F8_E8M0 [rows, cols / 32]).
GGML's MXFP4 block holds the same codes and the same exponent byte (its table is the E2M1 values
doubled, its scale 2^(e − 128)), only the nibbles are placed otherwise: element j < 16 in the
low nibble of byte j, element j + 16 in its high nibble. So a block converts exactly, byte for
byte.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from colibri.formats.encodings import MXFP4_VALUES

BLOCKS, SCALES = "_blocks", "_scales"
PACKED_WEIGHT, PACKED_SCALE = ".weight", ".scale"  # DeepSeek-V4's pair
GROUP = 32  # weights a scale covers


class Mxfp4Error(ValueError):
    """_blocks / _scales tensors that do not describe one weight; the message names them."""


@dataclass(frozen=True)
class Mxfp4Weight:
    name: str  # the weight they stand for: P
    blocks: object  # TensorEntry of P_blocks
    scales: object  # TensorEntry of P_scales

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape: the blocks' leading axes, then groups × 32 values."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * GROUP)


def find_mxfp4(tensors: dict) -> dict[str, Mxfp4Weight]:
    """The MXFP4 weights among `tensors` (name -> TensorEntry), each checked against its scales."""
    found = {}
    for name, blocks in tensors.items():
        if not name.endswith(BLOCKS):
            continue
        base = name[:-len(BLOCKS)]
        scales = tensors.get(base + SCALES)
        where = blocks.file.name
        if scales is None:
            raise Mxfp4Error(f"{where}: {name} lacks its {base + SCALES}")
        if blocks.dtype != "U8" or len(blocks.shape) < 3 or blocks.shape[-1] != GROUP // 2:
            raise Mxfp4Error(f"{where}: {name} is {blocks.dtype} {list(blocks.shape)}, not U8 [..., groups, 16]")
        if scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise Mxfp4Error(f"{scales.file.name}: {base + SCALES} is {scales.dtype} {list(scales.shape)}, not U8 "
                             f"{list(blocks.shape[:-1])} (a scale for each group of {name})")
        found[base] = Mxfp4Weight(base, blocks, scales)
    found.update(_packed_pairs(tensors))
    return found


def _packed_pairs(tensors: dict) -> dict[str, Mxfp4Weight]:
    """DeepSeek-V4's `P.weight` + `P.scale` pairs (an FP8 weight's `.scale` scales F8_E4M3, not bytes)."""
    found = {}
    for name, weight in tensors.items():
        scale = tensors.get(name.removesuffix(PACKED_WEIGHT) + PACKED_SCALE) if name.endswith(PACKED_WEIGHT) else None
        if scale is None or weight.dtype not in ("I8", "U8"):
            continue
        if len(weight.shape) != 2 or weight.shape[1] % (GROUP // 2):
            raise Mxfp4Error(f"{weight.file.name}: {name} is {weight.dtype} {list(weight.shape)}, not [rows, 16 × groups]")
        groups = weight.shape[1] // (GROUP // 2)
        if scale.dtype != "F8_E8M0" or tuple(scale.shape) != (weight.shape[0], groups):
            raise Mxfp4Error(f"{scale.file.name}: {scale.name} is {scale.dtype} {list(scale.shape)}, not F8_E8M0 "
                             f"[{weight.shape[0]}, {groups}] (a scale for each group of {name})")
        found[name] = Mxfp4Weight(name, replace(weight, dtype="U8", shape=(weight.shape[0], groups, GROUP // 2)),
                                  replace(scale, dtype="U8"))
    return found


def codes(blocks: np.ndarray) -> np.ndarray:
    """The FP4 codes [..., groups, 32] of checkpoint blocks [..., groups, 16]."""
    out = np.empty((*blocks.shape[:-1], GROUP), np.uint8)
    out[..., 0::2] = blocks & 0x0F
    out[..., 1::2] = blocks >> 4
    return out


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., groups × 32]: each code's E2M1 value times its group's power of two, exact."""
    halves = MXFP4_VALUES[codes(blocks)].astype(np.float32)  # twice the E2M1 values
    values = np.ldexp(halves, scales.astype(np.int32)[..., None] - 128)
    return values.reshape(*blocks.shape[:-2], -1)


def ggml_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGML MXFP4 bytes [..., groups × 17] of checkpoint blocks [..., groups, 16] and their
    scales [..., groups]: the exponent byte, then the codes in GGML's nibble order."""
    c = codes(blocks)
    out = np.empty((*blocks.shape[:-1], 1 + GROUP // 2), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = c[..., :16] | (c[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], -1)


def checkpoint_blocks(ggml: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `ggml_blocks`: GGML MXFP4 bytes [..., groups × 17] -> (blocks [..., groups,
    16], scales [..., groups]) as a gpt-oss checkpoint stores them."""
    grouped = ggml.reshape(*ggml.shape[:-1], -1, 1 + GROUP // 2)
    qs = grouped[..., 1:]
    c = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8), grouped[..., 0].copy()
