"""The grid types, whose groups of 8 (IQ1, IQ2) or 4 (IQ3) weights are one point of a fixed
lattice: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M.

ggml's `iq2xs_init_impl` and `iq3xs_init_impl` build, for each lattice, the quantizer's view of
it: every point as levels 2l + 1 (l in 0..2 per weight for IQ1 and IQ2, 0..7 for IQ3), a map
from the level tuples to the point each is (-1 when it is none), and for every tuple off the lattice
its neighbours: the points at its smallest distances (as many distinct distances as the type
asks), ordered by distance, then index. `lattice` builds the same tables from the
dequantizer's grid (`formats.iq_grids`), whose values rise with l, so their ranks are the
levels; it lists neighbours only for the tuples a quantizer can look up (ggml lists them for
tuples with a level of 3 too, which changes where lists sit, not what they hold).

Every IQ2 and IQ3 type runs one search per sub-block (`_search`): a scale tried at steps either
side of a first guess, every group of weights rounded to its levels and, off the lattice, to its best
neighbour; the best weighted least-squares fit is kept, and groups off the lattice are placed
again at the final scale. What differs between the types is its rule: how many steps of what
size, the levels, and which groups the final pass places again. Around it each type has its
own signs (IQ2_XXS, IQ2_XS and IQ3_XXS keep 7 sign bits a group of 8, the eighth implied by an
even count of negatives), weights and packing, as `quantize_row_<type>_impl` does, float for
float. The IQ1 types (levels −1, 0, 1 moved by ±1/8) instead try every split of each
sub-block's sorted weights into three, as ggml does, then move groups off the lattice to their
nearest listed point.

`quantize_<type>(rows f32[r, n], imatrix f32[n] or empty, out u8[r, row_bytes])`.
"""

from functools import cache

import numpy as np

from numba import njit

from colibri.convert.quantize_q4k.scalars import block_bytes, nearest_int, njit_c, store_fp16, sum_of_squares
from colibri.convert.quantize_q4k.searches import make_qp_quants
from colibri.formats.iq_grids import grid

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)
GROUP_MAX_EPS_SMALL = F32(1e-8)  # ggml's GROUP_MAX_EPS_IQ3_XXS and GROUP_MAX_EPS_IQ2_S
# encoding -> (bits a level takes in a tuple's index, distinct distances a neighbour list spans)
LATTICES = {"IQ3_XXS": (3, 2), "IQ3_S": (3, 3), "IQ2_XXS": (2, 2), "IQ2_XS": (2, 2), "IQ2_S": (2, 1), "IQ1_S": (2, 3),
            "IQ1_M": (2, 3)}
# which groups the final pass places again: those off the lattice (when some are), all (when
# some are), all (always)
OFF_GRID, ALL_IF_OFF, ALL = 0, 1, 2
# the innermost steps of the search, inlined into it by numba: called as functions, each call
# would pass its arrays whole and count their references
njit_inline = njit(cache=True, nogil=True, error_model="numpy", inline="always")


