"""Loops that numpy runs far below the machine's speed, compiled for this CPU by the LLVM inside TVM.

Counting an int8 tensor's levels is one increment a byte; numpy has no such loop (``bincount`` first widens every
byte to a 64-bit index, eight times the bytes, then counts), so :func:`.observers.int8_summary` counted byte pairs
at 0.9 to 2 ns a byte. Compiled, the loop counts into four interleaved histograms (consecutive bytes of one level
would otherwise wait on each other's increment) at about 1 ns a byte or less.

A kernel's result is exact by construction (integer counts), so it is the same whatever the compiler does with the
loop. It is compiled once per process, at first use (about 0.05 s), with symbolic sizes: one kernel for every
tensor. A call releases the GIL, so the worker threads of :mod:`.parallel` run kernels side by side.
"""

from __future__ import annotations

import threading

import numpy as np

WAYS = 4
"""Interleaved histograms the count keeps (byte ``i`` counts in histogram ``i % WAYS``), summed at the end."""

_lock = threading.Lock()
_compiled: dict = {}


def byte_counts(values: np.ndarray) -> np.ndarray:
    """How many times each byte value 0..255 occurs in ``values`` (any 1-byte array, read as unsigned): int64
    ``[256]``, as ``np.bincount(values.view(np.uint8), minlength=256)``."""
    import tvm_ffi

    flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    counts = np.empty((WAYS, 256), np.int64)
    _kernel("byte_counts", _byte_counts_func)(tvm_ffi.from_dlpack(flat, require_alignment=0),
                                               tvm_ffi.from_dlpack(counts, require_alignment=0))
    return counts.sum(axis=0)


def _kernel(name: str, make):
    with _lock:  # one compilation per kernel, whichever thread asks first
        if name not in _compiled:
            import tvm
            from tvm.target import codegen

            target = tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
            module = tvm.IRModule({name: make().with_attr("global_symbol", name)})
            _compiled[name] = tvm.compile(module, target=target)[name]
        return _compiled[name]


def _byte_counts_func():
    from tvm.script import tirx as T

    ways = WAYS

    @T.prim_func(check_well_formed=False)
    def byte_counts(x_h: T.handle, h_h: T.handle):
        T.func_attr({"tir.noalias": True})
        n = T.int64()
        X = T.match_buffer(x_h, (n,), "uint8", align=1)  # any view: numpy's are not 64-byte aligned
        H = T.match_buffer(h_h, (ways, 256), "int64", align=8)
        for way, level in T.grid(ways, 256):
            H[way, level] = T.int64(0)
        for i in range(n // ways):
            for way in T.unroll(ways):
                level = T.Cast("int64", X[i * ways + way])
                H[way, level] = H[way, level] + T.int64(1)
        for i in range(n - n % ways, n):
            level = T.Cast("int64", X[i])
            H[0, level] = H[0, level] + T.int64(1)

    return byte_counts
