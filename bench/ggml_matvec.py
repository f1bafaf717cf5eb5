"""ggml's own matrix product, timed through ctypes: the anchor for `kernel_speed.py`.

One ggml context holds a copy of the weight bytes and F32 activation rows; `ggml_mul_mat` in a
one-node graph, computed by libggml-cpu's `ggml_graph_compute_with_ctx` with the given threads,
is what llama.cpp runs for each matrix (the activations quantized to the type's
`vec_dot_type`, then for one row the type's `vec_dot` over the weight rows, for many its tiled
K-quant matmul where it has one), in plain CPU memory (no repacked buffer types).

    GgmlMatvec(Path(".venv/.../llama_cpp/lib")).seconds("IQ2_XXS", w, rows, cols, x, threads=2, repeat=7)
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import gguf
import numpy as np


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def default_library_folder() -> Path:
    """The llama extra's libraries (llama-cpp-python builds ggml for this CPU)."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


class GgmlMatvec:
    def __init__(self, folder: Path):
        base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        p = ctypes.c_void_p
        for name, restype, argtypes in (("ggml_init", p, [InitParams]), ("ggml_free", None, [p]),
                                        ("ggml_new_tensor_2d", p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                                        ("ggml_get_data", p, [p]), ("ggml_mul_mat", p, [p, p, p]),
                                        ("ggml_new_graph", p, [p]), ("ggml_build_forward_expand", None, [p, p])):
            getattr(base, name).restype, getattr(base, name).argtypes = restype, argtypes
        cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
        self.base, self.cpu, self.folder = base, cpu, folder

    def seconds(self, encoding: str, w: np.ndarray, rows: int, cols: int, x: np.ndarray, threads: int,
                repeat: int) -> float:
        """Median seconds of ggml's product of `rows` x `cols` weights in `encoding` (bytes `w`)
        with the float32 rows `x` ([n, cols], or one row [cols])."""
        return self.run(encoding, w, rows, cols, x, threads, repeat)[0]

    def product(self, encoding: str, w: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
        """ggml's product itself (float32 [n, rows]), to check that what is timed is the product."""
        return self.run(encoding, w, rows, cols, x, 1, 0)[1]

    def run(self, encoding, w, rows, cols, x, threads, repeat) -> tuple[float, np.ndarray]:
        ctx = self.base.ggml_init(InitParams(w.nbytes + 2 * x.nbytes + (256 << 20), None, False))
        try:
            a = self.base.ggml_new_tensor_2d(ctx, int(gguf.GGMLQuantizationType[encoding]), cols, rows)
            x = np.ascontiguousarray(x.reshape(-1, cols), np.float32)
            b = self.base.ggml_new_tensor_2d(ctx, int(gguf.GGMLQuantizationType.F32), cols, x.shape[0])
            ctypes.memmove(self.base.ggml_get_data(a), w.ctypes.data, w.nbytes)
            ctypes.memmove(self.base.ggml_get_data(b), x.ctypes.data, x.nbytes)
            graph = self.base.ggml_new_graph(ctx)
            out = self.base.ggml_mul_mat(ctx, a, b)
            self.base.ggml_build_forward_expand(graph, out)
            times = []
            for _ in range(repeat + 1):
                started = time.perf_counter()
                if self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
                    raise RuntimeError(f"ggml_graph_compute failed for {encoding}")
                times.append(time.perf_counter() - started)
            result = np.ctypeslib.as_array(ctypes.cast(self.base.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                           (x.shape[0], rows)).copy()
            return statistics.median(times[1:] or times), result  # the first run touches the pages
        finally:
            self.base.ggml_free(ctx)