@cache
def lattice(encoding: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points int8 [P, dims] as 2l + 1, map int32 [2**(bits·dims)]: tuple -> point, or
    -(offset + 1) of its neighbour list, neighbours uint16 [...]: each list's length, then its
    points)."""
    bits, wanted = LATTICES[encoding]
    values = grid(encoding).astype(np.int64)
    levels = np.searchsorted(np.unique(values), values)
    points, dims = (2 * levels + 1).astype(np.int8), levels.shape[1]
    place = (1 << bits) ** np.arange(dims)
    kmap = np.full((1 << bits) ** dims, -1, np.int32)
    kmap[levels @ place] = np.arange(len(points))
    tuples = np.indices((levels.max() + 1,) * dims).reshape(dims, -1).T  # every tuple a quantizer rounds to
    order, neighbours = np.arange(len(points)), []
    for row in tuples[kmap[tuples @ place] < 0]:
        d2 = ((points.astype(np.int64) - (2 * row + 1)) ** 2).sum(axis=1)
        ranked = np.lexsort((order, d2))
        near = ranked[d2[ranked] <= np.unique(d2)[wanted - 1]]
        kmap[row @ place] = -(len(neighbours) + 1)
        neighbours += [len(near), *near]
    return points, kmap, np.asarray(neighbours, np.uint16)


@cache
def search_lattice(encoding: str):
    """`lattice` as the IQ2/IQ3 searches take it: (points as float32, map, neighbours, bits a level)."""
    points, kmap, neighbours = lattice(encoding)
    return points.astype(F32), kmap, neighbours, LATTICES[encoding][0]


@njit_inline
def _point_of(levels, kmap, bits):
    u = 0
    for i in range(levels.size):
        u |= levels[i] << (bits * i)
    return kmap[u]


@njit_inline
def _distance(point, xval, weight, at, scale, dims):
    """The weighted squared distance of the group at `at` of xval from `point` (float32 levels) at
    `scale`; `dims` is a literal 4 or 8, so that the loop unrolls."""
    d2 = F32(0.0)
    for i in range(dims):
        diff = scale * point[i] - xval[at + i]
        d2 += weight[at + i] * diff * diff
    return d2


@njit_inline
def _best_neighbour(neighbours, start, points, xval, weight, group, scale, L):
    """iq*_find_best_neighbour for the `group` = (at, dims) of xval: the listed point (float32
    levels 2l + 1) nearest it in the weighted distance at `scale`; its levels go to L[at:], its
    index is returned. (Offsets, not slices: a slice's view costs more than this loop. The lattice
    comes in parts, not as its tuple, which unpacked here slowed the search.)"""
    at, dims = group
    best_d2, best = F32(np.inf), -1
    for j in range(start + 1, start + 1 + neighbours[start]):
        point = neighbours[j]
        d2 = _distance(points[point], xval, weight, at, scale, 8) if dims == 8 else \
            _distance(points[point], xval, weight, at, scale, 4)
        if d2 < best_d2:
            best_d2, best = d2, point
    for i in range(dims):
        L[at + i] = (np.int64(points[best, i]) - 1) // 2
    return best


@njit_inline
def _place(xval, waux, at, dims, scales, kmax, lat, L):
    """Round the group of `dims` at `at` to its levels at `inverse` and, off the lattice, move it
    to its best neighbour at `scale`, for `scales` = (inverse, scale); whether it was on the
    lattice. L[at:] gets the levels."""
    inverse, scale = scales
    points, kmap, neighbours, bits = lat
    u = 0
    for i in range(dims):
        level = max(0, min(kmax - 1, nearest_int(F32(0.5) * (inverse * xval[at + i] - F32(1.0)))))
        L[at + i] = level
        u |= level << (bits * i)
    point = kmap[u]
    if point >= 0:
        return True
    _best_neighbour(neighbours, -point - 1, points, xval, waux, (at, dims), scale, L)
    return False


@njit_inline
def _fit(xval, weight, L):
    sumqx, sumq2 = F32(0.0), F32(0.0)
    for i in range(xval.size):
        q = F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@njit_c
def _search(xval, weights, lat, L, top, scale, rule, scratch):
    """The scale of one sub-block, its levels in L: from `scale`, (2·kmax − 1 + t·step) / top for
    t in −tries..tries, then the final pass of `rule` = (tries, step, kmax, final pass, dims).
    `weights` = (the fit's, the neighbour search's); `scratch` = (Laux int64 [sub-block], on_grid,
    on_grid_try bool [groups])."""
    weight, waux = weights
    tries, step, kmax, final, dims = rule
    Laux, on_grid, on_grid_try = scratch
    groups = xval.size // dims
    best = F32(0.0)
    on_grid[:] = final == OFF_GRID
    for attempt in range(-tries, tries + 1):
        inverse = (F32(2 * kmax - 1) + F32(attempt) * step) / top
        this_scale = F32(1.0) / inverse
        for k in range(groups):
            on_grid_try[k] = _place(xval, waux, dims * k, dims, (inverse, this_scale), kmax, lat, Laux)
        sumqx, sumq2 = _fit(xval, weight, Laux)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            on_grid[:] = on_grid_try
    if (final == ALL or not on_grid.all()) and scale > 0:
        inverse = F32(1.0) / scale
        for k in range(groups):
            if final == OFF_GRID and on_grid[k]:
                continue
            _place(xval, waux, dims * k, dims, (inverse, scale), kmax, lat, L)
        sumqx, sumq2 = _fit(xval, weight, L)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit_c
def _weights(xb, qw, sigma2, bare, weight, waux):
    """A sub-block's weights: qw · sqrt(sigma2 + x²) with an importance matrix, else `bare`
    (0: x², 1: sigma2/4 + x²); and their square roots."""
    for i in range(xb.size):
        x = xb[i]
        if qw.size:
            weight[i] = qw[i] * np.sqrt(sigma2 + x * x)
        elif bare == 0:
            weight[i] = x * x
        else:
            weight[i] = F32(0.25) * sigma2 + x * x
        waux[i] = np.sqrt(weight[i])


@njit_c
def _magnitudes(xb, weight, xval, signs, even):
    """|x| into xval and each group of 8's sign bits into `signs`; with `even`, 7 bits a group,
    the eighth implied by an even count of negatives: where the count is odd, the weight that
    costs least flips."""
    for k in range(xb.size // 8):
        flips, s = 0, 0
        for i in range(8):
            v = xb[8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                flips += 1
                s |= 1 << i
        if even and flips % 2:
            least = 0
            smallest = weight[8 * k] * xb[8 * k] * xb[8 * k]
            for i in range(1, 8):
                cost = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                if cost < smallest:
                    smallest, least = cost, i
            xval[8 * k + least] = -xval[8 * k + least]
            s ^= 1 << least
        signs[k] = s & 127 if even else s


@njit_c
def _top(xval):
    top = xval[0]
    for i in range(1, xval.size):
        top = max(top, xval[i])
    return top


@njit_c
def _sub_block_levels(scales, max_scale, fudge, y):
    """Each sub-block's 4-bit scale against the block's, after the block's fp16 d; returns them."""
    d = max_scale / F32(31)
    store_fp16(y, 0, d * fudge)
    inverse = F32(1.0) / d
    levels = np.empty(scales.size, np.int64)
    for ib in range(scales.size):
        levels[ib] = max(0, min(15, nearest_int(F32(0.5) * (inverse * scales[ib] - F32(1.0)))))
    return levels


