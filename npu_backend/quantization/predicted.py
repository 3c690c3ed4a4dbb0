"""A MAC or elementwise layer's NPU record, predicted from calibration's own decisions and checked against the
layer's build.

Of a convolution or matmul layer's NPU module, calibration reads only its
:class:`npu_backend.codegen.lower.MacLayer` (the record, its scale/bias table and its whole-layer command): the
next layers' int8 inputs come from the layer's exact sums through it (:mod:`.integer_sums`). Building that module
(the QDQ layer, ``partition_for_npu``, the record read back) is Python on the walk's main thread: the 65 builds of
a MobileNetV2-224 took 1.6-1.8 s of it, a quarter of the default calibration. Yet the record is a function of what
calibration has just decided (input and output qparams, int8 weights and bias, the clamp, the geometry), so the
walk computes it (:func:`predict`), with the rules the compiler itself applies (the float activation's int8 clamp,
:func:`npu_backend.canonicalize.quantized_activation`; the clip's integers and the rounding,
:mod:`npu_backend.patterns.extract`; the legality check and row program,
:func:`npu_backend.codegen.lower.mac_layer_of`), and goes on.

An add, subtract or multiply of two computed tensors of one shape is predicted the same way
(:func:`predict_elementwise`): its record is a function of its three qparams and its clamp, and its outputs are
its command's table of every input pair looked up element by element (:class:`PredictedElementwise`), as the
simulator's batched step computes them. The 10 adds of a MobileNetV2 had each been built on the walk (waiting
0.12-0.16 s in all for TVM, which the builder held), lowered and simulated: 0.39 s of the walk's 2.2 s.

The layers are still built, on a thread of its own (:class:`Builder`), several to a module
(:func:`.steps.built_records`: a MobileNetV2's 53 MAC layers in batches of 16 took 0.9-1.0 s of CPU, against
1.6-1.7 s built one by one), and each record is compared with its prediction field by field, arrays by dtype, shape
and value. The walk waits for every comparison before it returns: a difference (a rule the prediction does not
know) makes calibration walk again with every layer built on the walk (``calibrate.walk``, with a warning naming
the layer and the field), so the module returned is the one the NPU computes, always. TVM's ``BlockBuilder``
keeps one stack for every thread, so every build in calibration holds :data:`.parallel.TVM_LOCK`.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from simulator.isa import Opcode
from simulator.prepared import lookup_pairs, pair_table

from ..canonicalize import quantized_activation
from ..codegen.lower import ElementwiseLayer, MacLayer, elementwise_layer_of, mac_layer_of
from ..layout import CONVERTED_CONV_LAYOUTS
from ..ops import OPS
from ..params import ConvParams, ElementwiseParams
from ..patterns.extract import CONV_LAYOUTS, integer_clamp, mac_rounding
from ..reference import REFERENCE_OF_SOURCE, follow_reference
from . import buffers
from .batched_float import chunks
from .parallel import TVM_LOCK, run_all

MAC_OPS = {d.opcodes[0]: d.op for d in OPS if d.record is ConvParams}
"""The NPU operator of each MAC opcode (a weighted plan's), from the operator table."""
ELEMENTWISE_OPS = {d.op.value: d.op for d in OPS if d.record is ElementwiseParams}
"""The NPU's binary elementwise operators by name, which is the name of the layer kind each computes ("add")."""


def predict(layer, plan, input_q, output_q, weights, source: str, config) -> MacLayer | None:
    """The :class:`MacLayer` the layer's NPU build would give, from calibration's decisions: ``plan`` its
    :class:`.batched_float.WeightedPlan`, ``input_q``/``output_q`` its :class:`.rewrite.TensorQ`, ``weights`` its
    :class:`.rewrite.WeightQ`, ``source`` the module's reference source. None where the prediction does not know
    the answer (a clamp the canonical form leaves in float, a layer the NPU does not take whole): the layer is then
    built on the walk, as before."""
    if plan is None or weights is None or plan.opcode not in MAC_OPS:
        return None
    op = MAC_OPS[plan.opcode]
    if plan.conv is not None:
        attrs = layer.bindings[0].value.attrs
        if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) not in (
                CONV_LAYOUTS[op], CONVERTED_CONV_LAYOUTS):
            return None  # a kernel layout the composite does not take: the layer stays on the host
    clamp = _int8_clamp(layer, output_q)
    if clamp is None:
        return None
    channels = weights.weight.shape[weights.axis]
    per_channel = int(np.size(weights.scales)) > 1
    bias = (np.zeros(channels, np.int32) if weights.bias is None
            else np.ascontiguousarray(np.broadcast_to(np.asarray(weights.bias).reshape(-1), (channels,)), np.int32))
    common = dict(op=op, input_scale=float(np.float32(input_q.scale)), input_zero_point=int(input_q.zero_point),
                  weight_scales=np.broadcast_to(np.asarray(weights.scales, np.float32), (channels,)).astype(np.float32),
                  weight_zero_points=np.zeros(channels, np.int32), per_channel=per_channel, bias=bias,
                  output_scale=float(np.float32(output_q.scale)), output_zero_point=int(output_q.zero_point),
                  clamp=clamp,
                  rounding=mac_rounding(op, per_channel))
    if plan.conv is None:
        shape = [int(d) for d in layer.inputs[0].ty.shape.values]
        if len(shape) != 2:
            return None  # the NPU's fully connected layer takes [rows, depth]: the layer's own build decides
        rows, depth = shape
        params = ConvParams(ifm_shape=(rows, depth), ofm_shape=(rows, channels),
                            weights=np.ascontiguousarray(np.asarray(weights.weight).T), **common)
    else:
        c = plan.conv
        w = np.transpose(weights.weight, plan.weight_order)  # [OC, KH, KW, IC]
        if plan.opcode == Opcode.DEPTHWISE_CONV2D:
            w = w[..., 0]  # [C, KH, KW]
        params = ConvParams(ifm_shape=(1, c.ifm.height, c.ifm.width, c.ifm.channels),
                            ofm_shape=(1, c.ofm.height, c.ofm.width, c.ofm.channels), weights=np.ascontiguousarray(w),
                            kernel=tuple(c.kernel), strides=tuple(c.stride), dilation=tuple(c.dilation),
                            padding=tuple(c.padding), **common)
    return mac_layer_of(follow_reference(params, REFERENCE_OF_SOURCE[source]), config)


