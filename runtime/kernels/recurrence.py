"""The gated delta rule: a DeltaNet layer's recurrence over its fixed-size state."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32


@njit(cache=True, nogil=True, parallel=True)
def gated_delta_rule(q, k, v, decay, beta, key_heads, state, out):
    """For each token t and value head h, served by q/k head g = key_heads[h]:
    S ← diag(decay[t, h]) S; S ← S + k ⊗ ((v - Sᵀk) beta[t, h]); out[t, h] = Sᵀq, with S = state[h].

    q, k: float32 [n, key heads, key width] (normalized; q scaled); v: [n, value heads, value
    width]; decay: [n, value heads, key width] (row i of S decays by decay[t, h, i]: one value
    for all rows in a gated DeltaNet, one per key channel in Kimi delta attention); beta: [n,
    value heads]; key_heads: int64 [value heads], each within the key heads; state: [value
    heads, key width, value width], updated in place; out: [n, value heads, value width]. The
    heads run in parallel."""
    n, heads, dk, dv = v.shape[0], v.shape[1], k.shape[2], v.shape[2]
    for h in prange(heads):
        g, s = key_heads[h], state[h]
        delta = np.empty(dv, F32)
        for t in range(n):
            delta[:] = F32(0.0)
            for i in range(dk):
                ki, d = k[t, g, i], decay[t, h, i]
                for j in range(dv):
                    s[i, j] *= d
                    delta[j] += s[i, j] * ki
            b = beta[t, h]
            for j in range(dv):
                delta[j] = (v[t, h, j] - delta[j]) * b
                out[t, h, j] = F32(0.0)
            for i in range(dk):
                ki, qi = k[t, g, i], q[t, g, i]
                for j in range(dv):
                    s[i, j] += ki * delta[j]
                    out[t, h, j] += s[i, j] * qi
