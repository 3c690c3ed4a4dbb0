"""The NPU driver: what an NPU region's exported function calls to run its command stream.

Runtime modules from ``relax.ext.npu`` (:mod:`npu_backend.codegen.embed`) carry their streams and
forward every region call here, to the global function :data:`DRIVER`, which ``import npu_backend``
registers. Here the device is the simulator. A region's stream is the same on every call, so it is decoded,
validated, scheduled and prepared once (:mod:`simulator.prepared`: weights as float matrices, output stages
as float64 constants, elementwise tables) and kept, keyed by the SHA-256 the codegen embedded beside it; a
stream whose bytes do not hash to that digest (a damaged library) is refused before anything runs. The
streams kept are bounded in number and in the bytes their preparations hold, least recently used first out.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import tvm

from simulator.isa import BufferKind
from simulator.prepared import PreparedStream, prepare_stream
from simulator.stream import decode_stream

from .errors import NpuError
from .profiling import record_run

DRIVER = "npu_backend.run_stream"
"""Global function name the embedded region functions call (one fact, read by the C emitter too)."""

_PREPARED: OrderedDict[str, PreparedStream] = OrderedDict()
_PREPARED_LIMIT = 64
"""Prepared streams kept: enough for every region of a few large models."""
_PREPARED_BYTES = 1 << 30
"""What their memories and preparations may hold in all (MobileNetV2-1.0-224's: about 70 MB); the stream in use
always stays."""
_LOCK = threading.Lock()


def _prepared(symbol: str, digest: str, read: Callable[[], bytes]) -> PreparedStream:
    with _LOCK:
        prepared = _PREPARED.get(digest)
        if prepared is not None:
            _PREPARED.move_to_end(digest)
            return prepared
    data = read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise NpuError(f"{symbol}: the embedded command stream does not match its SHA-256: the library is damaged")
    prepared = prepare_stream(decode_stream(data))
    with _LOCK:
        _PREPARED[digest] = prepared
    return prepared


def _evict() -> None:
    """Drop the least recently used streams past the count or the bytes their preparations hold."""
    with _LOCK:
        while len(_PREPARED) > 1 and (len(_PREPARED) > _PREPARED_LIMIT or
                                      sum(p.prepared_bytes for p in _PREPARED.values()) > _PREPARED_BYTES):
            _PREPARED.popitem(last=False)


def run_region(symbol: str, digest: str, stream, *args) -> None:
    """Run one region call: the stream's inputs are the first tensors, its outputs (written here) the rest.

    ``stream`` is the embedded stream's address, its size the next argument (:mod:`npu_backend.codegen.embed`:
    the bytes, several MB for a large model, are copied only the first time a digest is seen), or, from a
    library built before that, the bytes themselves.
    """
    if isinstance(stream, (bytes, bytearray)):
        tensors, read = args, functools.partial(bytes, stream)
    else:
        size, *tensors = args
        read = functools.partial(ctypes.string_at, stream, size)
    prepared = _prepared(symbol, digest, read)
    stream = prepared.stream
    inputs = [buf for _, buf in stream.buffers_of(BufferKind.INPUT)]
    outputs = [buf for _, buf in stream.buffers_of(BufferKind.OUTPUT)]
    if len(tensors) != len(inputs) + len(outputs):
        raise NpuError(f"{symbol}: expected {len(inputs) + len(outputs)} tensors, got {len(tensors)}")
    arrays = {buf.name: tensors[i].numpy() for i, buf in enumerate(inputs)}
    results, stats = prepared.run(arrays)
    for k, buf in enumerate(outputs):
        tensors[len(inputs) + k].copyfrom(np.ascontiguousarray(results[buf.name]))
    record_run(symbol, stats)
    _evict()


def register_driver() -> None:
    tvm.register_global_func(DRIVER, run_region, override=True)
