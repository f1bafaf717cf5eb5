"""The linear layers of hybrid models: a gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi delta
attention (Kimi-Linear), token mixers whose state has the same size at any position.

Per token: q, k, v from one projection through a causal depthwise convolution (its last
`kernel - 1` inputs are a state), SiLU; q and k L2-normalized per head; a decay
exp(A softplus(alpha + dt_bias)) and a write strength sigmoid(beta) per value head; the
gated delta rule (`kernels.gated_delta_rule`) over a [key width, value width] state per value
head; each head's output RMS-normalized, times SiLU of its gate z, then projected out. Both
states live in the sequence's `KVCache` and are the same size at any position.

Kimi delta attention is the same recurrence with a decay per key channel: q, k and v from
three projections, each through its own causal convolution (one state: [q | k | v]); the
decay exp(A softplus(f_b f_a h + dt_bias)) per head and channel (GLM-5-Next's safe gate:
exp(bound sigmoid(-A (f_b f_a h + dt_bias)))); each head's output RMS-normalized, times
sigmoid(g_b g_a h), then projected by attn_output.
"""

from __future__ import annotations

import numpy as np

from colibri.formats.model_config import ModelConfig
from colibri.runtime import kernels

L2_EPS = np.float32(1e-6)  # the q/k L2 norm's epsilon (transformers' and FLA's)


def l2_normalized(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x²) + eps) over the last axis."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0), x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


class GatedDeltaNet:
    def __init__(self, c: ModelConfig, w, layer: int):
        p = f"blk.{layer}."
        self.c, self.layer = c, layer
        self.qkv, self.z = w.linear(p + "attn_qkv.weight"), w.linear(p + "attn_gate.weight")
        self.beta, self.alpha = w.linear(p + "ssm_beta.weight"), w.linear(p + "ssm_alpha.weight")
        self.conv = w.array(p + "ssm_conv1d.weight")  # [channels, kernel]
        self.a, self.dt_bias = w.vector(p + "ssm_a"), w.vector(p + "ssm_dt.bias")  # A = -exp(A_log)
        self.norm = w.vector(p + "ssm_norm.weight")
        self.o = w.linear(p + "ssm_out.weight")
        self.q_scale = np.float32(c.linear_k_head_dim**-0.5)
        self.key_heads = np.array(c.linear_key_heads_of(), np.int64)

    @staticmethod
    def state_shapes(c: ModelConfig) -> dict[str, tuple[int, int] | tuple[int, int, int]]:
        """One sequence's states in a DeltaNet layer: the convolution's last inputs, the recurrence's."""
        return {"conv": (c.linear_conv_kernel - 1, c.linear_conv_channels),
                "recurrent": (c.linear_v_heads, c.linear_k_head_dim, c.linear_v_head_dim)}

    def __call__(self, h: np.ndarray, positions: np.ndarray, segments) -> np.ndarray:
        """h [n, hidden]; each segment's rows continue its own sequence's states."""
        return self.o(self.mixed(h, [(s.rows, s.start, s.cache) for s in segments]))

    def mixed(self, h: np.ndarray, spans) -> np.ndarray:
        """The heads' gated outputs [n, value heads × width], before `o` (ssm_out): `spans`
        (rows, first position, cache) of h, each continuing its own sequence's states."""
        c, n = self.c, h.shape[0]
        mixed, z, b, a = kernels.products(h, (self.qkv, self.z, self.beta, self.alpha))
        beta = sigmoid(b)
        per_head = np.exp(self.a * softplus(a + self.dt_bias)).astype(np.float32)
        decay = np.repeat(per_head[:, :, None], c.linear_k_head_dim, axis=2)  # one value for each key channel
        out = self.recurrence(mixed, decay, beta, spans)
        gated = kernels.rms_norm(out, self.norm, c.norm_eps) * (z * sigmoid(z)).reshape(out.shape)
        return gated.reshape(n, -1)

    def recurrence(self, mixed: np.ndarray, decay: np.ndarray, beta: np.ndarray, spans) -> np.ndarray:
        """The heads' outputs [n, value heads, width] of the convolution's channels `mixed` [n,
        q | k | v], with `decay` [n, value heads, key width] and `beta` [n, value heads]: each
        span's rows through its own sequence's convolution and recurrent states."""
        c = self.c
        out = np.empty((mixed.shape[0], c.linear_v_heads, c.linear_v_head_dim), np.float32)
        keys = c.linear_k_heads * c.linear_k_head_dim
        for rows, start, cache in spans:
            states = cache.states_from(self.layer, start)
            x = self.convolved(mixed[rows], states["conv"])
            count = x.shape[0]
            q = l2_normalized(x[:, :keys].reshape(count, c.linear_k_heads, -1)) * self.q_scale
            k = l2_normalized(x[:, keys:2 * keys].reshape(count, c.linear_k_heads, -1))
            v = np.ascontiguousarray(x[:, 2 * keys:].reshape(count, c.linear_v_heads, -1))
            kernels.gated_delta_rule(q, k, v, decay[rows], beta[rows], self.key_heads, states["recurrent"], out[rows])
        return out

    def convolved(self, x: np.ndarray, state: np.ndarray) -> np.ndarray:
        """silu of the causal depthwise convolution of x [n, channels] after the inputs `state`
        [kernel - 1, channels] holds, which then holds x's last ones."""
        taps = self.conv.shape[1]
        inputs = np.concatenate([state, x])
        y = sum(inputs[i:i + x.shape[0]] * self.conv[:, i] for i in range(taps))
        state[:] = inputs[inputs.shape[0] - state.shape[0]:]
        return (y * sigmoid(y)).astype(np.float32)


