"""A quantized block unpacked to LLVM IR values: what every block type's unpacker returns."""

from __future__ import annotations


class Block:
    """One block unpacked to IR values. Weight i of sub-block j (32 weights each) is
    `scale * (level - bias) + offset`: `levels[j]` a <32 x i8> (`signed` or not), `scales`
    and `offsets` (or None) one float per sub-block, or per 16 weights when `per16`. The order of the float operations is ggml's (and gguf's).

    Blocks of 256 also carry their integer form, for the dot with Q8_K activations
    (`k_int8_dot`): `d * sum_m int_scales[m // pairs_per_scale] * (level_2m x_2m + level_2m+1
    x_2m+1)` over the 128 pairs of weights, plus `offsets16 . (the sum of x over each 16)`
    (when not None); `int_scales` is a <16 x i16> (<8 x i16> for one scale per 32),
    `offsets16` a <16 x float>.

    Signed levels that are never zero may come as sign and magnitude: `signs[j]` a <32 x i8>
    whose lanes are never zero and have the weights' signs, `magnitudes[j]` their absolute
    values (None: the levels' own). The int8 dot then moves the signs to the activations
    without testing for zero, and never needs the signed levels.

    A block with `int_total` (the K-quants `blocks.INTEGER_TOTALS` names, on CPUs with AVX-512
    VNNI) is multiplied as one integer: `d * xd * isum - dmin * xd * imin`, isum the scaled level
    products less `bias` times the scaled sums of x, imin the sums of x over each 16 times
    `int_mins16` (a <16 x i16>, one per 16 weights; `dmin` the mins' scale). Those few float
    operations in that order are all the rounding a block adds, so any kernel that follows them
    gets the same bits (`int8_tiles` too)."""

    def __init__(self, levels, scales, signed=False, bias=0, offsets=None, per16=False,
                 d=None, int_scales=None, pairs_per_scale=None, offsets16=None, signs=None, magnitudes=None,
                 int_total=False, dmin=None, int_mins16=None):
        self.levels, self.scales, self.signed, self.bias = levels, scales, signed, bias
        self.signs, self.magnitudes = signs, magnitudes
        self.offsets, self.per16 = offsets, per16
        self.d, self.int_scales, self.pairs_per_scale, self.offsets16 = d, int_scales, pairs_per_scale, offsets16
        self.int_total, self.dmin, self.int_mins16 = int_total, dmin, int_mins16


class PerSubBlock:
    """A block's per-sub-block IR values, each emitted when first asked for: a dot that takes
    sub-block j's values just before its products gets them built there, rather than a whole
    block unpacked first (more than AVX2's 16 vector registers hold, so spilled)."""

    def __init__(self, count, make):
        self._make, self._values = make, [None] * count

    def __len__(self):
        return len(self._values)

    def __getitem__(self, j):
        if self._values[j] is None:
            self._values[j] = self._make(j)
        return self._values[j]
