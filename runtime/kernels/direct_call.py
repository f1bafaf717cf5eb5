"""A compiled kernel called without numba's typing of its arguments on every call.

Numba's dispatcher types each argument of each call to find the compiled overload. For a decode
step's arguments (a layer's record and scratch: named tuples of dozens of arrays) that costs
more than some of the kernels' own work. `DirectCall` lets the first call go through the
dispatcher, then calls the entry point of the overload it used straight, as long as later calls
bring the same kind of arguments: arrays of the same dtype, dimensions, layout and flags, numbers
of the same Python type, and the very same objects otherwise. A call that brings anything else
goes through the dispatcher, as it always did; so the code that runs, and its bits, are the
dispatcher's.
"""

from __future__ import annotations

import numpy as np
from numba.core import types


class DirectCall:
    """`kernel` (a numba dispatcher) as a callable that skips its per-call typing once it can."""

    def __init__(self, kernel):
        self.kernel, self.entry, self.checks, self.tried = kernel, None, (), False

    def __call__(self, *args):
        if self.entry is not None and len(args) == len(self.checks) and all(
                same_kind(a) for same_kind, a in zip(self.checks, args)):
            return self.entry(*args)
        result = self.kernel(*args)
        if not self.tried:  # (typing the arguments in Python is slow: once)
            self.tried = True
            self.bind(args)
        return result

    def bind(self, args: tuple) -> None:
        """Keep the entry point the dispatcher compiled for exactly these arguments' types (none
        when it ran a compatible overload of other types instead, or `kernel` is a plain function)."""
        if not hasattr(self.kernel, "overloads"):
            return
        signature = tuple(self.kernel.typeof_pyval(a) for a in args)
        compiled = self.kernel.overloads.get(signature)
        if compiled is not None:
            self.entry, self.checks = compiled.entry_point, tuple(_same_kind(a, t) for a, t in zip(args, signature))


def _same_kind(value, numba_type):
    """A test that an argument would be typed as `value` was (`numba_type`)."""
    if isinstance(numba_type, types.Array) and type(value) is np.ndarray:
        dtype, ndim, layout = value.dtype, value.ndim, numba_type.layout
        writable, aligned = numba_type.mutable, numba_type.aligned
        return lambda a: (type(a) is np.ndarray and a.dtype == dtype and a.ndim == ndim
                          and (layout == "A" or (a.flags.c_contiguous if layout == "C" else a.flags.f_contiguous))
                          and a.flags.writeable == writable and a.flags.aligned == aligned)
    if type(value) in (int, float, bool):
        kind = type(value)
        return lambda a: type(a) is kind
    return lambda a: a is value
