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
from simulator.batch import run_stream_batch
from simulator.machine import run_stream

from ..reference import SOURCE_ATTR
from .batched_float import finish, plan_weighted
from .layers import Layer
from .rewrite import (Operands, TensorQ, WeightQ, const, dequantize, dequantized_bias, dequantized_weight, emit_layer,
                      quantize)


NPU_BATCH = 128
"""Calibration samples one simulator call runs (memory grows with it: N copies of SRAM and of the layer's tensors)."""


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
    accumulator holds, so its peak is read from it. Convolution and matmul layers are computed for all samples
    at once with numpy's BLAS (:mod:`.batched_float`); the others are compiled by TVM (those only) and run
    sample by sample.
    """

    def __init__(self, layers: list[Layer], folded: dict):
        self.plans = {layer.index: plan_weighted(layer) for layer in layers}
        self._layers, self._folded, self._vm = layers, folded, None

    @property
    def vm(self) -> relax.VirtualMachine:
        if self._vm is None:
            self._vm = self._compile([layer for layer in self._layers if self.plans[layer.index] is None], self._folded)
        return self._vm

    @staticmethod
    def _compile(layers: list[Layer], folded: dict) -> relax.VirtualMachine:
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
        if not layers:
            return None
        return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())

    def sums(self, layer: Layer, inputs: list[np.ndarray], weight: np.ndarray):
        """A weighted layer's anchor (before bias and clamp) on a batch ``[N, *shape]``; None if TVM runs it."""
        plan = self.plans[layer.index]
        return None if plan is None else plan.sums(inputs[0], weight)

    def run_batch(self, layer: Layer, inputs: list[np.ndarray], weight=None, bias=None, constants=(), sums=None):
        """(accumulator or None, output) of the layer for a batch of samples (each input ``[N, *shape]``).

        ``sums``: the layer's :meth:`sums` for these inputs and weight, when the caller has them already.
        """
        if self.plans[layer.index] is not None:
            if sums is None:
                return finish(layer, self.sums(layer, inputs, weight), bias, reuse=True)
            return finish(layer, sums, bias)
        results = [self.run(layer, [x[n] for x in inputs], weight, bias, constants) for n in range(len(inputs[0]))]
        outputs = np.stack([r[1] for r in results])
        return (None if layer.weight is None else np.stack([r[0] for r in results])), outputs

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


HOST_BLOCK = 1 << 16
"""Values the host quantize/dequantize convert at a time (in cache, through one reused buffer)."""


def _blocks(size: int):
    return (slice(start, start + HOST_BLOCK) for start in range(0, size, HOST_BLOCK))


def quantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    """TVM's host ``quantize``: ``clip(round_half_even(x / scale) + zp)`` in float32."""
    x = np.asarray(x)
    flat, out = x.reshape(-1), np.empty(x.shape, np.int8)
    buffer = np.empty(min(flat.size, HOST_BLOCK), np.float32)
    for part in _blocks(flat.size):
        scaled = buffer[:len(flat[part])]
        np.divide(flat[part], np.float32(q.scale), out=scaled, dtype=np.float32)
        np.rint(scaled, out=scaled)
        scaled += np.float32(q.zero_point)
        np.clip(scaled, -128, 127, out=scaled)
        out.reshape(-1)[part] = scaled
    return out


def dequantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    """TVM's host ``dequantize``: ``(x - zp) * scale`` in float32 (``x - zp`` is exact in float32 for int8)."""
    x = np.asarray(x)
    flat, out = x.reshape(-1), np.empty(x.shape, np.float32)
    values = out.reshape(-1)
    for part in _blocks(flat.size):
        np.subtract(flat[part], np.float32(q.zero_point), out=values[part], dtype=np.float32)
        values[part] *= np.float32(q.scale)
    return out


class NpuLayer:
    """One quantized layer as the NPU runs it: its own QDQ module, partitioned, lowered and simulated."""

    def __init__(self, layer: Layer, folded: dict, inputs: list[TensorQ], output: TensorQ, weights: WeightQ | None,
                 constants: dict, source: str, config: NpuConfig):
        from ..codegen import build_partitioned, lower_module, npu_regions
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
            self.vm = relax.VirtualMachine(build_partitioned(partitioned), tvm.cpu())

    def run_batch(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The int8 outputs for a batch of samples (each input ``[N, *shape]``), and how many accumulators
        overflowed computing them: the stream runs on :data:`NPU_BATCH` samples at a time
        (:func:`simulator.batch.run_stream_batch`, equal to one run per sample); a layer TVM builds runs per
        sample."""
        count = len(inputs[0])
        if self.stream is None:
            results = [self.run([x[n] for x in inputs]) for n in range(count)]
            return np.stack([r[0] for r in results]), sum(r[1] for r in results)
        outputs, overflows = [], 0
        for start in range(0, count, NPU_BATCH):
            feeds = {name: np.ascontiguousarray(x[start:start + NPU_BATCH]) for name, x in zip(self.names, inputs)}
            out, stats = run_stream_batch(self.stream, feeds, self.config)
            outputs.append(out["output0"])
            overflows += stats.total_overflows
        return np.concatenate(outputs), overflows

    def run(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The int8 output for one sample, and how many accumulators overflowed computing it."""
        if self.stream is not None:
            outputs, stats = run_stream(self.stream, dict(zip(self.names, inputs)), self.config)
            return outputs["output0"], stats.total_overflows
        result = self.vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs])
        return result.numpy(), 0

