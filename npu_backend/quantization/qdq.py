"""The quantized model: the float graph with the calibrated qparams, in the canonical QDQ form.

The signature stays the float model's (float in, float out): inputs are
quantized where the graph begins and outputs dequantized where it ends. Inside,
every quantized layer reads its inputs through a dequantize of its own, its
weights as a dequantize of an int8 constant (per channel, zero point 0) and its
bias as a dequantize of an int32 constant (scale: input scale x weight scale),
and its output is quantized: exactly the form ``partition_for_npu`` offloads.
Layers kept in float read dequantized values and, where a quantized layer
consumes them, are quantized again.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..reference import SOURCE_ATTR
from .calibrate import Context, Plan
from .rewrite import Operands, const, dequantize, dequantized_bias, dequantized_weight, emit_layer, quantize
from .steps import with_tir


def emit_module(ctx: Context, plan: Plan) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in ctx.func.params]
    floats: dict = {}
    ints: dict = {}
    with bb.function("main", params):
        with bb.dataflow():
            for old, new in zip(ctx.func.params, params):
                floats[old] = new
                if ctx.has_q_point(old, plan):
                    ints[old] = bb.emit(quantize(new, plan.tensors[old]))

            def read(var):
                return bb.emit(dequantize(ints[var], plan.tensors[var]))

            for layer in ctx.layers:
                if ctx.quantized(layer, plan) and layer.kind.moves_int8:
                    ints[layer.output] = emit_layer(bb, layer, ctx.folded, Operands(activation=ints.__getitem__))
                elif ctx.quantized(layer, plan):
                    wq = plan.weights.get(layer.index)
                    constants = plan.constants.get(layer.index, {})
                    ops = Operands(
                        activation=read,
                        weight=lambda wq=wq: bb.emit(dequantized_weight(wq)),
                        bias=lambda shape, wq=wq: bb.emit(dequantized_bias(wq, shape)),
                        constant=lambda c, cs=constants: bb.emit(dequantize(const(cs[c][0], "int8"), cs[c][1])))
                    out = emit_layer(bb, layer, ctx.folded, ops)
                    ints[layer.output] = bb.emit(quantize(out, plan.tensors[layer.output]))
                else:
                    ops = Operands(activation=lambda v: floats[v] if v in floats else read(v),
                                   weight=lambda layer=layer: relax.const(layer.weight),
                                   bias=lambda shape, layer=layer: relax.const(layer.bias.reshape(shape)))
                    out = emit_layer(bb, layer, ctx.folded, ops)
                    floats[layer.output] = out
                    if ctx.has_q_point(layer.output, plan):
                        ints[layer.output] = bb.emit(quantize(out, plan.tensors[layer.output]))
            results = []
            for var in ctx.outputs:
                producer = ctx.producer.get(var)
                if var in ints and (producer is None or ctx.quantized(producer, plan)):
                    results.append(bb.emit(dequantize(ints[var], plan.tensors[var])))
                else:
                    results.append(floats[var])
            result = results[0] if len(results) == 1 else bb.emit(relax.Tuple(results))
            result = bb.emit_output(result)
        bb.emit_func_output(result)
    return with_tir(bb.get(), ctx.tir).with_attr(SOURCE_ATTR, ctx.source)
