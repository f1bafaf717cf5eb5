"""A gated DeltaNet layer (Qwen3-Next, Qwen3.5): the token mixer of a hybrid model's linear layers.

Per token: q, k, v from one projection through a causal depthwise convolution (its last
`kernel - 1` inputs are a state), SiLU; q and k L2-normalized per head; a decay
exp(A softplus(alpha + dt_bias)) and a write strength sigmoid(beta) per value head; the
gated delta rule (`kernels.gated_delta_rule`) over a [key width, value width] state per value
head; each head's output RMS-normalized, times SiLU of its gate z, then projected out. Both
states live in the sequence's `KVCache` and are the same size at any position.
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
        decay = np.exp(self.a * softplus(a + self.dt_bias)).astype(np.float32)
        out = np.empty((n, c.linear_v_heads, c.linear_v_head_dim), np.float32)
        keys = c.linear_k_heads * c.linear_k_head_dim
        for rows, start, cache in spans:
            states = cache.states_from(self.layer, start)
            x = self.convolved(mixed[rows], states["conv"])
            count = x.shape[0]
            q = l2_normalized(x[:, :keys].reshape(count, c.linear_k_heads, -1)) * self.q_scale
            k = l2_normalized(x[:, keys:2 * keys].reshape(count, c.linear_k_heads, -1))
            v = np.ascontiguousarray(x[:, 2 * keys:].reshape(count, c.linear_v_heads, -1))
            kernels.gated_delta_rule(q, k, v, decay[rows], beta[rows], self.key_heads, states["recurrent"], out[rows])
        gated = kernels.rms_norm(out, self.norm, c.norm_eps) * (z * sigmoid(z)).reshape(out.shape)
        return gated.reshape(n, -1)

    def convolved(self, x: np.ndarray, state: np.ndarray) -> np.ndarray:
        """silu of the causal depthwise convolution of x [n, channels] after the inputs `state`
        [kernel - 1, channels] holds, which then holds x's last ones."""
        taps = self.conv.shape[1]
        inputs = np.concatenate([state, x])
        y = sum(inputs[i:i + x.shape[0]] * self.conv[:, i] for i in range(taps))
        state[:] = inputs[inputs.shape[0] - state.shape[0]:]
        return (y * sigmoid(y)).astype(np.float32)