@njit_c
def _flip_negative(scale, signs, mask):
    """ggml's guard for a negative scale (never with weights >= 0): the scale and the signs flip."""
    if scale < 0:
        for k in range(signs.size):
            signs[k] = ~signs[k] & mask
        return -scale
    return scale


# block_iq3_xxs: d (fp16), then qs[96]: 64 point indices (8 a sub-block of 32), and per sub-block a
# uint32 of 4 × 7 sign bits and a 4-bit scale on top
IQ3_XXS_BYTES = block_bytes("IQ3_XXS")


@njit_c
def _quantize_iq3_xxs(rows, imatrix, out, lat):
    scratch = (np.empty(32, np.int64), np.empty(8, np.bool_), np.empty(8, np.bool_))
    weight, waux, xval = np.empty(32, F32), np.empty(32, F32), np.empty(32, F32)
    L, signs = np.empty(32, np.int64), np.empty(4, np.int64)
    scales = np.empty(QK_K // 32, F32)
    words = np.empty(QK_K // 32, np.int64)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)] if imatrix.size else imatrix
            y = out[r, IQ3_XXS_BYTES * b:IQ3_XXS_BYTES * (b + 1)]
            y[:] = 0
            words[:] = 0
            sigma2 = F32(2.0) * sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 32):
                xb = xbl[32 * ib:32 * (ib + 1)]
                _weights(xb, qw[32 * ib:32 * (ib + 1)] if qw.size else qw, sigma2, 0, weight, waux)
                _magnitudes(xb, weight, xval, signs, True)
                top = _top(xval)
                L[:] = 0
                scales[ib] = F32(0.0)
                if top < GROUP_MAX_EPS_SMALL:
                    continue
                scale = _search(xval, (weight, waux), lat, L, top, top / F32(15), (15, F32(0.2), 8, OFF_GRID, 4), scratch)
                scale = _flip_negative(scale, signs, 127)
                for k in range(8):
                    y[2 + 8 * ib + k] = _point_of(L[4 * k:4 * k + 4], lat[1], 3)
                words[ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                y[2:] = 0
                continue
            levels = _sub_block_levels(scales, max_scale, F32(1.0125), y)
            for ib in range(QK_K // 32):
                word = words[ib] | (levels[ib] << 28)
                for j in range(4):
                    y[2 + QK_K // 4 + 4 * ib + j] = (word >> (8 * j)) & 0xFF


def quantize_iq3_xxs(rows, imatrix, out):
    _quantize_iq3_xxs(rows, imatrix, out, search_lattice("IQ3_XXS"))


# block_iq3_s: d (fp16), qs[64] (the low 8 bits of each point index), qh[8] (their ninth bits),
# signs[32] (one bit a weight), scales[4] (a 4-bit scale per sub-block of 32). As in ggml, a
# sub-block of zeros takes no place in qs and signs: the next sub-block's follow on.
IQ3_S_BYTES = block_bytes("IQ3_S")


@njit_c
def _quantize_iq3_s(rows, imatrix, out, lat):
    scratch = (np.empty(32, np.int64), np.empty(8, np.bool_), np.empty(8, np.bool_))
    weight, waux, xval = np.empty(32, F32), np.empty(32, F32), np.empty(32, F32)
    L, signs = np.empty(32, np.int64), np.empty(4, np.int64)
    scales = np.empty(QK_K // 32, F32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)] if imatrix.size else imatrix
            y = out[r, IQ3_S_BYTES * b:IQ3_S_BYTES * (b + 1)]
            y[:] = 0
            qs, qh, packed_signs = 2, 2 + QK_K // 4, 2 + QK_K // 4 + QK_K // 32
            sigma2 = F32(2.0) * sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 32):
                xb = xbl[32 * ib:32 * (ib + 1)]
                _weights(xb, qw[32 * ib:32 * (ib + 1)] if qw.size else qw, sigma2, 0, weight, waux)
                _magnitudes(xb, weight, xval, signs, False)
                top = _top(xval)
                L[:] = 0
                scales[ib] = F32(0.0)
                if top == 0:
                    continue
                scale = _search(xval, (weight, waux), lat, L, top, top / F32(15), (9, F32(0.2), 8, ALL_IF_OFF, 4), scratch)
                scale = _flip_negative(scale, signs, 0xFF)
                for k in range(8):
                    point = _point_of(L[4 * k:4 * k + 4], lat[1], 3)
                    y[qs + k] = point & 255
                    y[qh + ib] |= (point >> 8) << k
                qs += 8
                for k in range(4):
                    y[packed_signs + k] = signs[k]
                packed_signs += 4
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            levels = _sub_block_levels(scales, max_scale, F32(1.033), y)
            for ib in range(0, QK_K // 32, 2):
                y[IQ3_S_BYTES - 4 + ib // 2] = levels[ib] | (levels[ib + 1] << 4)


def quantize_iq3_s(rows, imatrix, out):
    _quantize_iq3_s(rows, imatrix, out, search_lattice("IQ3_S"))


# block_iq2_xxs: d (fp16), then per sub-block of 32 two uint32: its 4 point indices (a byte each),
# and 4 × 7 sign bits with a 4-bit scale on top. ggml requires an importance matrix.
IQ2_XXS_BYTES = block_bytes("IQ2_XXS")


@njit_c
def _quantize_iq2_xxs(rows, imatrix, out, lat):
    scratch = (np.empty(32, np.int64), np.empty(4, np.bool_), np.empty(4, np.bool_))
    weight, waux, xval = np.empty(32, F32), np.empty(32, F32), np.empty(32, F32)
    L, signs = np.empty(32, np.int64), np.empty(4, np.int64)
    qp_levels = np.empty(32, np.uint8)
    scales = np.empty(QK_K // 32, F32)
    words = np.empty(QK_K // 16, np.int64)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)]
            y = out[r, IQ2_XXS_BYTES * b:IQ2_XXS_BYTES * (b + 1)]
            y[:] = 0
            words[:] = 0
            sigma2 = sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 32):
                xb = xbl[32 * ib:32 * (ib + 1)]
                _weights(xb, qw[32 * ib:32 * (ib + 1)], sigma2, 0, weight, waux)
                _magnitudes(xb, weight, xval, signs, True)
                scales[ib] = F32(0.0)
                if _top(xval) < GROUP_MAX_EPS:
                    continue
                scale = make_qp_quants(4, xval, qp_levels, weight)
                L[:] = qp_levels
                top = scale * F32(3)
                if top <= 0:
                    continue
                scale = _search(xval, (weight, waux), lat, L, top, scale, (6, F32(0.1), 3, ALL, 8), scratch)
                scale = _flip_negative(scale, signs, 127)
                for k in range(4):
                    words[2 * ib] |= _point_of(L[8 * k:8 * k + 8], lat[1], 2) << (8 * k)
                    words[2 * ib + 1] |= signs[k] << (7 * k)
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            levels = _sub_block_levels(scales, max_scale, F32(1.0), y)
            for ib in range(QK_K // 32):
                words[2 * ib + 1] |= levels[ib] << 28
            for w in range(QK_K // 16):
                for j in range(4):
                    y[2 + 4 * w + j] = (words[w] >> (8 * j)) & 0xFF


def quantize_iq2_xxs(rows, imatrix, out):
    _quantize_iq2_xxs(rows, imatrix, out, search_lattice("IQ2_XXS"))


# block_iq2_xs: d (fp16), qs[32] uint16 (per group of 8: a 9-bit point index and 7 sign bits),
# scales[8] (a 4-bit scale per sub-block of 16). ggml requires an importance matrix.
IQ2_XS_BYTES = block_bytes("IQ2_XS")


@njit_c
def _quantize_iq2_xs(rows, imatrix, out, lat):
    scratch = (np.empty(16, np.int64), np.empty(2, np.bool_), np.empty(2, np.bool_))
    weight, waux, xval = np.empty(16, F32), np.empty(16, F32), np.empty(16, F32)
    L, signs = np.empty(16, np.int64), np.empty(2, np.int64)
    scales = np.empty(QK_K // 16, F32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)]
            y = out[r, IQ2_XS_BYTES * b:IQ2_XS_BYTES * (b + 1)]
            y[:] = 0
            sigma2 = sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 16):
                xb = xbl[16 * ib:16 * (ib + 1)]
                _weights(xb, qw[16 * ib:16 * (ib + 1)], sigma2, 0, weight, waux)
                _magnitudes(xb, weight, xval, signs, True)
                top = _top(xval)
                L[:] = 0
                scales[ib] = F32(0.0)
                if top < GROUP_MAX_EPS:
                    continue
                scale = _search(xval, (weight, waux), lat, L, top, top / F32(5), (9, F32(0.1), 3, OFF_GRID, 8), scratch)
                scale = _flip_negative(scale, signs, 127)
                for k in range(2):
                    word = _point_of(L[8 * k:8 * k + 8], lat[1], 2) | (signs[k] << 9)
                    y[2 + 2 * (2 * ib + k)] = word & 0xFF
                    y[3 + 2 * (2 * ib + k)] = word >> 8
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                y[2:] = 0
                continue
            levels = _sub_block_levels(scales, max_scale, F32(1.0), y)
            for ib in range(0, QK_K // 16, 2):
                y[IQ2_XS_BYTES - QK_K // 32 + ib // 2] = levels[ib] | (levels[ib + 1] << 4)


def quantize_iq2_xs(rows, imatrix, out):
    _quantize_iq2_xs(rows, imatrix, out, search_lattice("IQ2_XS"))


# block_iq2_s: d (fp16), qs[64] (32 low bytes of the point indices, then 32 bytes of signs, one bit a
# weight), qh[8] (the indices' top 2 bits), scales[8] (a 4-bit scale per sub-block of 16)
IQ2_S_BYTES = block_bytes("IQ2_S")


@njit_c
def _quantize_iq2_s(rows, imatrix, out, lat):
    scratch = (np.empty(16, np.int64), np.empty(2, np.bool_), np.empty(2, np.bool_))
    weight, waux, xval = np.empty(16, F32), np.empty(16, F32), np.empty(16, F32)
    L, signs = np.empty(16, np.int64), np.empty(2, np.int64)
    scales = np.empty(QK_K // 16, F32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)] if imatrix.size else imatrix
            y = out[r, IQ2_S_BYTES * b:IQ2_S_BYTES * (b + 1)]
            y[:] = 0
            sigma2 = F32(2.0) * sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 16):
                xb = xbl[16 * ib:16 * (ib + 1)]
                _weights(xb, qw[16 * ib:16 * (ib + 1)] if qw.size else qw, sigma2, 1, weight, waux)
                _magnitudes(xb, weight, xval, signs, False)
                top = _top(xval)
                L[:] = 0
                scales[ib] = F32(0.0)
                if top < GROUP_MAX_EPS_SMALL:
                    continue
                scale = _search(xval, (weight, waux), lat, L, top, top / F32(5), (9, F32(0.1), 3, OFF_GRID, 8), scratch)
                scale = _flip_negative(scale, signs, 0xFF)
                for k in range(2):
                    group = 2 * ib + k
                    point = _point_of(L[8 * k:8 * k + 8], lat[1], 2)
                    y[2 + group] = point & 255
                    y[2 + QK_K // 4 + group // 4] |= (point >> 8) << (2 * (group % 4))
                    y[2 + QK_K // 8 + group] = signs[k]
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            levels = _sub_block_levels(scales, max_scale, F32(0.9875), y)
            for ib in range(0, QK_K // 16, 2):
                y[IQ2_S_BYTES - QK_K // 32 + ib // 2] = levels[ib] | (levels[ib + 1] << 4)


def quantize_iq2_s(rows, imatrix, out):
    _quantize_iq2_s(rows, imatrix, out, search_lattice("IQ2_S"))


IQ1_DELTA = F32(0.125)
X_P = np.array([-1 + 0.125, 0.125, 1 + 0.125], F32)  # the levels shifted up by IQ1_DELTA, and down:
X_M = np.array([-1 - 0.125, -0.125, 1 - 0.125], F32)
GROUP_MAX_EPS_IQ1_S = F32(1e-12)
GROUP_MAX_EPS_IQ1_M = F32(1e-7)
FLT_MAX = F32(np.finfo(np.float32).max)


@njit_inline
def _best_neighbour_iq1(lat, start, shift, xb, weight, at, scale, L):
    """iq1_find_best_neighbour2 for the group of 8 at `at`: the point of `lat`'s list at `start`
    nearest it in the weighted distance at `scale`, each point's weights its levels shifted by
    `shift` (0 up, 1 down); its levels go to L[at:], its index is returned."""
    points, _, neighbours, shifted = lat
    values = shifted[shift]
    best_d2, best = F32(np.inf), -1
    for j in range(start + 1, start + 1 + neighbours[start]):
        point = neighbours[j]
        d2 = F32(0.0)
        for i in range(8):
            diff = scale * values[point, i] - xb[at + i]
            d2 += weight[at + i] * diff * diff
        if d2 < best_d2:
            best_d2, best = d2, point
    for i in range(8):
        L[at + i] = (points[best, i] - 1) // 2
    return best


@njit_inline
def _sorted_order(xb, order):
    """The order of xb ascending into `order`, equal values in place (glibc's qsort, a merge sort,
    keeps them): an insertion sort, which is stable and quickest at 16 or 32 values."""
    for j in range(xb.size):
        v, at = xb[j], j
        while at > 0 and xb[order[at - 1]] > v:
            order[at] = order[at - 1]
            at -= 1
        order[at] = j


@njit_inline
def _split_levels(order, first, second, L):
    """Levels 0, 1, 2 for the sorted weights below `first`, up to `second`, and from it."""
    for j in range(order.size):
        L[order[j]] = 0 if j < first else 1 if j < second else 2


@njit_inline
def _on_lattice(xb, weight, scale, sets, L, lat, index):
    """Each group of 8's point (its levels in L), the off-lattice ones moved to their nearest listed
    point with that group's shift (`sets[k]`: 0 up, 1 down); whether every group was on the lattice."""
    kmap = lat[1]
    all_on = True
    for k in range(xb.size // 8):
        u = 0
        for i in range(8):
            u |= L[8 * k + i] << (2 * i)
        point = kmap[u]
        if point < 0:
            all_on = False
            point = _best_neighbour_iq1(lat, -point - 1, sets[k], xb, weight, 8 * k, scale, L)
        index[k] = point
    return all_on


@njit_inline
def _refit(xb, weight, sets, values, index, scale):
    """The least-squares scale of the groups' points (`scale` when it is not positive)."""
    sumqx, sumq2 = F32(0.0), F32(0.0)
    for k in range(index.size):
        for j in range(8):
            w = weight[8 * k + j]
            q = values[sets[k], index[k], j]
            sumqx += w * q * xb[8 * k + j]
            sumq2 += w * q * q
    return sumqx / sumq2 if sumqx > 0 and sumq2 > 0 else scale


@cache
def iq1_lattice(encoding: str):
    """`lattice` with each point's weights as levels shifted up (values[0]) and down (values[1])."""
    points, kmap, neighbours = lattice(encoding)
    levels = (points.astype(np.int64) - 1) // 2
    return points, kmap, neighbours, np.stack([X_P[levels], X_M[levels]])


# block_iq1_s: d (fp16), qs[32] (the low 8 bits of each point index), qh[8] uint16 (per sub-block of
# 32: the indices' top 3 bits, 3 bits of scale, and bit 15 for levels shifted down). ggml requires an
# importance matrix.
IQ1_S_BYTES = block_bytes("IQ1_S")


@njit_c
def _quantize_iq1_s(rows, imatrix, out, lat):
    weight = np.empty(32, F32)
    L = np.empty(32, np.int64)
    index = np.empty(4, np.int64)
    scales = np.empty(QK_K // 32, F32)
    shifts = np.empty(QK_K // 32, np.int64)
    sumx, sumw = np.empty(33, F32), np.empty(33, F32)
    order = np.empty(32, np.int64)
    tail = np.empty((4, 33), F32)
    sets = np.empty(4, np.int64)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)]
            y = out[r, IQ1_S_BYTES * b:IQ1_S_BYTES * (b + 1)]
            y[:] = 0
            qh = np.zeros(QK_K // 32, np.int64)
            sigma2 = F32(2.0) * sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 32):
                xb = xbl[32 * ib:32 * (ib + 1)]
                for i in range(32):
                    weight[i] = qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                scales[ib], shifts[ib] = F32(0.0), 1
                top = abs(xb[0])
                for i in range(1, 32):
                    top = max(top, abs(xb[i]))
                if top < GROUP_MAX_EPS_IQ1_S:
                    continue
                _sorted_order(xb, order)
                sumx[0] = sumw[0] = F32(0.0)
                for j in range(32):
                    i = order[j]
                    sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                    sumw[j + 1] = sumw[j] + weight[i]
                best_score, scale = -FLT_MAX, top
                first, second, shift = -1, -1, 0
                p0, p1, p2, m0, m1, m2 = X_P[0], X_P[1], X_P[2], X_M[0], X_M[1], X_M[2]
                # ggml's sums for a split (i1, i2): (a·x0 + b·x1) + c·x2 of the three groups' sums, and
                # ((wa·x0)·x0 + (wb·x1)·x1) + (wc·x2)·x2; the terms of one index alone are computed once
                for i2 in range(33):
                    c, wc = sumx[32] - sumx[i2], sumw[32] - sumw[i2]
                    tail[0, i2], tail[1, i2], tail[2, i2], tail[3, i2] = c * p2, wc * p2 * p2, c * m2, wc * m2 * m2
                for i1 in range(33):
                    a, wa = sumx[i1] - sumx[0], sumw[i1] - sumw[0]
                    ap, wap, am, wam = a * p0, wa * p0 * p0, a * m0, wa * m0 * m0
                    for i2 in range(i1, 33):
                        bx, wb = sumx[i2] - sumx[i1], sumw[i2] - sumw[i1]
                        sumqx = ap + bx * p1 + tail[0, i2]
                        sumq2 = wap + wb * p1 * p1 + tail[1, i2]
                        if sumq2 > 0 and sumqx * sumqx > best_score * sumq2:  # levels shifted up
                            scale = sumqx / sumq2
                            best_score = scale * sumqx
                            first, second, shift = i1, i2, 1
                        sumqx = am + bx * m1 + tail[2, i2]
                        sumq2 = wam + wb * m1 * m1 + tail[3, i2]
                        if sumq2 > 0 and sumqx * sumqx > best_score * sumq2:  # and down
                            scale = sumqx / sumq2
                            best_score = scale * sumqx
                            first, second, shift = i1, i2, -1
                if first < 0 or second < 0 or shift == 0:
                    continue
                _split_levels(order, first, second, L)
                if scale < 0:
                    for j in range(32):
                        L[j] = 2 - L[j]
                    scale, shift = -scale, -shift
                sets[:] = 0 if shift == 1 else 1
                if not _on_lattice(xb, weight, scale, sets, L, lat, index):
                    scale = _refit(xb, weight, sets, lat[3], index, scale)
                h = 0
                for k in range(4):
                    y[2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                qh[ib] = h
                scales[ib], shifts[ib] = scale, shift
                max_scale = max(max_scale, scale)
            if max_scale != 0:
                d = max_scale / F32(15)
                store_fp16(y, 0, d * F32(1.125))
                inverse = F32(1.0) / d
                for ib in range(QK_K // 32):
                    level = max(0, min(7, nearest_int(F32(0.5) * (inverse * scales[ib] - F32(1.0)))))
                    qh[ib] |= ((level | 8) if shifts[ib] == -1 else level) << 12
            for ib in range(QK_K // 32):
                y[2 + QK_K // 8 + 2 * ib] = qh[ib] & 0xFF
                y[3 + QK_K // 8 + 2 * ib] = qh[ib] >> 8


def quantize_iq1_s(rows, imatrix, out):
    _quantize_iq1_s(rows, imatrix, out, iq1_lattice("IQ1_S"))


# block_iq1_m: qs[32] (the low 8 bits of each point index), qh[16] (per sub-block of 16, a nibble
# per group of 8: the index's top 3 bits and a bit for levels shifted down), scales[8] (as 4 uint16:
# a 3-bit scale per sub-block, and the fp16 block scale's nibbles in the top 4 bits of each)
IQ1_M_BYTES = block_bytes("IQ1_M")
IQ1_M_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)  # by the kind of shift: ++, +-, -+, --


@njit_c
def _quantize_iq1_m(rows, imatrix, out, lat):
    weight, roots = np.empty(16, F32), np.empty(16, F32)
    L = np.empty(16, np.int64)
    index = np.empty(2, np.int64)
    scales = np.empty(QK_K // 16, F32)
    kinds = np.empty(QK_K // 16, np.int64)
    px, pw = np.empty((2, 17), F32), np.empty((2, 17), F32)
    order = np.empty(16, np.int64)
    tail = np.empty((4, 17), F32)
    sets = np.empty(2, np.int64)
    cp1 = X_P[0] * X_P[0] - X_P[1] * X_P[1]
    cp2 = X_P[1] * X_P[1] - X_P[2] * X_P[2]
    cm1 = X_M[0] * X_M[0] - X_M[1] * X_M[1]
    cm2 = X_M[1] * X_M[1] - X_M[2] * X_M[2]
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // QK_K):
            xbl = rows[r, QK_K * b:QK_K * (b + 1)]
            qw = imatrix[QK_K * b:QK_K * (b + 1)] if imatrix.size else imatrix
            y = out[r, IQ1_M_BYTES * b:IQ1_M_BYTES * (b + 1)]
            y[:] = 0
            sigma2 = F32(2.0) * sum_of_squares(xbl) / F32(QK_K)
            max_scale = F32(0.0)
            for ib in range(QK_K // 16):
                xb = xbl[16 * ib:16 * (ib + 1)]
                _weights(xb, qw[16 * ib:16 * (ib + 1)] if qw.size else qw, sigma2, 0, weight, roots)
                scales[ib], kinds[ib] = F32(0.0), 0
                top = abs(xb[0])
                for i in range(1, 16):
                    top = max(top, abs(xb[i]))
                if top < GROUP_MAX_EPS_IQ1_M:
                    continue
                _sorted_order(xb, order)
                px[:, 0] = F32(0.0)
                pw[:, 0] = F32(0.0)
                for j in range(16):
                    i = order[j]
                    h = 0 if i < 8 else 1
                    px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                best_score, scale = -FLT_MAX, top
                first, second, kind = -1, -1, -1
                # ggml's per-half sums for a split (i1, i2): T·x2 − (px[i1] + px[i2]), and
                # ((W·x2)·x2 + pw[i1]·c1) + pw[i2]·c2; the terms of one index alone are computed once
                tp0, tp1, tm0, tm1 = px[0, 16] * X_P[2], px[1, 16] * X_P[2], px[0, 16] * X_M[2], px[1, 16] * X_M[2]
                for i2 in range(17):
                    tail[0, i2], tail[1, i2] = pw[0, i2] * cp2, pw[1, i2] * cp2
                    tail[2, i2], tail[3, i2] = pw[0, i2] * cm2, pw[1, i2] * cm2
                for i1 in range(17):
                    h_p0 = pw[0, 16] * X_P[2] * X_P[2] + pw[0, i1] * cp1
                    h_p1 = pw[1, 16] * X_P[2] * X_P[2] + pw[1, i1] * cp1
                    h_m0 = pw[0, 16] * X_M[2] * X_M[2] + pw[0, i1] * cm1
                    h_m1 = pw[1, 16] * X_M[2] * X_M[2] + pw[1, i1] * cm1
                    for i2 in range(i1, 17):
                        s0, s1 = px[0, i1] + px[0, i2], px[1, i1] + px[1, i2]
                        qx_p0, qx_p1, qx_m0, qx_m1 = tp0 - s0, tp1 - s1, tm0 - s0, tm1 - s1
                        q2_p0, q2_p1 = h_p0 + tail[0, i2], h_p1 + tail[1, i2]
                        q2_m0, q2_m1 = h_m0 + tail[2, i2], h_m1 + tail[3, i2]
                        # the four kinds in ggml's order: ++, +-, -+, --
                        qx, q2 = qx_p0 + qx_p1, q2_p0 + q2_p1
                        if q2 > 0 and qx * qx > best_score * q2:
                            scale, first, second, kind = qx / q2, i1, i2, 0
                            best_score = scale * qx
                        qx, q2 = qx_p0 + qx_m1, q2_p0 + q2_m1
                        if q2 > 0 and qx * qx > best_score * q2:
                            scale, first, second, kind = qx / q2, i1, i2, 1
                            best_score = scale * qx
                        qx, q2 = qx_m0 + qx_p1, q2_m0 + q2_p1
                        if q2 > 0 and qx * qx > best_score * q2:
                            scale, first, second, kind = qx / q2, i1, i2, 2
                            best_score = scale * qx
                        qx, q2 = qx_m0 + qx_m1, q2_m0 + q2_m1
                        if q2 > 0 and qx * qx > best_score * q2:
                            scale, first, second, kind = qx / q2, i1, i2, 3
                            best_score = scale * qx
                if first < 0 or second < 0 or kind < 0:
                    continue
                _split_levels(order, first, second, L)
                if scale < 0:
                    for j in range(16):
                        L[j] = 2 - L[j]
                    scale, kind = -scale, 3 - kind
                sets[0], sets[1] = kind >= 2, kind % 2
                if not _on_lattice(xb, weight, scale, sets, L, lat, index):
                    scale = _refit(xb, weight, sets, lat[3], index, scale)
                y[2 * ib] = index[0] & 255
                y[2 * ib + 1] = index[1] & 255
                y[QK_K // 8 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
                scales[ib], kinds[ib] = scale, kind
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            sc = np.zeros(4, np.int64)
            d = max_scale / F32(15)
            inverse = F32(1.0) / d
            sumqx_f, sumq2_f = F32(0.0), F32(0.0)
            for ib in range(QK_K // 16):
                level = max(0, min(7, nearest_int(F32(0.5) * (inverse * scales[ib] - F32(1.0)))))
                sc[ib // 4] |= level << (3 * (ib % 4))
                y[QK_K // 8 + ib] |= IQ1_M_MASKS[kinds[ib]]
                xb = xbl[16 * ib:16 * (ib + 1)]
                _weights(xb, qw[16 * ib:16 * (ib + 1)] if qw.size else qw, sigma2, 0, weight, roots)
                sets[0], sets[1] = kinds[ib] >= 2, kinds[ib] % 2
                for k in range(2):
                    point = y[2 * ib + k] + ((np.int64(y[QK_K // 8 + ib]) << (8 - 4 * k)) & 0x700)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = lat[3][sets[k], point, j] * F32(2 * level + 1)
                        sumqx_f += w * q * xb[8 * k + j]
                        sumq2_f += w * q * q
            if sumq2_f > 0:
                d = sumqx_f / sumq2_f
            store_fp16(y, IQ1_M_BYTES - 2, d * F32(1.1125))
            h = np.int64(y[IQ1_M_BYTES - 2]) | (np.int64(y[IQ1_M_BYTES - 1]) << 8)
            sc[0] |= (h & 0x000F) << 12
            sc[1] |= (h & 0x00F0) << 8
            sc[2] |= (h & 0x0F00) << 4
            sc[3] |= h & 0xF000
            for j in range(4):
                y[QK_K // 8 + QK_K // 16 + 2 * j] = sc[j] & 0xFF
                y[QK_K // 8 + QK_K // 16 + 2 * j + 1] = sc[j] >> 8


def quantize_iq1_m(rows, imatrix, out):
    _quantize_iq1_m(rows, imatrix, out, iq1_lattice("IQ1_M"))