def predict_elementwise(layer, inputs_q, output_q, source: str, config) -> ElementwiseLayer | None:
    """The :class:`ElementwiseLayer` the build of an add, subtract or multiply of two computed tensors of one
    shape would give, from calibration's qparams (``inputs_q`` and ``output_q``: :class:`.rewrite.TensorQ`), as
    :func:`predict` for a MAC layer; None where the prediction does not know the answer (a constant or broadcast
    operand, a clamp the canonical form leaves in float)."""
    op = ELEMENTWISE_OPS.get(layer.kind.name)
    if op is None or layer.constants or len(layer.inputs) != 2 or len(inputs_q) != 2:
        return None
    shapes = {tuple(int(d) for d in v.ty.shape.values) for v in (*layer.inputs, layer.output)}
    if len(shapes) != 1:
        return None
    clamp = _int8_clamp(layer, output_q)
    if clamp is None:
        return None
    (first, second) = inputs_q
    params = ElementwiseParams(op=op, shape=shapes.pop(), input_scale=float(np.float32(first.scale)),
                               input_zero_point=int(first.zero_point), input2_scale=float(np.float32(second.scale)),
                               input2_zero_point=int(second.zero_point), output_scale=float(np.float32(output_q.scale)),
                               output_zero_point=int(output_q.zero_point), clamp=clamp)
    return elementwise_layer_of(follow_reference(params, REFERENCE_OF_SOURCE[source]), config)


def _int8_clamp(layer, output_q) -> tuple[int, int] | None:
    """The int8 clamp the build gives the layer's float clamp (none: the whole int8 range) on its output's
    qparams, by the compiler's rules; None where the canonical form leaves the clamp in float."""
    if layer.clamp is None:
        return (-128, 127)
    bounds = quantized_activation(*layer.clamp, output_q.scale, output_q.zero_point)
    return None if bounds is None else integer_clamp(*bounds)


def difference(predicted: MacLayer | ElementwiseLayer, built) -> str | None:
    """The first field in which the build's record differs from the prediction (None: they are the same)."""
    if built is None:
        return f"the build is not one {'MAC' if isinstance(predicted, MacLayer) else 'elementwise'} layer"
    return _difference(predicted, built, "")


def _difference(a, b, where: str) -> str | None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        return None if same else f"{where}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)} built"
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            found = _difference(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}" if where else f.name)
            if found is not None:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return f"{where}: {a!r} predicted, {b!r} built"
    return None


class Mispredicted(Exception):
    """A layer's build differs from its prediction (calibration walks again with every layer built)."""


class PredictedLayer:
    """A predicted layer's stand-in for its :class:`.steps.NpuLayer`: its predicted :class:`MacLayer` (None for
    an elementwise layer, :class:`PredictedElementwise`) checked by the :class:`Builder`, and the layer itself
    built when anything else is asked of it (a sample the sums cannot take exactly runs through its stream)."""

    on_npu = True
    """A layer whose record checks and lowers to one NPU command (and whose build is compared): on the NPU."""

    def __init__(self, mac: MacLayer, weights, build, check: Future):
        self.mac, self.weights, self._build, self._check = mac, weights, build, check
        self._built = None

    @property
    def verified(self) -> bool:
        """Built, and equal to the prediction."""
        check = self._check
        return check.done() and not check.cancelled() and check.exception() is None and check.result() is None

    def built(self):
        """The real :class:`.steps.NpuLayer` (built on first use, holding :data:`.parallel.TVM_LOCK`)."""
        if self._built is None:
            with TVM_LOCK:
                self._built = self._build()
        return self._built

    def run_batch(self, inputs):
        return self.built().run_batch(inputs)


