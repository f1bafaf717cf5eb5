"""The lattices of the IQ1/IQ2/IQ3 types: each grid index stands for 8 (IQ1, IQ2) or 4 (IQ3)
weights, and IQ2_XXS, IQ2_XS and IQ3_XXS pick 8 signs at a time from KSIGNS.

The tables are ggml's (`ggml-common.h`: iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid,
iq3s_grid, iq1s_grid, ksigns_iq2xs), taken from the `gguf` package, which packs them.
"""

from __future__ import annotations

from functools import cache

import gguf.quants
import numpy as np

# encoding -> the gguf-py class holding its grid (IQ1_M shares IQ1_S's)
_GRID_HOLDERS = {"IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S",
                 "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_S"}
GRID_ENCODINGS = tuple(_GRID_HOLDERS)

# ksigns_iq2xs: 7 sign bits and their parity as the eighth
KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8).copy()


@cache
def grid(encoding: str) -> np.ndarray:
    """int8 [entries, weights per entry]: the values each grid index of `encoding` stands for."""
    holder = getattr(gguf.quants, _GRID_HOLDERS[encoding])
    holder.init_grid()
    values = np.asarray(holder.grid).reshape(holder.grid_shape)
    table = values.astype(np.int8)
    assert np.array_equal(table, values)
    return table
