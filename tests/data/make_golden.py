"""Regenerate the golden vectors of this folder with ggml itself.

Every quantized entry (`CASE/TYPE`, `CASE/TYPE+imatrix`) is made again from the file's own
`CASE/input` (and `CASE/imatrix`) by libggml-base's `ggml_quantize_chunk`, and every
`CASE/TYPE/dequant` by the type's `to_float`. The library is the one the optional `llama`
extra builds (`pip install -e '.[llama]'`, llama-cpp-python ships `libggml-base.so`), or any
other given with `--lib`; upstream builds it without `-march`, so without fused multiply-adds.

    python tests/data/make_golden.py --check          # every stored entry equals ggml's, or exit 1
    python tests/data/make_golden.py --out DIR        # write regenerated copies into DIR
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys

import gguf
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN_FILES = ("ggml_quants_golden.npz", "ggml_quants_golden_all.npz")


class TypeTraits(ctypes.Structure):
    """ggml.h's `struct ggml_type_traits` (its leading fields, up to `to_float`)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def find_library() -> pathlib.Path:
    """libggml-base from the installed llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        sys.exit("make_golden: llama_cpp is not installed (pip install -e '.[llama]'), or give --lib")
    found = sorted(pathlib.Path(llama_cpp.__file__).parent.rglob("libggml-base.*"))
    if not found:
        sys.exit(f"make_golden: no libggml-base in {pathlib.Path(llama_cpp.__file__).parent}")
    return found[0]


class Ggml:
    """The two ggml calls the golden vectors come from."""

    def __init__(self, path: pathlib.Path):
        lib = ctypes.CDLL(str(path))
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib = lib

    def quantize(self, qtype: gguf.GGMLQuantizationType, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        rows, n = x.shape
        weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        out = np.zeros((rows, n // weights * nbytes), np.uint8)
        im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
        written = self.lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n,
                                               None if im is None else im.ctypes.data)
        if written != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk({qtype.name}) wrote {written} bytes, expected {out.nbytes}")
        return out

    def dequantize(self, qtype: gguf.GGMLQuantizationType, blocks: np.ndarray, n: int) -> np.ndarray:
        traits = self.lib.ggml_get_type_traits(int(qtype)).contents
        to_float = TO_FLOAT(traits.to_float)
        blocks = np.ascontiguousarray(blocks)
        out = np.zeros((blocks.shape[0], n), np.float32)
        for row in range(blocks.shape[0]):
            to_float(blocks[row].ctypes.data, out[row].ctypes.data, n)
        return out


def regenerate(ggml: Ggml, stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every entry of a golden file made again from its inputs."""
    made = {k: v for k, v in stored.items() if k.endswith(("/input", "/imatrix"))}
    for key in sorted(stored):
        case, _, rest = key.partition("/")
        if rest in ("input", "imatrix"):
            continue
        name, dequant = rest.removesuffix("/dequant"), rest.endswith("/dequant")
        qtype = gguf.GGMLQuantizationType[name.removesuffix("+imatrix").upper()]
        x = stored[f"{case}/input"]
        if dequant:
            source = f"{case}/{name}" if f"{case}/{name}" in stored else f"{case}/{name}+imatrix"
            blocks = made.get(source)
            if blocks is None:
                blocks = made[source] = ggml.quantize(qtype, x, stored[f"{case}/imatrix"] if "+" in source else None)
            made[key] = ggml.dequantize(qtype, blocks, x.shape[1])
        elif key not in made:
            made[key] = ggml.quantize(qtype, x, stored[f"{case}/imatrix"] if name.endswith("+imatrix") else None)
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=pathlib.Path, help="libggml-base to use (default: llama-cpp-python's)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare ggml's output with the stored files")
    mode.add_argument("--out", type=pathlib.Path, metavar="DIR", help="write regenerated files into DIR")
    args = p.parse_args()
    ggml = Ggml(args.lib or find_library())
    failed = 0
    for name in GOLDEN_FILES:
        with np.load(HERE / name) as data:
            stored = dict(data)
        made = regenerate(ggml, stored)
        differ = [k for k in stored if not np.array_equal(stored[k], made[k])]
        print(f"{name}: {len(stored) - len(differ)} of {len(stored)} entries equal ggml's")
        for k in differ:
            print(f"  differs: {k}")
        failed += len(differ)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(args.out / name, **made)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