class PredictedElementwise(PredictedLayer):
    """An elementwise layer's stand-in: its outputs are its predicted command's table of every input pair looked
    up element by element (:func:`simulator.prepared.lookup_pairs`, what the simulator's batched step runs on
    the same bytes), the inputs in whatever layout they share; its build is checked as a MAC layer's is."""

    def __init__(self, record: ElementwiseLayer, build, check: Future):
        super().__init__(None, None, build, check)
        self.record = record
        self._table = None

    def run_batch(self, inputs):
        first, second = (np.ascontiguousarray(x) for x in inputs)
        if first.shape != second.shape or first.dtype != np.int8 or second.dtype != np.int8:
            return self.built().run_batch(inputs)
        if self._table is None:
            self._table = pair_table(self.record.opcode, self.record.payload)
        out = buffers.empty(first.shape, np.int8)
        table = self._table

        def part(samples: slice) -> None:
            a, b = (x[samples].reshape(-1).view(np.uint8) for x in (first, second))
            lookup_pairs(a, b, table, out[samples].reshape(-1).view(np.uint8), np.empty(a.size, np.uint16))

        run_all(part, chunks(len(first), first[0].size))
        return out, 0  # no accumulator


class Builder:
    """Builds the predicted layers on a thread of its own, beside the walk, and compares each with its prediction.

    The layers waiting are built together, as one module (:func:`.steps.built_records`): one
    ``partition_for_npu`` call for several layers costs about half as much as one per layer, and the thread shares
    the cores with calibration's own. A batch holds TVM (:data:`.parallel.TVM_LOCK`), which the walk needs to build
    a layer that is not predicted (a mean, a pool), and the GIL for much of its time, so batches start when the walk
    begins a MAC layer with half a :data:`BATCH` waiting (:meth:`flush`: its matrix products run without the GIL),
    or once :data:`BATCH` layers wait. On a MobileNetV2 the walk then waited 0.4 s in all for TVM, where batches of
    16 started whenever they filled had held it up 0.8 s; batches started right after the walk's own builds held it
    up 0-0.02 s, but slowed the adds' simulation (Python, beside the builds' Python) by more, and one batch after
    the walk left it a serial tail; on wall time the three were within the machine's noise (median 7.7 s each over
    5 alternating rounds), this one the least CPU (measured before the adds were predicted too, when each add was
    built on the walk). :meth:`finish` waits for every check and raises :class:`Mispredicted` on the first
    difference."""

    BATCH = 16
    """Layers built together."""

    def __init__(self, build_records):
        """``build_records(specs)``: the built record (:class:`MacLayer`, :class:`ElementwiseLayer` or None) of each
        :class:`.steps.LayerSpec`."""
        self._build_records = build_records
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-quantize-build")
        self._waiting: list = []  # (spec, prediction, its check's future), in the walk's order
        self._lock = threading.Lock()
        self._checks: list[tuple[str, Future]] = []

    def submit(self, name: str, record: MacLayer | ElementwiseLayer, weights, spec, build) -> PredictedLayer:
        """A :class:`PredictedLayer` (:class:`PredictedElementwise`) for the predicted ``record`` of the layer
        ``spec`` describes (``build()``: its :class:`.steps.NpuLayer`, should anything need it)."""
        check: Future = Future()
        with self._lock:
            self._waiting.append((spec, record, check))
            full = len(self._waiting) >= self.BATCH
        self._checks.append((name, check))
        if full:
            self.flush()
        if isinstance(record, ElementwiseLayer):
            return PredictedElementwise(record, build, check)
        return PredictedLayer(record, weights, build, check)

    def flush(self, least: int = 1) -> None:
        """Build the layers waiting now, if there are at least ``least``."""
        with self._lock:
            enough = len(self._waiting) >= least
        if enough:
            self._executor.submit(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._waiting = self._waiting, []
        if not batch:
            return  # taken by an earlier drain
        try:
            with TVM_LOCK:
                built = self._build_records([spec for spec, _, _ in batch])
        except Exception as error:  # noqa: BLE001 - the layers built one by one on the walk will say what it is
            for _, _, check in batch:
                check.set_result(f"their build together failed: {error}")
            return
        except BaseException as error:  # raised by finish()
            for _, _, check in batch:
                check.set_exception(error)
            raise
        for (_, mac, check), real in zip(batch, built):
            check.set_result(difference(mac, real))

    def finish(self) -> None:
        try:
            self.flush()  # the last layers
            self._executor.shutdown(wait=True)
            for name, check in self._checks:
                found = check.result()
                if found is not None:
                    raise Mispredicted(f"layer {name}'s NPU record differs from calibration's prediction ({found})")
        finally:
            self.close()

    def close(self) -> None:
        """Stop: builds not started are dropped (their checks cancelled), a running one is waited for."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for _, _, check in self._waiting:
                check.cancel()
            self._waiting = []
