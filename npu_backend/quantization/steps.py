"""The two ways a layer is computed during calibration: in float (TVM) and exactly as the NPU will.

:class:`FloatLayers` compiles every layer of the float graph as its own Relax
function, once, with weights as arguments: the same compiled code gives the
float model's activations (float weights and inputs) and the values a layer
sees once its inputs and weights are quantized (dequantized ones), which is what
each layer's output range is chosen from. Convolutions, matmuls and unclamped
binary elementwise layers are computed with numpy instead, for the whole batch.
:class:`ReferencePass` runs the float model's layers on a thread of their own,
ahead of the calibration walk.

:class:`NpuLayer` is one layer in the canonical QDQ form, partitioned for the
NPU and lowered to its command stream, run by the simulator on the int8 inputs
the previous layers produced: so the integers that calibration hands to the next
layer are the NPU's own, rounding and accumulator width included, not a float
model of them. A region that is one MAC layer is not lowered: its record goes to
the simulator's output stage with the layer's exact sums
(:mod:`npu_backend.quantization.integer_sums`). A layer the NPU does not take
runs as TVM runs it on the host.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from simulator.config import NpuConfig
from simulator.batch import PreparedBatch

from ..reference import SOURCE_ATTR
from ..relax_exprs import is_call
from . import buffers, parallel
from .batched_float import CHUNK_ELEMENTS, LayerSums, chunks, plan_weighted
from .layers import Layer, resolve
from .parallel import run_all
from .transpose import to_channels_last
from .rewrite import (Operands, TensorQ, WeightQ, const, dequantize, dequantized_bias, dequantized_weight, emit_layer,
                      quantize)


NPU_BATCH = 128
"""Calibration samples one simulator call runs (memory grows with it: N copies of SRAM and of the layer's tensors)."""
NPU_SPLIT_ELEMENTS = 1 << 18
"""Input values (over the whole batch) from which a layer's batch is split between the worker threads, one
simulator call each: the stream is prepared once (:class:`simulator.batch.PreparedBatch`), but each call still
walks its commands in Python (which holds the GIL), which only layers this large repay."""


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
    at once with numpy's BLAS (:mod:`.batched_float`), unclamped add/subtract/multiply layers with numpy's
    ufuncs (:class:`ElementwiseLayer`); the others are compiled by TVM (those only) and run sample by sample.
    """

    def __init__(self, layers: list[Layer], folded: dict, tir: dict | None = None):
        self.plans = {layer.index: plan_weighted(layer) for layer in layers}
        self.elementwise = {layer.index: _elementwise_operands(layer, folded) for layer in layers}
        self._layers, self._folded, self._tir, self._vm = layers, folded, dict(tir or {}), None
        self._vm_lock = threading.Lock()  # the reference pass and the walk share one VM, which is not reentrant

    @property
    def vm(self) -> relax.VirtualMachine:
        with self._vm_lock:
            if self._vm is None:
                with parallel.TVM_LOCK:
                    self._vm = self._compile([layer for layer in self._layers if self._on_tvm(layer)], self._folded,
                                             self._tir)
            return self._vm

    def _on_tvm(self, layer: Layer) -> bool:
        return self.plans[layer.index] is None and self.elementwise[layer.index] is None

    @staticmethod
    def _compile(layers: list[Layer], folded: dict, tir: dict | None = None) -> relax.VirtualMachine:
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
        return relax.VirtualMachine(tvm.compile(with_tir(bb.get(), tir), target="llvm"), tvm.cpu())

    def sums(self, layer: Layer, inputs: list[np.ndarray], weight: np.ndarray) -> LayerSums | None:
        """A weighted layer's anchor (before bias and clamp) on a batch ``[N, *shape]``; None if TVM runs it."""
        plan = self.plans[layer.index]
        return None if plan is None else LayerSums(layer, plan.sums(inputs[0], weight))

    def run_batch(self, layer: Layer, inputs: list[np.ndarray], weight=None, bias=None, constants=(),
                  totals_only: bool = False):
        """(accumulator or None, output) of the layer for a batch of samples (each input ``[N, *shape]``);
        ``totals_only``: a numpy-planned layer's :class:`.batched_float.ChannelTotals` for its accumulators."""
        plan = self.plans[layer.index]
        if plan is not None:
            return plan.finished(layer, inputs[0], weight, bias, totals_only)
        operands = self.elementwise[layer.index]
        if operands is not None:
            return None, operands.run(inputs, constants)
        results = [self.run(layer, [x[n] for x in inputs], weight, bias, constants) for n in range(len(inputs[0]))]
        outputs = np.stack([r[1] for r in results])
        return (None if layer.weight is None else np.stack([r[0] for r in results])), outputs

    def run(self, layer: Layer, inputs: list[np.ndarray], weight=None, bias=None, constants=()):
        """The layer's float output (and accumulator, for a weighted layer) for one sample."""
        args = [_host_tensor(x) for x in inputs]
        if layer.weight is not None:
            args.append(_host_tensor(weight))
            if layer.bias is not None:
                args.append(_host_tensor(np.asarray(bias, np.float32).reshape(layer.bias_shape)))
        args += [_host_tensor(c) for c in constants]
        vm = self.vm
        with self._vm_lock:
            result = vm[f"layer_{layer.index}"](*args)
        if layer.weight is not None:
            return result[0].numpy(), result[1].numpy()
        return None, result.numpy()


def with_tir(mod: tvm.IRModule, tir: dict | None) -> tvm.IRModule:
    """``mod`` with the TIR functions its ``call_tir`` bindings call, of ``tir`` (:attr:`.calibrate.Context.tir`):
    those alone, as the model's importer may have left others (compiling MobileNetV2's unused ones took 1.5 s)."""
    if not tir:
        return mod
    called = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: called.add(e.args[0]) if is_call(e, "relax.call_tir")
                                            else None)
    for var, func in tir.items():
        if var in called:
            mod[var] = func
    return mod


