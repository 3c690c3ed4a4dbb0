"""The NPU driver: what an NPU region's exported function calls to run its command stream.

Runtime modules from ``relax.ext.npu`` (:mod:`npu_backend.codegen.embed`) carry their streams and
forward every region call here, to the global function :data:`DRIVER`, which ``import npu_backend``
registers. Here the device is the simulator. Decoding and validating a stream costs about as much as a
small layer, so decoded streams are kept, keyed by the SHA-256 the codegen embedded beside them; a
stream whose bytes do not hash to that digest (a damaged library) is refused before anything runs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import tvm

from simulator.isa import BufferKind, CommandStream
from simulator.machine import run_stream
from simulator.stream import decode_stream

from .errors import NpuError
from .profiling import record_run

DRIVER = "npu_backend.run_stream"
"""Global function name the embedded region functions call (one fact, read by the C emitter too)."""

_DECODED: OrderedDict[str, CommandStream] = OrderedDict()
_DECODED_LIMIT = 64
"""Decoded streams kept (least recently used go first): enough for every region of a few large models."""


def _stream(symbol: str, digest: str, data: bytes) -> CommandStream:
    stream = _DECODED.get(digest)
    if stream is None:
        if hashlib.sha256(data).hexdigest() != digest:
            raise NpuError(f"{symbol}: the embedded command stream does not match its SHA-256: the library is "
                           "damaged")
        stream = decode_stream(data)
        _DECODED[digest] = stream
        if len(_DECODED) > _DECODED_LIMIT:
            _DECODED.popitem(last=False)
    else:
        _DECODED.move_to_end(digest)
    return stream


def run_region(symbol: str, digest: str, data: bytes, *tensors) -> None:
    """Run one region call: the stream's inputs are the first tensors, its outputs (written here) the rest."""
    stream = _stream(symbol, digest, data)
    inputs = [buf for _, buf in stream.buffers_of(BufferKind.INPUT)]
    outputs = [buf for _, buf in stream.buffers_of(BufferKind.OUTPUT)]
    if len(tensors) != len(inputs) + len(outputs):
        raise NpuError(f"{symbol}: expected {len(inputs) + len(outputs)} tensors, got {len(tensors)}")
    arrays = {buf.name: tensors[i].numpy() for i, buf in enumerate(inputs)}
    results, stats = run_stream(stream, arrays)
    for k, buf in enumerate(outputs):
        tensors[len(inputs) + k].copyfrom(np.ascontiguousarray(results[buf.name]))
    record_run(symbol, stats)


def register_driver() -> None:
    tvm.register_global_func(DRIVER, run_region, override=True)
