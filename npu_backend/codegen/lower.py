"""Lowering of one NPU region (a ``Codegen="npu"`` function) to a command stream.

Each composite of the region is rebuilt as its record from its ``npu.*``
attributes (never from its body); the region becomes a :class:`RegionGraph`,
which :func:`npu_backend.codegen.graph.lower_graph` schedules and emits.
"""

from __future__ import annotations

import tvm
from tvm import relax

from simulator.config import NpuConfig
from simulator.isa import CommandStream

from ..errors import UnsupportedOpError
from ..ops import decode_composite
from ..params import OPERANDS_ATTR
from .graph import GraphLayer, RegionGraph, Tensor, lower_graph, lower_layer

__all__ = ["lower_layer", "lower_region", "lower_module", "npu_regions", "region_graph", "CONFIG_ATTR"]

CONFIG_ATTR = "npu.config"
"""Region attribute: the JSON of the ``NpuConfig`` the region was partitioned for."""


def _shape_of(expr) -> tuple[int, ...]:
    return tuple(int(d) for d in expr.ty.shape.values)


def _region_outputs(func: relax.Function, bindings: dict) -> list:
    result = func.body.body
    if isinstance(bindings.get(result), relax.Tuple):
        result = bindings[result]
    return list(result.fields) if isinstance(result, relax.Tuple) else [result]


def region_graph(func: relax.Function, symbol: str) -> RegionGraph:
    """The region's inputs, outputs and composite calls (in order) as a :class:`RegionGraph`."""
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    tensors: dict = {param: Tensor(param.name, _shape_of(param), str(param.ty.dtype)) for param in func.params}
    outputs = _region_outputs(func, bindings)
    if any(var in tensors for var in outputs):
        raise UnsupportedOpError("an NPU region cannot return its own input")
    layers = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, (relax.Function, relax.Tuple)):
                continue
            callee = bindings.get(value.op) if isinstance(value, relax.Call) else None
            if not isinstance(callee, relax.Function):
                raise UnsupportedOpError(f"NPU region {symbol} holds a binding that is not a composite call")
            params = decode_composite(callee.attrs)
            name = f"{params.op.value}_{len(layers)}"
            operands = tuple(tensors[value.args[int(i)]] if int(i) >= 0 else None
                             for i in callee.attrs[OPERANDS_ATTR])
            tensors[binding.var] = Tensor(f"{name}.ofm", _shape_of(binding.var), str(binding.var.ty.dtype))
            layers.append(GraphLayer(name, params, tensors[binding.var], operands))
    return RegionGraph(tuple(tensors[p] for p in func.params), tuple(tensors[v] for v in outputs), tuple(layers))


def lower_region(func: relax.Function, symbol: str, **options) -> CommandStream:
    """Turn a merged NPU region into a command stream for the hardware it was partitioned for (``options``:
    :func:`lower_graph`'s, e.g. ``variants``)."""
    config = NpuConfig.from_json(str(func.attrs[CONFIG_ATTR]))
    return lower_graph(region_graph(func, symbol), config, symbol, **options)


def npu_regions(mod: tvm.IRModule) -> dict[str, relax.Function]:
    """The ``Codegen="npu"`` functions of a partitioned module, by symbol."""
    return {str(func.attrs["global_symbol"]): func for func in mod.functions.values()
            if isinstance(func, relax.Function) and func.attrs is not None
            and func.attrs.get("Codegen") == "npu"}


def lower_module(mod: tvm.IRModule, **options) -> dict[str, CommandStream]:
    """Command streams of every NPU region of a partitioned module (for ``npu compile``; ``options``:
    :func:`lower_graph`'s)."""
    return {symbol: lower_region(func, symbol, **options) for symbol, func in npu_regions(mod).items()}
