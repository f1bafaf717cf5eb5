"""MLA's expanded keys and values, kept from one cut of a prompt to the next.

A batch or a sweep hands a prompt to a layer's token mixer in cuts (`batch.STEP_PROMPT_TOKENS`
tokens). A cut of `model.EXPANDED_MLA_QUERIES` or more attends with every cached position's
latent expanded by kv_b (`model.LatentAttention.expanded`), so without a memory each position is
expanded again by every later cut of its prompt. Kept, each position is expanded once a prompt.

A sequence's expansions live in its `KVCache` (`expansions`, one per layer), which drops a layer's
when a write lands below its end: the rows it was made from are no longer the cache's. Their
bytes come from the decoder's one `ExpansionBudget`; a cut that finds it spent expands every
position again, as it did before, to the same bits.
"""

from __future__ import annotations

import numpy as np

from colibri.formats.model_config import ModelConfig
from colibri.runtime.kernels.rows import GROUP

EXPANDED_MLA_KEEP_BYTES = 256 << 20  # kept expansions of all sequences at a time, float32


def position_bytes(c: ModelConfig) -> int:
    """What one position's kept expansion takes in an MLA model; 0 in others."""
    return 4 * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim) if c.attention == "mla" else 0


class ExpansionBudget:
    """Bytes the kept expansions may take together, granted first come first served."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def grant(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes


class Expansion:
    """kv_b times the cached latents of positions 0..upto-1 of one layer, in the blocks its cuts
    added: (first position, rows float32 [count, heads, per_head]), a later block's rows
    standing for an earlier one's where they overlap; their bytes granted by `budget`."""

    def __init__(self, budget: ExpansionBudget):
        self.blocks, self.budget, self.upto = [], budget, 0

    def heads(self, first: int, count: int) -> np.ndarray:
        """Heads first..first+count-1 of positions 0..upto-1: float32 [upto, count, per_head]."""
        out = np.empty((self.upto, count, self.blocks[0][1].shape[2]), np.float32)
        for start, rows in self.blocks:
            out[start:start + rows.shape[0]] = rows[:, first:first + count]
        return out

    def release(self) -> None:
        self.budget.release(sum(rows.nbytes for _, rows in self.blocks))


def expand(cache, layer: int, latents: np.ndarray, kv_b, shape: tuple[int, int], budget: ExpansionBudget) -> Expansion | None:
    """kv_b times latents [end, rank] (positions 0..end-1 of `cache`'s layer `layer`), each row
    [heads, per_head] (`shape`), from what the cache kept of its last cut: only the positions
    after it (from a multiple of the int8 product's GROUP, so every row takes the path it takes
    in one product of all of them) go through kv_b. Kept for the next cut; None, with nothing
    kept, when `budget` cannot take the new rows (the caller expands them itself)."""
    end = latents.shape[0]
    kept = cache.expansions.get(layer)
    done = 0 if kept is None else kept.upto - kept.upto % GROUP
    nbytes = (end - done) * int(np.prod(shape)) * 4
    if not budget.grant(nbytes):
        cache.forget_expansion(layer)
        return None
    if kept is None:
        kept = Expansion(budget)
        cache.keep_expansion(layer, kept)
    fresh = np.ascontiguousarray(latents[done:])
    kept.blocks.append((done, kv_b.times(kv_b.activation(fresh), end - done).reshape(end - done, *shape)))
    kept.upto = end
    return kept
