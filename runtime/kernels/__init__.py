"""Fused dequantize-and-multiply kernels for the colibri block encodings (numba).

    from colibri.runtime import kernels
    y = kernels.Matrix(w, "Q4_K", rows, cols)(x)

The package re-exports the public names of its modules, one job each:

- `matrices`: `Matrix`, `matmul`, `matvec`, `products`, `dequantize_rows`, and the three paths of a
  product (fast int8, AMX tiles, exact);
- `experts`: `ExpertKernel` (its `ExpertsRule`), `moe_experts`, `moe_experts_batch`, `add_weighted_rows`,
  `glu_times`;
- `attention`: causal softmax attention over the KV cache (which rows a query sees: `Seen`; how its
  scores become weights: `Scoring`);
- `routing`: `route`, the router's top-k choice (`RouteRule`);
- `recurrence`: `gated_delta_rule`, a DeltaNet layer's recurrence;
- `numerics`: softmax, silu, the gated activations (`GLU_KINDS`), `rms_norm` and `sigmoid_gated`;
- `activations`: the activation formats (`DOT_TYPES`) and their int8 quantization;
- `rows`: a row of weights times activations, the building block of every kernel, and `Product`,
  what a kernel takes of a matrix;
- `int8_tiles`: many activations times a Q4_K / Q5_K / Q6_K matrix on vpdpbusd tiles (prompts,
  batch steps and sweeps on AVX-512 VNNI), with the bits of `rows`' row dots;
- `blocks`: each quantized block type as LLVM IR (unpacker, dot, dequantizer); `grid_blocks`: the
  IQ1/IQ2/IQ3 ones, whose weights come from ggml's grids; `unpacked`: what an unpacker returns;
- `emitter`: the LLVM IR builder those are written with;
- `threads`: `set_threads`, `thread_count`, each thread's rows, `measure_read_bandwidth`.

Threads: each parallel kernel gives thread `t` one contiguous range of rows (one memory
stream per thread) and prefetches `PREFETCH_BYTES` ahead of the block it multiplies. Numba's
`workqueue` threading layer adds a fixed cost to every parallel call; `set_threads` warns
about it.
"""

from pathlib import Path

from colibri import kernel_cache
from colibri.formats import encodings, iq_grids

_HERE = Path(__file__).resolve().parent
# the IR builders and tables every kernel of runtime/ is compiled from (kernel_cache says why)
SOURCES = [*_HERE.glob("*.py"), _HERE.parent / "amx.py", encodings.__file__, iq_grids.__file__]
CACHES = [_HERE / "__pycache__", _HERE.parent / "__pycache__"]  # numba's cache files of those kernels
kernel_cache.drop_if_stale("runtime", SOURCES, CACHES)

from colibri.runtime.kernels.activations import (  # noqa: E402
    ACT_BLOCKS, INT8_ACTIVATIONS, DOT_TYPES, FAST_ENCODINGS, FAST_PATH_TOLERANCE, WIDEST_ACT_BLOCK, Q8_0Activation,
    Q8_KActivation, decoding_alone, without_amx,
)
from colibri.runtime.kernels.attention import (
    NO_CHOICE, NO_SINK, PARALLEL_ATTENTION_WORK, PROMPT_ATTENTION_BYTES, PROMPT_ATTENTION_QUERIES, QUERY_BLOCK,
    Scoring, Seen, attention, attention_into, attention_of_slots,
)
from colibri.runtime.kernels.blocks import BLOCK_TAGS, CACHE_LINE, PREFETCH_BYTES
from colibri.runtime.kernels.experts import ExpertKernel, add_weighted_rows, glu_times, moe_experts, moe_experts_batch
from colibri.runtime.kernels.matrices import Matrix, dequantize_rows, kernel_paths, matmul, matvec, products
from colibri.runtime.kernels.numerics import GLU, SILU, glu_of, rms_norm, sigmoid_gated
from colibri.runtime.kernels.recurrence import gated_delta_rule
from colibri.runtime.kernels.routing import route
from colibri.runtime.kernels.rows import CHUNK, GROUP, ROW_TILE
from colibri.runtime.kernels.threads import measure_read_bandwidth, most_threads, read_seconds, set_threads, thread_count

__all__ = [
    "ACT_BLOCKS", "INT8_ACTIVATIONS", "DOT_TYPES", "FAST_ENCODINGS", "FAST_PATH_TOLERANCE", "WIDEST_ACT_BLOCK",
    "Q8_0Activation", "Q8_KActivation", "decoding_alone", "without_amx",
    "NO_CHOICE", "NO_SINK", "PARALLEL_ATTENTION_WORK", "PROMPT_ATTENTION_BYTES", "PROMPT_ATTENTION_QUERIES",
    "QUERY_BLOCK", "Scoring", "Seen", "attention", "attention_into", "attention_of_slots",
    "BLOCK_TAGS", "CACHE_LINE", "PREFETCH_BYTES",
    "ExpertKernel", "add_weighted_rows", "glu_times", "moe_experts", "moe_experts_batch",
    "Matrix", "dequantize_rows", "kernel_paths", "matmul", "matvec", "products",
    "GLU", "SILU", "glu_of", "rms_norm", "sigmoid_gated",
    "gated_delta_rule",
    "route",
    "CHUNK", "GROUP", "ROW_TILE",
    "measure_read_bandwidth", "read_seconds", "most_threads", "set_threads", "thread_count",
]
