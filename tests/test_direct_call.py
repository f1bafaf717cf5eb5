"""kernels.direct_call: a kernel called past numba's dispatch gives the dispatcher's results, and
any call whose arguments are of another kind goes through the dispatcher."""

from typing import NamedTuple

import numpy as np
from numba import njit

from colibri.runtime.kernels.direct_call import DirectCall


class Pair(NamedTuple):
    scale: np.ndarray
    shift: np.ndarray


@njit(cache=False)
def _scaled_into(x, pair, out, times):
    for i in range(x.shape[0]):
        out[i] = x[i] * pair.scale[i] * times + pair.shift[i]
    return out.sum()


def test_later_calls_skip_the_dispatcher_and_give_its_results():
    pair = Pair(np.arange(4, dtype=np.float32), np.ones(4, np.float32))
    call, out = DirectCall(_scaled_into), np.empty(4, np.float32)
    x = np.array([1, 2, 3, 4], np.float32)
    assert call(x, pair, out, 2) == _scaled_into(x, pair, np.empty(4, np.float32), 2)
    assert call.entry is not None  # bound to the overload the first call compiled
    calls = []
    entry = call.entry
    call.entry = lambda *args: calls.append(args) or entry(*args)
    y = np.array([5, 6, 7, 8], np.float32)
    assert call(y, pair, out, 3) == np.float32(sum(y * pair.scale * 3 + 1))
    np.testing.assert_array_equal(out, y * pair.scale * 3 + 1)
    assert len(calls) == 1


def test_other_kinds_of_arguments_go_through_the_dispatcher():
    pair = Pair(np.arange(4, dtype=np.float32), np.ones(4, np.float32))
    call, out = DirectCall(_scaled_into), np.empty(4, np.float32)
    call(np.ones(4, np.float32), pair, out, 1)
    calls = []
    entry = call.entry
    call.entry = lambda *args: calls.append(args) or entry(*args)
    wide = np.array([1, 2, 3, 4], np.float64)  # another dtype: its bytes read as float32 would be garbage
    assert call(wide, pair, out, 1) == sum(wide * pair.scale + 1)
    strided = np.arange(8, dtype=np.float32)[::2]  # not contiguous, where the overload is for C arrays
    call(strided, pair, out, 1)
    np.testing.assert_array_equal(out, strided * pair.scale + 1)
    other = Pair(np.full(4, 2, np.float32), np.zeros(4, np.float32))  # another record: the same types,
    call(np.ones(4, np.float32), other, out, 1)                       # but not the object bound
    np.testing.assert_array_equal(out, np.full(4, 2, np.float32))
    call(np.ones(4, np.float32), pair, out, 1.5)  # a float where an int was
    np.testing.assert_array_equal(out, pair.scale * 1.5 + 1)
    assert calls == []


def test_an_overload_for_strided_arrays_takes_any_strides():
    pair = Pair(np.arange(4, dtype=np.float32), np.ones(4, np.float32))
    call, out = DirectCall(_scaled_into), np.empty(4, np.float32)
    call(np.arange(8, dtype=np.float32)[::2], pair, out, 1)  # bound to the overload for 'A' arrays
    calls = []
    entry = call.entry
    call.entry = lambda *args: calls.append(args) or entry(*args)
    strided = np.arange(12, dtype=np.float32)[::3]
    call(strided, pair, out, 1)
    np.testing.assert_array_equal(out, strided * pair.scale + 1)
    assert len(calls) == 1