def _host_tensor(values) -> tvm.runtime.Tensor:
    """float32 ``values`` as a TVM tensor of the same shape: a scalar constant stays 0-d (``np.ascontiguousarray``
    would make it 1-d, which the layer's function refuses)."""
    return tvm.runtime.tensor(np.asarray(values, np.float32, order="C"))


_ELEMENTWISE = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply}
"""Binary operators a layer of their own computes with numpy: one IEEE float32 operation per element, the same
in any implementation (TVM's kernel included), so any split of the batch gives TVM's values."""


class ElementwiseLayer:
    """An unclamped add, subtract or multiply of activations (and float constants), for the whole batch."""

    def __init__(self, ufunc: np.ufunc, operands: list[tuple[str, int, int]], rank: int):
        self.ufunc, self.operands, self.rank = ufunc, operands, rank

    def run(self, inputs: list[np.ndarray], constants) -> np.ndarray:
        args, batched = [], []
        for role, k, rank in self.operands:
            if role == "input":
                x = np.asarray(inputs[k], np.float32)
                args.append(x.reshape(x.shape[0], *(1,) * (self.rank - rank), *x.shape[1:]))
                batched.append(True)
            else:
                args.append(np.asarray(constants[k], np.float32))
                batched.append(False)
        out = buffers.empty(np.broadcast_shapes(*(a.shape for a in args)), np.float32)

        def chunk(part: slice) -> None:
            self.ufunc(*(a[part] if b else a for a, b in zip(args, batched)), out=out[part])

        run_all(chunk, chunks(len(out), out[0].size))
        return out


