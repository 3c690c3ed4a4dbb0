"""Convolution and matmul layers in float32 over a whole batch of calibration samples, with numpy's BLAS.

Calibration runs every weighted layer in float twice or more per sample (on the float model's activations, and
on its quantized inputs with dequantized weights). TVM's untuned CPU kernels take about 20 times longer than a
BLAS matrix multiply for the same convolution, so these layers are computed here, all samples at once: the
Relax operator's definition (``conv2d`` with its layouts, padding, strides, dilation and groups, or ``matmul``),
then the bias add and the clamp the layer fuses, each in float32 as TVM computes it; only the order of the
float32 additions inside a sum differs. The sums are the simulator's own (:mod:`simulator.macs`), applied to
float32 data. A layer outside what :func:`plan_weighted` recognises (other groupings, layouts or operators)
stays with TVM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from simulator.isa import Convolution, FeatureMap, Opcode
from simulator.macs import SUMS, centred_input

from ..relax_exprs import is_call
from .layers import Layer


@dataclass(frozen=True)
class WeightedPlan:
    """How to compute one weighted layer's sums with :mod:`simulator.macs`."""

    opcode: Opcode
    conv: Convolution | None
    channels_first: bool
    """Data layout NCHW: samples are transposed to NHWC and back."""
    weight_order: tuple[int, ...]
    """Transpose of the layer's weight to the opcode's ``[OC, KH, KW, IC]`` (depthwise: then ``[..., 0]``)."""

    def sums(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """The layer's anchor (conv2d or matmul, before its bias) on ``x`` = ``[N, *input shape]``, float32.

        Computed a few samples at a time into the one result array, so that no temporary is batch-sized."""
        x = np.asarray(x, np.float32)
        w = np.transpose(weight, self.weight_order) if self.conv is not None else np.asarray(weight, np.float32)
        out = None
        step = max(1, CHUNK_ELEMENTS // max(1, x[0].size))
        for start in range(0, x.shape[0], step):
            part = self._sums(x[start:start + step], w)
            if out is None:
                out = np.empty((x.shape[0], *part.shape[1:]), np.float32)
            out[start:start + step] = part
        return out

    def _sums(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if self.opcode == Opcode.FULLY_CONNECTED:
            return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], -1)
        conv = self.conv
        if (self.channels_first and self.opcode == Opcode.CONV2D and conv.kernel == (1, 1)
                and conv.stride == (1, 1) and conv.padding == (0, 0, 0, 0)):
            # Pointwise in NCHW: W [OC, IC] @ x [IC, H*W] per sample, no transposes.
            n = x.shape[0]
            planes = x.reshape(n, conv.ifm.channels, -1)
            out = np.matmul(w.reshape(conv.ofm.channels, conv.ifm.channels), planes)
            return out.reshape(n, 1, conv.ofm.channels, conv.ofm.height, conv.ofm.width)
        if self.opcode == Opcode.DEPTHWISE_CONV2D:
            w = w[..., 0]
        nhwc = np.transpose(x, (0, 1, 3, 4, 2)) if self.channels_first else x
        padded = centred_input(nhwc, 0, self.conv.padding, np.float32)
        out = SUMS[self.opcode](padded, w, self.conv)
        return np.ascontiguousarray(np.transpose(out, (0, 1, 4, 2, 3))) if self.channels_first else out


def plan_weighted(layer: Layer) -> WeightedPlan | None:
    """The numpy plan of a conv2d (groups 1 or depthwise) or 2-D-weight matmul layer; None otherwise."""
    if layer.weight is None or len(layer.bindings) > (2 if layer.bias is not None else 1):
        return None
    call = layer.bindings[0].value
    if is_call(call, "relax.matmul"):
        if layer.weight.ndim != 2 or str(call.attrs.out_dtype or "float32") not in ("float32", "void", ""):
            return None
        return WeightedPlan(Opcode.FULLY_CONNECTED, None, False, (0, 1))
    if not is_call(call, "relax.nn.conv2d"):
        return None
    attrs = call.attrs
    data, kernel = str(attrs.data_layout), str(attrs.kernel_layout)
    if data not in ("NCHW", "NHWC") or str(attrs.out_layout or data) != data or sorted(kernel) != sorted("OIHW"):
        return None
    if str(attrs.out_dtype or "float32") not in ("float32", "void", ""):
        return None
    in_shape = [int(d) for d in call.args[0].ty.shape.values]
    out_shape = [int(d) for d in call.ty.shape.values]
    if in_shape[0] != 1:
        return None
    c_axis, h_axis, w_axis = data.index("C"), data.index("H"), data.index("W")
    channels, out_channels = in_shape[c_axis], out_shape[c_axis]
    groups = int(attrs.groups)
    order = tuple(kernel.index(a) for a in "OHWI")
    kh, kw = layer.weight.shape[kernel.index("H")], layer.weight.shape[kernel.index("W")]
    if groups == 1:
        opcode = Opcode.CONV2D
    elif groups == channels and layer.weight.shape[kernel.index("I")] == 1 and out_channels % channels == 0:
        opcode = Opcode.DEPTHWISE_CONV2D
    else:
        return None
    top, left, bottom, right = (int(p) for p in attrs.padding)
    conv = Convolution(ifm=FeatureMap(0, in_shape[h_axis], in_shape[w_axis], channels),
                       ofm=FeatureMap(0, out_shape[h_axis], out_shape[w_axis], out_channels),
                       weights_address=0, scale_bias_address=0, kernel=(kh, kw),
                       stride=tuple(int(s) for s in attrs.strides), dilation=tuple(int(d) for d in attrs.dilation),
                       padding=(top, left, bottom, right))
    return WeightedPlan(opcode, conv, data == "NCHW", order)


def finish(layer: Layer, sums: np.ndarray, bias: np.ndarray | None, reuse: bool = False):
    """(accumulator, output) of a weighted layer from its sums: plus the bias in its own shape, then the clamp.
    ``reuse``: the sums are not needed afterwards and become the accumulator."""
    if bias is None:
        acc = sums
    elif reuse:
        acc = sums
        acc += np.asarray(bias, np.float32).reshape(layer.bias_shape)
    else:
        acc = sums + np.asarray(bias, np.float32).reshape(layer.bias_shape)
    if layer.clamp is None:
        return acc, acc
    lo, hi = layer.clamp
    if hi == float("inf"):
        return acc, np.maximum(acc, np.float32(lo))
    return acc, np.clip(acc, np.float32(lo), np.float32(hi))


def one_blas_thread():
    """A context in which numpy's BLAS uses one thread.

    Calibration makes thousands of mid-sized matrix multiplies; OpenBLAS hands each to its worker threads and
    waits for them, which costs more than it gains at these sizes and, when the cores are shared, stalls each
    call for a scheduler time slice (the pointwise convolutions of a MobileNetV2 took 25 times longer with two
    threads than with one on a loaded two-core machine).
    """
    return threadpool_limits(limits=1, user_api="blas")


CHUNK_ELEMENTS = 1 << 20
"""Values per chunk when a batch is streamed through a consumer: buffers this small are reused by the allocator,
where whole-batch temporaries (hundreds of MB) would be fresh pages, faulted in on every pass."""


def finished_chunks(layer: Layer, sums: np.ndarray, bias: np.ndarray | None):
    """:func:`finish` of ``sums`` a few samples at a time: yields (accumulator, output) chunks ``[k, *shape]``,
    valid until the next one is produced."""
    count = sums.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, sums[0].size))
    acc = np.empty((min(step, count), *sums.shape[1:]), np.float32)
    out = np.empty_like(acc) if layer.clamp is not None else acc
    bias = None if bias is None else np.asarray(bias, np.float32).reshape(layer.bias_shape)
    lo, hi = layer.clamp or (None, None)
    for start in range(0, count, step):
        part = sums[start:start + step]
        a, o = acc[:len(part)], out[:len(part)]
        if bias is None:
            a[...] = part
        else:
            np.add(part, bias, out=a)
        if hi == float("inf"):
            np.maximum(a, np.float32(lo), out=o)
        elif lo is not None:
            np.clip(a, np.float32(lo), np.float32(hi), out=o)
        yield a, o
