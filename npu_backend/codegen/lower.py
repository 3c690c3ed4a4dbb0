"""Lowering of one NPU region (a ``Codegen="npu"`` function) to a command stream.

Each composite of the region is rebuilt as its record from its ``npu.*``
attributes (never from its body) and lowered by its operator's definition
(:mod:`npu_backend.ops`): checked with the same rules that offloaded it,
planned, prepared, then emitted as a tile program.
"""

from __future__ import annotations

import tvm
from tvm import relax

from simulator.config import NpuConfig
from simulator.hazards import dependencies
from simulator.isa import BufferKind, CommandStream

from ..errors import UnsupportedOpError
from ..legality import check
from ..ops import decode_composite, op_def
from ..params import OPERANDS_ATTR, NpuParams
from .emit import StreamBuilder

CONFIG_ATTR = "npu.config"
"""Region attribute: the JSON of the ``NpuConfig`` the region was partitioned for."""


def lower_layer(sb: StreamBuilder, p: NpuParams, layer: str, sources: list, dst: int) -> None:
    """Append the commands of one layer; refuse a record its operator's rules reject on this hardware."""
    definition = op_def(p.op)
    reason, plan, prepared = check(definition, p, sb.config)
    if reason is not None:
        raise UnsupportedOpError(f"{layer} ({definition.composite}) cannot run on {sb.config.name}: {reason}")
    definition.lower(sb, p, plan, prepared, layer, sources, dst)


def _shape_of(expr) -> tuple[int, ...]:
    return tuple(int(d) for d in expr.ty.shape.values)


def _region_outputs(func: relax.Function, bindings: dict) -> list:
    result = func.body.body
    if isinstance(bindings.get(result), relax.Tuple):
        result = bindings[result]
    return list(result.fields) if isinstance(result, relax.Tuple) else [result]


def lower_region(func: relax.Function, symbol: str) -> CommandStream:
    """Turn a merged NPU region into a command stream for the hardware it was partitioned for."""
    config = NpuConfig.from_json(str(func.attrs[CONFIG_ATTR]))
    sb = StreamBuilder(config)
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    values: dict = {}
    for param in func.params:
        values[param] = sb.add_buffer(param.name, BufferKind.INPUT, _shape_of(param),
                                      str(param.ty.dtype))
    outputs = _region_outputs(func, bindings)
    for k, var in enumerate(outputs):
        if var in values:
            raise UnsupportedOpError("an NPU region cannot return its own input")
        values[var] = sb.add_buffer(f"output{k}", BufferKind.OUTPUT, _shape_of(var), str(var.ty.dtype))
    layer_index = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, (relax.Function, relax.Tuple)):
                continue
            callee = bindings.get(value.op) if isinstance(value, relax.Call) else None
            if not isinstance(callee, relax.Function):
                raise UnsupportedOpError(f"NPU region {symbol} holds a binding that is not a composite call")
            params = decode_composite(callee.attrs)
            layer = f"{params.op.value}_{layer_index}"
            layer_index += 1
            if binding.var not in values:
                values[binding.var] = sb.add_buffer(f"{layer}.ofm", BufferKind.SCRATCH, _shape_of(binding.var),
                                                    str(binding.var.ty.dtype))
            sources = [values[value.args[int(i)]] if int(i) >= 0 else None for i in callee.attrs[OPERANDS_ATTR]]
            lower_layer(sb, params, layer, sources, values[binding.var])
    return CommandStream(name=symbol, config=config, buffers=tuple(sb.buffers),
                         commands=dependencies(sb.commands, config))


def npu_regions(mod: tvm.IRModule) -> dict[str, relax.Function]:
    """The ``Codegen="npu"`` functions of a partitioned module, by symbol."""
    return {str(func.attrs["global_symbol"]): func for func in mod.functions.values()
            if isinstance(func, relax.Function) and func.attrs is not None
            and func.attrs.get("Codegen") == "npu"}


def lower_module(mod: tvm.IRModule) -> dict[str, CommandStream]:
    """Command streams of every NPU region of a partitioned module (for ``npu compile``)."""
    return {symbol: lower_region(func, symbol) for symbol, func in npu_regions(mod).items()}