def _elementwise_operands(layer: Layer, folded: dict) -> ElementwiseLayer | None:
    """The numpy form of a one-binding add/subtract/multiply layer without a clamp; None for any other layer."""
    if layer.weight is not None or layer.clamp is not None or len(layer.bindings) != 1:
        return None
    value = layer.bindings[0].value
    ufunc = next((f for name, f in _ELEMENTWISE.items() if is_call(value, name)), None)
    if ufunc is None or len(value.args) != 2:
        return None
    constants = list(layer.constants)
    operands = []
    for arg in value.args:
        if isinstance(arg, relax.Var):
            var = resolve(arg, folded)
            if var not in layer.inputs:
                return None  # a folded constant: TVM's path handles it
            operands.append(("input", layer.inputs.index(var), len(var.ty.shape.values)))
        elif isinstance(arg, Constant) and arg in layer.constants:
            operands.append(("constant", constants.index(arg), arg.value.numpy().ndim))
        else:
            return None
    return ElementwiseLayer(ufunc, operands, len(layer.bindings[0].var.ty.shape.values))


class ReferencePass:
    """The float model's layers, computed in order on a thread of their own, at most :data:`LOOKAHEAD` layers
    ahead of the calibration walk that takes them (:meth:`take`): the float model does not depend on any
    quantization decision, so its matrix multiplies run while the walk builds and simulates NPU layers.

    Each layer's inputs are released after their last use, as the walk releases its own. ``summarize(layer,
    accumulators)``, if given, replaces a weighted layer's accumulators in what :meth:`take` returns: what the walk
    reads of them, computed here, beside it, so that the batch-sized array can be released at once. ``run``
    computes a layer (default :meth:`FloatLayers.run_batch`; the walk's keeps some tensors channels last).
    """

    LOOKAHEAD = 1

    def __init__(self, floats: FloatLayers, layers: list[Layer], values: dict, last_use: dict, keep, summarize=None,
                 run=None):
        floats.vm  # compiled here: TVM's BlockBuilder keeps one stack for all threads, the walk's NPU layers use it
        self._state = _ReferenceState(layers, dict(values), last_use, set(keep), summarize, run or floats.run_batch)
        parallel.spawn(self._state.run, "npu-quantize-reference")

    def take(self, layer: Layer):
        """(accumulator or None, output) of ``layer`` over the batch; layers are taken in order."""
        return self._state.take(layer.index)

    def __del__(self):
        state = getattr(self, "_state", None)  # None: the float layers failed to compile
        if state is not None:
            state.close()


class _ReferenceState:
    def __init__(self, layers, values, last_use, keep, summarize, run):
        self.layers, self.values, self.last_use, self.keep = layers, values, last_use, keep
        self.run_batch = run
        self.summarize = summarize
        self.results: dict = {}
        self.taken = -1
        self.error = None
        self.closed = False
        self.ready = threading.Condition()

    def run(self) -> None:
        try:
            for layer in self.layers:
                with self.ready:
                    self.ready.wait_for(lambda: self.closed or layer.index <= self.taken + ReferencePass.LOOKAHEAD)
                    if self.closed:
                        return
                result = self.run_batch(layer, [self.values[v] for v in layer.inputs], layer.weight,
                                               layer.bias, list(layer.constants.values()))
                self.values[layer.output] = result[1]
                if self.summarize is not None and result[0] is not None:
                    result = (self.summarize(layer, result[0]), result[1])
                for v in layer.inputs:
                    if self.last_use.get(v) == layer.index and v not in self.keep:
                        self.values.pop(v, None)
                with self.ready:
                    self.results[layer.index] = result
                    self.ready.notify_all()
        except BaseException as error:  # handed to the walk, which raises it
            with self.ready:
                self.error = error
                self.ready.notify_all()

    def take(self, index: int):
        with self.ready:
            self.ready.wait_for(lambda: index in self.results or self.error is not None)
            if index not in self.results:
                raise self.error
            self.taken = index
            self.ready.notify_all()
            return self.results.pop(index)

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()


HOST_BLOCK = 1 << 16
"""Values the host quantize/dequantize convert at a time (in cache, through one reused buffer)."""


