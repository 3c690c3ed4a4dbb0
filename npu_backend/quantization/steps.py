"""The two ways a layer is computed during calibration: in float (TVM) and exactly as the NPU will.

:class:`FloatLayers` compiles every layer of the float graph as its own Relax
function, once, with weights as arguments: the same compiled code gives the
float model's activations (float weights and inputs) and the values a layer
sees once its inputs and weights are quantized (dequantized ones), which is what
each layer's output range is chosen from.

:class:`NpuLayer` is one layer in the canonical QDQ form, partitioned for the
NPU and lowered to its command stream, run by the simulator on the int8 inputs
the previous layers produced: so the integers that calibration hands to the next
layer are the NPU's own, rounding and accumulator width included, not a float
model of them. A layer the NPU does not take runs as TVM runs it on the host.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from simulator.config import NpuConfig
from simulator.machine import run_stream

from ..reference import SOURCE_ATTR
from .layers import Layer
from .rewrite import (Operands, TensorQ, WeightQ, const, dequantize, dequantized_bias, dequantized_weight, emit_layer,
                      quantize)


def _tensor_var(name: str, shape, dtype: str) -> relax.Var:
    return relax.Var(name, relax.TensorType(tuple(int(d) for d in shape), dtype))


def _shape(var) -> tuple[int, ...]:
    return tuple(int(d) for d in var.ty.shape.values)


def _accumulator_var(layer: Layer):
    """The binding holding a weighted layer's accumulator (anchor plus bias), before its clamp."""
    return layer.bindings[1 if layer.bias is not None else 0].var


class FloatLayers:
    """Every layer as a float function ``layer_i(inputs..., [weight, bias], constants...)``, compiled once.

    A weighted layer returns ``(accumulator, output)``: the sum before its clamp is what the NPU's
    accumulator holds, so its peak is read from it.
    """

    def __init__(self, layers: list[Layer], folded: dict):
        bb = relax.BlockBuilder()
        for layer in layers:
            params = [_tensor_var(f"x{k}", _shape(v), "float32") for k, v in enumerate(layer.inputs)]
            env = dict(zip(layer.inputs, params))
            extra = []
            weight = bias = None
            if layer.weight is not None:
                weight = _tensor_var("w", layer.weight.shape, "float32")
                extra.append(weight)
                if layer.bias is not None:
                    bias = _tensor_var("b", layer.bias_shape, "float32")
                    extra.append(bias)
            constants = {c: _tensor_var(f"c{k}", c.value.shape, "float32") for k, c in enumerate(layer.constants)}
            ops = Operands(activation=lambda v, env=env: env[v], weight=lambda w=weight: w,
                           bias=lambda shape, b=bias: b, constant=lambda c, cs=constants: cs[c])
            with bb.function(f"layer_{layer.index}", params + extra + list(constants.values())):
                with bb.dataflow():
                    emitted: dict = {}
                    out = emit_layer(bb, layer, folded, ops, emitted)
                    if layer.weight is not None:
                        pair = bb.emit(relax.Tuple([emitted[_accumulator_var(layer)], out]))
                        result = bb.emit_output(pair)
                    else:
                        result = bb.emit_output(out)
                bb.emit_func_output(result)
        self.vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())

    def run(self, layer: Layer, inputs: list[np.ndarray], weight=None, bias=None, constants=()):
        """The layer's float output (and accumulator, for a weighted layer) for one sample."""
        args = [tvm.runtime.tensor(np.ascontiguousarray(x, dtype=np.float32)) for x in inputs]
        if layer.weight is not None:
            args.append(tvm.runtime.tensor(np.ascontiguousarray(weight, dtype=np.float32)))
            if layer.bias is not None:
                args.append(tvm.runtime.tensor(np.ascontiguousarray(bias, dtype=np.float32).reshape(layer.bias_shape)))
        args += [tvm.runtime.tensor(np.ascontiguousarray(c, dtype=np.float32)) for c in constants]
        result = self.vm[f"layer_{layer.index}"](*args)
        if layer.weight is not None:
            return result[0].numpy(), result[1].numpy()
        return None, result.numpy()


def quantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    """TVM's host ``quantize``: ``clip(round_half_even(x / scale) + zp)`` in float32."""
    scaled = np.asarray(x, np.float32) / np.float32(q.scale)
    return np.clip(np.rint(scaled) + q.zero_point, -128, 127).astype(np.int8)


def dequantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    return ((x.astype(np.int32) - q.zero_point).astype(np.float32) * np.float32(q.scale)).astype(np.float32)


class NpuLayer:
    """One quantized layer as the NPU runs it: its own QDQ module, partitioned, lowered and simulated."""

    def __init__(self, layer: Layer, folded: dict, inputs: list[TensorQ], output: TensorQ, weights: WeightQ | None,
                 constants: dict, source: str, config: NpuConfig):
        from ..codegen.lower import lower_module, npu_regions
        from ..partition import partition_for_npu
        from ..report import partition_report

        bb = relax.BlockBuilder()
        params = [_tensor_var(f"x{k}", _shape(v), "int8") for k, v in enumerate(layer.inputs)]
        by_var = {v: (p, q) for v, p, q in zip(layer.inputs, params, inputs)}
        ops = Operands(
            activation=lambda v: bb.emit(dequantize(by_var[v][0], by_var[v][1])),
            weight=lambda: bb.emit(dequantized_weight(weights)),
            bias=lambda shape: bb.emit(dequantized_bias(weights, shape)),
            constant=lambda c: bb.emit(dequantize(const(constants[c][0], "int8"), constants[c][1])))
        with bb.function("main", params):
            with bb.dataflow():
                if layer.kind.moves_int8:
                    out = emit_layer(bb, layer, folded, Operands(activation=lambda v: by_var[v][0]))
                    result = bb.emit_output(out)
                else:
                    out = emit_layer(bb, layer, folded, ops)
                    result = bb.emit_output(quantize(out, output))
            bb.emit_func_output(result)
        mod = bb.get().with_attr(SOURCE_ATTR, source)
        partitioned = partition_for_npu(mod, config)
        self.config = config
        self.weights = weights
        self.on_npu = all(o.op in ("relax.quantize", "relax.dequantize")
                          for o in partition_report(partitioned).host_ops)
        self.stream = None
        regions = npu_regions(partitioned)
        main = partitioned["main"]
        bindings = [b for block in main.body.blocks for b in block.bindings]
        if (len(regions) == 1 and len(bindings) == 1 and isinstance(bindings[0].value, relax.Call)
                and isinstance(bindings[0].value.op, tvm.ir.GlobalVar)
                and list(bindings[0].value.args) == list(main.params)):
            symbol, region = next(iter(regions.items()))
            self.stream = lower_module(partitioned)[symbol]
            self.names = [p.name for p in region.params]
        else:
            executable = tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm")
            self.vm = relax.VirtualMachine(executable, tvm.cpu())

    def run(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The int8 output for one sample, and how many accumulators overflowed computing it."""
        if self.stream is not None:
            outputs, stats = run_stream(self.stream, dict(zip(self.names, inputs)), self.config)
            return outputs["output0"], stats.total_overflows
        result = self.vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs])
        return result.numpy(), 0