def mixer_for(c: ModelConfig, w, layer: int):
    """The token mixer of linear layer `layer`."""
    return KimiDeltaAttention(c, w, layer) if c.linear_kind == "kda" else GatedDeltaNet(c, w, layer)


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi delta attention: the gated DeltaNet's convolution, recurrence and states, with the
    decay, projections and output gate of the module doc's second paragraph."""

    def __init__(self, c: ModelConfig, w, layer: int):
        p = f"blk.{layer}."
        self.c, self.layer = c, layer
        self.q, self.k, self.v = (w.linear(p + f"attn_{x}.weight") for x in "qkv")
        self.f_a, self.f_b = w.linear(p + "ssm_f_a.weight"), w.linear(p + "ssm_f_b.weight")
        self.g_a, self.g_b = w.linear(p + "ssm_g_a.weight"), w.linear(p + "ssm_g_b.weight")
        self.beta = w.linear(p + "ssm_beta.weight")
        self.conv = np.concatenate([w.array(p + f"ssm_conv1d_{x}.weight") for x in "qkv"])  # [channels, kernel]
        self.a, self.dt_bias = w.vector(p + "ssm_a"), w.vector(p + "ssm_dt.bias")  # A = -exp(A_log) per head; per channel
        self.norm = w.vector(p + "ssm_norm.weight")
        self.o = w.linear(p + "attn_output.weight")
        self.q_scale = np.float32(c.linear_k_head_dim**-0.5)
        self.key_heads = np.array(c.linear_key_heads_of(), np.int64)  # head h serves itself

    def mixed(self, h: np.ndarray, spans) -> np.ndarray:
        c, n = self.c, h.shape[0]
        q, k, v, f, g, b = kernels.products(h, (self.q, self.k, self.v, self.f_a, self.g_a, self.beta))
        forget = (self.f_b(f) + self.dt_bias).reshape(n, c.linear_v_heads, c.linear_v_head_dim)
        if c.linear_gate_lower_bound:  # the safe gate: a log-decay between the bound and 0
            decay = np.exp(np.float32(c.linear_gate_lower_bound) * sigmoid(-self.a[None, :, None] * forget))
        else:
            decay = np.exp(softplus(forget) * self.a[None, :, None])
        decay = decay.astype(np.float32)
        out = self.recurrence(np.concatenate([q, k, v], axis=1), decay, sigmoid(b), spans)
        gated = kernels.rms_norm(out, self.norm, c.norm_eps) * sigmoid(self.g_b(g)).reshape(out.shape)
        return gated.reshape(n, -1)
