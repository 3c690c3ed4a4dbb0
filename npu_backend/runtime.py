"""Runtime hook: executes installed command streams when the Relax VM calls a region."""

from __future__ import annotations

import numpy as np
import tvm

from simulator.isa import BufferKind
from simulator.machine import run_stream
from simulator.stream import decode_stream

from .errors import NpuError
from .profiling import record_run

_INSTALLED: dict[str, bytes] = {}


def install_stream(symbol: str, data: bytes) -> None:
    """Bind ``symbol`` to a serialized stream, decoded once here and validated on every run."""
    previous = _INSTALLED.get(symbol)
    if previous is not None and previous != data:
        raise NpuError(f"symbol {symbol} is already bound to a different command stream")
    stream = decode_stream(data)
    inputs = [buf for _, buf in stream.buffers_of(BufferKind.INPUT)]
    outputs = [buf for _, buf in stream.buffers_of(BufferKind.OUTPUT)]
    _INSTALLED[symbol] = data

    def run(*args):
        if len(args) != len(inputs) + len(outputs):
            raise NpuError(f"{symbol}: expected {len(inputs) + len(outputs)} tensors, got {len(args)}")
        arrays = {buf.name: args[i].numpy() for i, buf in enumerate(inputs)}
        results, stats = run_stream(stream, arrays)
        for k, buf in enumerate(outputs):
            args[len(inputs) + k].copyfrom(np.ascontiguousarray(results[buf.name]))
        record_run(symbol, stats)

    tvm.register_global_func(symbol, run, override=True)


def is_installed(symbol: str) -> bool:
    return symbol in _INSTALLED


def installed_stream(symbol: str) -> bytes:
    try:
        return _INSTALLED[symbol]
    except KeyError:
        raise NpuError(f"no command stream installed for {symbol}") from None
