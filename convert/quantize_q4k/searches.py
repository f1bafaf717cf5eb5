"""ggml's scale searches: the scale (and minimum) and the levels that fit a group of weights best.

make_qx_quants (symmetric: Q6_K, and Q5_0, Q4_0, Q3_K with an imatrix), make_q3_quants (Q3_K),
make_qkx2/3_quants (a scale and a minimum: Q4_K, Q5_K, Q2_K, and Q5_1, Q4_1 with an imatrix) and
make_qp_quants (the scales of the K-quants' scales, with an imatrix).
"""

import numpy as np

from colibri.convert.quantize_q4k.scalars import nearest_int, njit_c

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)

# (rmin, rdelta, nstep, use_mad) of ggml's make_qkx2_quants / make_qkx3_quants scale searches.
# As tuples they reach numba as plain (not literal) values: one compiled search per nmax.
Q4_K_SEARCH = (F32(-1.0), F32(0.1), 20, False)
Q5_K_SEARCH = (F32(-0.5), F32(0.1), 15, False)
Q2_K_SEARCH = (F32(-0.5), F32(0.1), 15, True)  # errors as absolute, not squared, differences
IMATRIX_SEARCH = (F32(-0.9), F32(0.05), 36, False)


@njit_c
def signed_max(x):
    """(the largest |x[i]|, that x[i]): the first of equal magnitudes, as ggml's loops."""
    amax = F32(0.0)
    max_value = F32(0.0)
    for v in x:
        if abs(v) > amax:
            amax = abs(v)
            max_value = v
    return amax, max_value


@njit_c
def make_qx_quants(nmax, x, weights, L):
    """make_qx_quants (rmse_type 1, weights given): levels L in [0, 2*nmax) for
    x ~ scale*(L - nmax). Returns the scale.

    The 18 trial scales do not depend on each other, so their sums are accumulated side by
    side (one float32 chain per trial, in C's order, which the compiler can vectorize across
    trials); C's sequential choice among them follows."""
    n = x.size
    amax, max_value = signed_max(x)
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return F32(0.0)
    iscale = F32(-nmax) / max_value
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        level = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = level + nmax
        fl = F32(level)
        sumlx += weights[i] * x[i] * fl
        suml2 += weights[i] * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx

    trials = 18  # is = -9..9 without 0
    iscales = np.empty(trials, np.float32)
    for t in range(trials):
        step = t - 9 if t < 9 else t - 8
        iscales[t] = -(F32(nmax) + F32(0.1) * F32(step)) / max_value
    trial_sumlx = np.zeros(trials, np.float32)
    trial_suml2 = np.zeros(trials, np.float32)
    trial_levels = np.empty((n, trials), np.uint8)
    for i in range(n):
        wx = weights[i] * x[i]
        for t in range(trials):
            level = max(-nmax, min(nmax - 1, nearest_int(iscales[t] * x[i])))
            trial_levels[i, t] = level + nmax
            fl = F32(level)
            trial_sumlx[t] += wx * fl
            trial_suml2[t] += weights[i] * fl * fl
    for t in range(trials):
        sumlx = trial_sumlx[t]
        suml2 = trial_suml2[t]
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L[:n] = trial_levels[:, t]
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit_c
def make_qkx_quants(nmax, x, weights, L, search):
    """make_qkx2_quants / make_qkx3_quants (weights given): levels L in [0, nmax] for
    x ~ scale*L - the_min. Returns (scale, the_min).

    Each trial depends on the previous one (through min), so trials run in order; within a
    trial the element-wise products get their own vectorizable loops and only the float32
    sums, in C's order, stay scalar."""
    rmin, rdelta, nstep, use_mad = search
    n = x.size
    min_value = x[0]
    max_value = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < min_value:
            min_value = x[i]
        if x[i] > max_value:
            max_value = x[i]
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if min_value > 0:
        min_value = F32(0.0)
    if max_value <= min_value:
        L[:n] = 0
        return F32(0.0), -min_value
    iscale = F32(nmax) / (max_value - min_value)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        L[i] = max(0, min(nmax, nearest_int(iscale * (x[i] - min_value))))
        diff = scale * F32(L[i]) + min_value - x[i]
        best_error += weights[i] * (abs(diff) if use_mad else diff * diff)

    Laux = np.empty(n, np.uint8)
    products = np.empty((4, n), np.float32)
    wl, wl2, wlx, werr = products[0], products[1], products[2], products[3]
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (max_value - min_value)
        for i in range(n):
            Laux[i] = max(0, min(nmax, nearest_int(iscale * (x[i] - min_value))))
        for i in range(n):
            wl[i] = weights[i] * F32(Laux[i])
        for i in range(n):
            wl2[i] = wl[i] * F32(Laux[i])
        for i in range(n):
            wlx[i] = wl[i] * x[i]
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            sum_l += wl[i]
            sum_l2 += wl2[i]
            sum_xl += wlx[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                werr[i] = weights[i] * (abs(diff) if use_mad else diff * diff)
            error = F32(0.0)
            for i in range(n):
                error += werr[i]
            if error < best_error:
                L[:n] = Laux
                best_error = error
                scale = this_scale
                min_value = this_min
    return scale, -min_value


@njit_c
def make_qp_quants(nmax, x, L, quant_weights):
    """make_qp_quants: levels L in [0, nmax] for the non-negative sub-block scales (or mins)
    x, weighted by quant_weights. Returns the super-block scale."""
    n = x.size
    max_value = F32(0.0)
    for i in range(n):
        max_value = max_value if max_value > x[i] else x[i]
    if max_value < GROUP_MAX_EPS:
        L[:n] = 0
        return F32(0.0)
    iscale = F32(nmax) / max_value
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += quant_weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = (F32(0.1) * F32(step) + F32(nmax)) / max_value
        scale_step = F32(1.0) / iscale_step
        mse = F32(0.0)
        for i in range(n):
            level = min(nmax, nearest_int(iscale_step * x[i]))
            diff = x[i] - scale_step * F32(level)
            mse += quant_weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_step
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        level = min(nmax, nearest_int(iscale * x[i]))
        L[i] = level & 0xFF
        fl = F32(level)
        sumlx += quant_weights[i] * x[i] * fl
        suml2 += quant_weights[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            old = F32(L[i])
            slx = sumlx - w * x[i] * old
            sl2 = suml2 - w * old * old
            if slx > 0 and sl2 > 0:
                new_level = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_level != L[i]:
                    slx += w * x[i] * F32(new_level)
                    sl2 += w * F32(new_level) * F32(new_level)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_level & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit_c
def make_q3_quants(nmax, x, L):
    """make_q3_quants (do_rmse): levels L in [0, 2*nmax) for x ~ scale*(L - nmax), weighted by
    x^2 and refined a level at a time. Returns the scale."""
    n = x.size
    amax, max_value = signed_max(x)
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return F32(0.0)
    iscale = F32(-nmax) / max_value
    levels = np.empty(n, np.int64)
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        level = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        levels[i] = level
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(level)
        suml2 += w * F32(level) * F32(level)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F32(levels[i])
            if slx > 0:
                sl2 = suml2 - w * F32(levels[i]) * F32(levels[i])
                new = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new != levels[i]:
                    slx += w * x[i] * F32(new)
                    sl2 += w * F32(new) * F32(new)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        levels[i] = new
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if not changed:
            break
    for i in range(n):
        L[i] = levels[i] + nmax
    return sumlx / suml2 if suml2 > 0 else F32(0.0)
