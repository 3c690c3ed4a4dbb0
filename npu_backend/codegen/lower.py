"""Lowering of one NPU region (a ``Codegen="npu"`` function) to a command stream.

Each composite of the region is rebuilt as its record from its ``npu.*``
attributes (never from its body); the region becomes a :class:`RegionGraph`,
which :func:`npu_backend.codegen.graph.lower_graph` schedules and emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from simulator.config import NpuConfig
from simulator.isa import CommandStream, Convolution, Elementwise, Opcode

from ..errors import UnsupportedOpError
from ..legality import check
from ..ops import decode_composite, op_def
from ..params import OPERANDS_ATTR, ConvParams, ElementwiseParams, TransposeParams
from .graph import GraphLayer, RegionGraph, Tensor, lower_graph, lower_layer
from .programs import ElementwiseProgram, MacProgram, Operand, row_program

__all__ = ["lower_layer", "lower_region", "lower_module", "npu_regions", "region_graph", "mac_layer", "mac_layer_of",
           "MacLayer", "elementwise_layer", "elementwise_layer_of", "ElementwiseLayer", "CONFIG_ATTR"]

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


@dataclass(frozen=True)
class MacLayer:
    """A region that is one MAC-array layer, as one command over the whole layer would run it: what calibration
    needs to turn the layer's exact sums into the NPU's outputs (:func:`simulator.kernels.mac_register_output`)
    without lowering and simulating the region. The values are the lowering's own: the record, the multipliers
    its legality check prepared, and the command its row program writes."""

    opcode: Opcode
    conv: Convolution
    params: ConvParams
    table: np.ndarray
    """Bias, multiplier and shift words per output channel."""
    config: NpuConfig


def mac_layer(func: relax.Function, symbol: str) -> MacLayer | None:
    """The region as a :class:`MacLayer` when it computes a single convolution, depthwise convolution or fully
    connected layer whose row program the scheduler would use, with at most the layout transposes of an NCHW
    model around it (they move bytes, never change a value); None otherwise."""
    layer, _, config = _single_layer(func, symbol, ConvParams)
    return None if layer is None else mac_layer_of(layer.params, config, layer.name, list(layer.operands))


def _single_layer(func: relax.Function, symbol: str, kind: type
                  ) -> tuple[GraphLayer | None, RegionGraph, NpuConfig]:
    """The region's one layer of record type ``kind`` when every other is a layout transpose (else None), the
    region's graph, and the hardware the region was partitioned for."""
    config = NpuConfig.from_json(str(func.attrs[CONFIG_ATTR]))
    graph = region_graph(func, symbol)
    found = [g for g in graph.layers if isinstance(g.params, kind)]
    if len(found) != 1 or not all(isinstance(g.params, (kind, TransposeParams)) for g in graph.layers):
        return None, graph, config
    return found[0], graph, config


def mac_layer_of(params: ConvParams, config: NpuConfig, name: str = "mac", operands: list | None = None
                 ) -> MacLayer | None:
    """:func:`mac_layer` of a record alone: the layer's legality check, row program and whole-layer command, as the
    region's lowering derives them from its record (calibration predicts a layer's record and reads its outputs
    from this before the layer's own module is built, :mod:`npu_backend.quantization.predicted`)."""
    reason, _, prepared = check(op_def(params.op), params, config)
    if reason is not None:
        return None
    program = row_program(params, prepared, [None] if operands is None else operands)
    if not isinstance(program, MacProgram):
        return None
    g = program.g
    whole = program.command(name, 0, g.out_height, 0, g.out_channels,
                            [Operand(0, program.window(0, 0, g.out_height))], 0, [0, 0])
    return MacLayer(program.opcode, whole.payload, params, program.table, config)


@dataclass(frozen=True)
class ElementwiseLayer:
    """A region that is one int8 ADD, SUB or MUL of two computed tensors of one shape, with at most the layout
    transposes of an NCHW model around it: each output byte is the command's arithmetic on the two input bytes at
    its place, so calibration reads the layer's outputs from the command's table of every input pair
    (:func:`simulator.prepared.pair_table`) instead of lowering and simulating the region. The values are the
    lowering's own: the record, and the command over the whole layer its row program writes."""

    opcode: Opcode
    payload: Elementwise
    params: ElementwiseParams
    config: NpuConfig


def elementwise_layer(func: relax.Function, symbol: str) -> ElementwiseLayer | None:
    """The region as an :class:`ElementwiseLayer` when it is one, its operands the region's two inputs in their
    order (the table is read with the first operand's byte major; a subtraction's operands do not commute, and
    two inputs of one scale would not tell a swap in the record); None otherwise."""
    layer, graph, config = _single_layer(func, symbol, ElementwiseParams)
    if layer is None or tuple(layer.operands) != tuple(graph.inputs):
        return None
    return elementwise_layer_of(layer.params, config, layer.name, list(layer.operands))


def elementwise_layer_of(params: ElementwiseParams, config: NpuConfig, name: str = "elementwise",
                         operands: list | None = None) -> ElementwiseLayer | None:
    """:func:`elementwise_layer` of a record alone (``operands``: the region's tensors; by default two computed
    ones), as :func:`mac_layer_of` for a MAC layer: its legality check and row program, and the whole layer's
    command (None where the lowering would use another program: a constant or broadcast operand)."""
    reason, _, prepared = check(op_def(params.op), params, config)
    if reason is not None:
        return None
    program = row_program(params, prepared, ["input", "input2"] if operands is None else operands)
    if not isinstance(program, ElementwiseProgram):
        return None
    height = program.out.height
    whole = program.command(name, 0, height, 0, program.out.channels,
                            [Operand(0, program.window(k, 0, height)) for k in range(2)], 0, [])
    return ElementwiseLayer(program.opcode, whole.payload, params, config)
