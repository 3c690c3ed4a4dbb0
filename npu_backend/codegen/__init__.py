"""The ``relax.ext.npu`` codegen: NPU regions -> a runtime module carrying their command streams.

Importing this package registers nothing; :func:`register_codegen` (called by
``import npu_backend``) does.
"""

import tvm

from tvm import relax

from simulator.stream import encode_stream

from ..runtime import register_driver
from .embed import embed_streams
from .lower import lower_module, lower_region, npu_regions

STREAMS_OPTION = "streams"
"""``RunCodegen({"npu": {"streams": {symbol: bytes}}})``: streams lowered before (``npu compile`` writes them
to files and embeds the same bytes), used instead of lowering the region again."""


def npu_codegen(functions, options, constant_names):
    """Called by ``relax.transform.RunCodegen`` with every ``Codegen="npu"`` function.

    Returns one C source module (:mod:`npu_backend.codegen.embed`) with a function per region, named
    by the region's global symbol, which the Relax VM calls through ``call_dps_packed``.
    """
    given = dict(options[STREAMS_OPTION]) if options is not None and STREAMS_OPTION in options else {}
    streams, tensors = {}, 0
    for func in functions:
        symbol = str(func.attrs["global_symbol"])
        streams[symbol] = bytes(given[symbol]) if symbol in given else encode_stream(lower_region(func, symbol))
        result = func.body.body.ty
        tensors = max(tensors, len(func.params) + (len(result.fields) if isinstance(result, relax.TupleType) else 1))
    return [embed_streams(streams, tensors)] if streams else []


def build_partitioned(partitioned: tvm.IRModule, target: str = "llvm", streams: dict[str, bytes] | None = None):
    """``tvm.compile`` of a module from ``partition_for_npu`` after ``RunCodegen`` (TVM 0.27's ``tvm.compile`` does
    not run it, and fails on ``Codegen="npu"`` functions). ``streams``: the regions' serialized command streams,
    lowered already by the caller, which needs them too; they are embedded instead of lowered again."""
    options = None if streams is None else {"npu": {STREAMS_OPTION: streams}}
    return tvm.compile(relax.transform.RunCodegen(options)(partitioned), target=target)


def register_codegen() -> None:
    tvm.register_global_func("relax.ext.npu", npu_codegen, override=True)
    register_driver()


__all__ = ["npu_codegen", "build_partitioned", "register_codegen", "lower_module", "lower_region", "npu_regions", "STREAMS_OPTION"]