def _spans(size: int) -> list[slice]:
    """A flat array's values as whole :data:`HOST_BLOCK` runs, at least :data:`CHUNK_ELEMENTS` each (one task per
    worker thread, each converting its span block by block)."""
    step = max(CHUNK_ELEMENTS, -(-size // (parallel.WORKERS * HOST_BLOCK)) * HOST_BLOCK)
    return [slice(start, min(size, start + step)) for start in range(0, size, step)]


def quantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    """TVM's host ``quantize``: ``clip(round_half_even(x / scale) + zp)`` in float32 (elementwise: any split
    of the values gives the same)."""
    x = np.asarray(x)
    flat, out = x.reshape(-1), buffers.empty(x.shape, np.int8)
    values = out.reshape(-1)

    def span(part: slice) -> None:
        buffer = np.empty(min(part.stop - part.start, HOST_BLOCK), np.float32)
        for start in range(part.start, part.stop, HOST_BLOCK):
            block = slice(start, min(part.stop, start + HOST_BLOCK))
            scaled = buffer[:block.stop - block.start]
            np.divide(flat[block], np.float32(q.scale), out=scaled, dtype=np.float32)
            np.rint(scaled, out=scaled)
            scaled += np.float32(q.zero_point)
            np.clip(scaled, -128, 127, out=scaled)
            values[block] = scaled

    run_all(span, _spans(flat.size))
    return out


def dequantize_host(x: np.ndarray, q: TensorQ) -> np.ndarray:
    """TVM's host ``dequantize``: ``(x - zp) * scale`` in float32 (``x - zp`` is exact in float32 for int8)."""
    x = np.asarray(x)
    flat, out = x.reshape(-1), buffers.empty(x.shape, np.float32)
    values = out.reshape(-1)

    def span(part: slice) -> None:
        for start in range(part.start, part.stop, HOST_BLOCK):
            block = slice(start, min(part.stop, start + HOST_BLOCK))
            np.subtract(flat[block], np.float32(q.zero_point), out=values[block], dtype=np.float32)
            values[block] *= np.float32(q.scale)

    run_all(span, _spans(flat.size))
    return out


@dataclass(frozen=True)
class Centred:
    """An int8 tensor as the MAC array reads it: its values channels last, and the zero point the sums subtract
    (a chunk at a time as they are formed, :meth:`.batched_float.WeightedPlan.sums`: a float32 copy of the batch
    would be four times its bytes, written and read once more)."""

    values: np.ndarray
    zero_point: int

    @property
    def most(self) -> int:
        """The largest ``|x - zero_point|`` any int8 ``x`` has: a bound on its layers' sums
        (:func:`.integer_sums.exact_bound`) without reading the values."""
        if self.values.dtype != np.int8:
            raise ValueError(f"the int8 range bounds int8 values, not {self.values.dtype}")
        return max(128 + self.zero_point, 127 - self.zero_point)

    @functools.cached_property
    def largest(self) -> int:
        """Its largest ``|x - zero_point|``, read from the values (once, on first use: where :attr:`most` bounds
        a layer's sums well enough it is never read; the two passes over every layer's input had been 0.1-0.15 s
        of a MobileNetV2 calibration's main thread)."""
        x = self.values

        def part(rows: slice) -> tuple[int, int]:
            return int(x[rows].min()), int(x[rows].max())

        extremes = run_all(part, chunks(len(x), x[0].size))
        low, high = min(e[0] for e in extremes), max(e[1] for e in extremes)
        return max(abs(low - self.zero_point), abs(high - self.zero_point))


def centre_host(x: np.ndarray, zero_point: int, channels_first: bool) -> Centred:
    """An int8 batch ``[N, ...]`` as :class:`Centred`; an NCHW batch ``[N, 1, C, H, W]`` (``channels_first``)
    comes out NHWC, its bytes transposed (:mod:`.transpose`), a sample chunk per task."""
    x = np.asarray(x)
    if channels_first:
        out = buffers.empty(np.moveaxis(x, 2, -1).shape, x.dtype)
        to_channels_last(x, out)
        x = out
    return Centred(x, int(zero_point))


@dataclass(frozen=True)
class LayerSpec:
    """What a quantized layer's NPU module is built from: the layer and calibration's decisions about it."""

    layer: Layer
    folded: dict
    inputs: list
    """The :class:`.rewrite.TensorQ` of each input."""
    output: TensorQ
    weights: WeightQ | None
    constants: dict


def layer_module(specs: list[LayerSpec], source: str) -> tuple[tvm.IRModule, list[list[relax.Var]]]:
    """The layers in the canonical QDQ form, each from int8 parameters of its own, in one ``main`` (returning
    their int8 outputs, a tuple of them for several), and each layer's parameters."""
    bb = relax.BlockBuilder()
    params = [[_tensor_var(f"x{k}" if len(specs) == 1 else f"l{n}_x{k}", _shape(v), "int8")
               for k, v in enumerate(spec.layer.inputs)] for n, spec in enumerate(specs)]
    with bb.function("main", [p for layer_params in params for p in layer_params]):
        with bb.dataflow():
            outputs = [_emit_quantized(bb, spec, layer_params) for spec, layer_params in zip(specs, params)]
            result = bb.emit_output(outputs[0] if len(specs) == 1 else relax.Tuple([bb.emit(o) for o in outputs]))
        bb.emit_func_output(result)
    return bb.get().with_attr(SOURCE_ATTR, source), params


def _emit_quantized(bb: relax.BlockBuilder, spec: LayerSpec, params: list[relax.Var]) -> relax.Expr:
    """The layer's bindings; returns its output: a var, or the final ``quantize`` call, not yet bound (one layer's
    module binds it as the function's output)."""
    layer, weights, constants = spec.layer, spec.weights, spec.constants
    by_var = {v: (p, q) for v, p, q in zip(layer.inputs, params, spec.inputs)}
    if layer.kind.moves_int8:
        return emit_layer(bb, layer, spec.folded, Operands(activation=lambda v: by_var[v][0]))
    ops = Operands(
        activation=lambda v: bb.emit(dequantize(by_var[v][0], by_var[v][1])),
        weight=lambda: bb.emit(dequantized_weight(weights)),
        bias=lambda shape: bb.emit(dequantized_bias(weights, shape)),
        constant=lambda c: bb.emit(dequantize(const(constants[c][0], "int8"), constants[c][1])))
    return quantize(emit_layer(bb, layer, spec.folded, ops), spec.output)


def built_records(specs: list[LayerSpec], source: str, config: NpuConfig) -> list:
    """The record each layer's build gives: its :class:`npu_backend.codegen.lower.MacLayer`, or its
    :class:`npu_backend.codegen.lower.ElementwiseLayer` (None where the layer is not one NPU region of its inputs,
    or neither), the layers built as one module (:func:`layer_module`): what :class:`NpuLayer` finds of each alone,
    one ``partition_for_npu`` for them all."""
    from ..codegen.lower import elementwise_layer, mac_layer
    from ..partition import partition_for_npu

    mod, params = layer_module(specs, source)
    partitioned = partition_for_npu(mod, config)
    main = partitioned["main"]
    result = main.body.body
    if len(specs) > 1:
        bound = next((b.value for block in main.body.blocks for b in block.bindings if b.var.same_as(result)), None)
        outputs = list(bound.fields) if isinstance(bound, relax.Tuple) and len(bound.fields) == len(specs) else []
    else:
        outputs = [result]
    regions = _whole_regions(partitioned, outputs, params) if outputs else [None] * len(specs)
    return [None if found is None else mac_layer(found[1], found[0]) or elementwise_layer(found[1], found[0])
            for found in regions]


def _whole_regions(partitioned: tvm.IRModule, outputs: list, params: list[list[relax.Var]]) -> list:
    """For each layer, (symbol, region) when its output (a var of the partitioned ``main``) is an NPU region's
    result and that region takes exactly the layer's parameters: the region computes the whole layer; else
    None."""
    main = partitioned["main"]
    value_of = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    inputs = {p.name: p for p in main.params}
    found = []
    for output, layer_params in zip(outputs, params):
        call = value_of.get(output)
        region = partitioned[call.op] if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar) \
            else None
        whole = (region is not None and region.attrs is not None and region.attrs.get("Codegen") == "npu"
                 and list(call.args) == [inputs.get(p.name) for p in layer_params])
        found.append((str(region.attrs["global_symbol"]), region) if whole else None)
    return found


class NpuLayer:
    """One quantized layer as the NPU runs it: its own QDQ module, partitioned; lowered and simulated when first
    run (a MAC layer whose outputs calibration reads from its integer sums never is)."""

    def __init__(self, spec: LayerSpec, source: str, config: NpuConfig):
        from ..codegen.lower import mac_layer
        from ..partition import partition_for_npu
        from ..report import partition_report

        mod, (params,) = layer_module([spec], source)
        partitioned = partition_for_npu(mod, config)
        self.config = config
        self.weights = spec.weights
        self.on_npu = all(o.op in ("relax.quantize", "relax.dequantize")
                          for o in partition_report(partitioned).host_ops)
        self.partitioned = partitioned
        self.stream = self.prepared = self.vm = self.mac = None
        (region,) = _whole_regions(partitioned, [partitioned["main"].body.body], [params])
        self.whole = region is not None
        """The layer is one NPU region taking the layer's inputs: its stream computes the layer."""
        if self.whole:
            symbol, region = region
            self.mac = mac_layer(region, symbol)
            """The region as one MAC-array layer, when it is one: calibration then turns the layer's exact sums
            into its outputs (:meth:`.integer_sums.IntegerSums.npu_outputs`) and lowers no stream."""
            self.names = [p.name for p in region.params]

    def _build(self) -> None:
        """The region's stream, or the module TVM builds: on first run (a MAC layer whose sums calibration
        forms needs neither)."""
        from ..codegen import build_partitioned, lower_module

        if self.whole:
            # Calibration needs the stream's values, not its cycles: one schedule variant, serial (no dependencies
            # to derive: the values do not depend on them), validated once.
            (self.stream,) = lower_module(self.partitioned, serial=True).values()
            self.prepared = PreparedBatch(self.stream, self.config)
        else:
            self.vm = relax.VirtualMachine(build_partitioned(self.partitioned), tvm.cpu())

    def run_batch(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The int8 outputs for a batch of samples (each input ``[N, *shape]``), and how many accumulators
        overflowed computing them: the stream runs on :data:`NPU_BATCH` samples at a time
        (:class:`simulator.batch.PreparedBatch`, equal to one run per sample), a large batch split between the
        worker threads; a layer TVM builds runs per sample."""
        count = len(inputs[0])
        if self.prepared is None and self.vm is None:
            with parallel.TVM_LOCK:
                self._build()
        if self.stream is None:
            results = [self.run([x[n] for x in inputs]) for n in range(count)]
            return np.stack([r[0] for r in results]), sum(r[1] for r in results)
        parts = parallel.WORKERS if count * sum(x[0].size for x in inputs) >= NPU_SPLIT_ELEMENTS else 1
        step = min(NPU_BATCH, -(-count // parts))

        def run(part: slice):
            feeds = {name: np.ascontiguousarray(x[part]) for name, x in zip(self.names, inputs)}
            out, overflows = self.prepared.run(feeds, empty=buffers.empty)
            return out["output0"], sum(overflows)

        parts = [slice(start, start + step) for start in range(0, count, step)]
        results = run_all(run, parts)
        out = buffers.empty((count, *results[0][0].shape[1:]), results[0][0].dtype)
        for part, (values, _) in zip(parts, results):
            out[part] = values
        return out, sum(r[1] for r in results)

    def run(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The int8 output for one sample of a layer TVM builds (no NPU stream), and its overflows (none)."""
        result = self.vm["main"](*[tvm.runtime.tensor(np.asarray(x, order="C")) for x in inputs])
        return result.numpy(), 0

