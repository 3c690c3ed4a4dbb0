"""Hand-built Relax modules in the exact shapes TVM 0.27's TFLite importer emits.

Building them here (instead of importing .tflite files) lets a pattern test
vary one thing at a time: a kernel one past the limit, a bias scale that is off,
weights that are not constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax


def f32(v):
    return relax.const(np.asarray(v, dtype=np.float32))


def i32(v):
    return relax.const(np.asarray(v, dtype=np.int32))


@dataclass
class ConvIdiom:
    """Parameters of one quantized conv/depthwise/FC as the importer writes it."""

    op: str = "conv2d"                   # conv2d | depthwise | fc
    x_shape: tuple = (1, 8, 8, 4)
    out_channels: int = 6
    kernel: tuple = (3, 3)
    strides: tuple = (1, 1)
    dilation: tuple = (1, 1)
    padding: tuple = (1, 1, 1, 1)
    per_channel: bool = True
    clip: tuple | None = (-128, 127)
    bias: bool = True
    input_scale: float = 0.0078125
    input_zero_point: int = -3
    output_scale: float = 0.05
    output_zero_point: int = 5
    weight_zero_point: int = 0
    bias_scale_factor: float = 1.0       # != 1: a bias not in the accumulator domain
    weight_is_param: bool = False        # weights arrive as a function argument
    float_graph: bool = False            # no quantization at all
    seed: int = 0
    weights: np.ndarray = field(init=False, default=None)
    weight_scales: np.ndarray = field(init=False, default=None)
    bias_values: np.ndarray = field(init=False, default=None)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        c = self.x_shape[-1]
        if self.op == "depthwise":
            self.out_channels = c
            shape = (1, *self.kernel, c)                 # TFLite [1, KH, KW, C]
        elif self.op == "fc":
            shape = (self.out_channels, c)               # TFLite [OC, IC]
        else:
            shape = (*self.kernel, c, self.out_channels)  # HWIO after the importer's transpose
        self.weights = rng.integers(-127, 128, shape, dtype=np.int8)
        count = self.out_channels if self.per_channel else 1
        self.weight_scales = rng.uniform(0.001, 0.01, count).astype(np.float32)
        self.bias_values = rng.integers(-500, 500, self.out_channels).astype(np.int32)

    def module(self) -> tvm.IRModule:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(self.x_shape, "float32" if self.float_graph else "int8"))
        params = [x]
        w_dtype = "float32" if self.float_graph else "int8"
        if self.weight_is_param:
            w_expr = relax.Var("w", relax.TensorType(self.weights.shape, w_dtype))
            params.append(w_expr)
        else:
            w_expr = relax.const(self.weights.astype(w_dtype))
        with bb.function("main", params):
            with bb.dataflow():
                out = bb.emit_output(self._body(bb, x, w_expr))
            bb.emit_func_output(out)
        return bb.get()

    def _scale_axis(self):
        scales = self.weight_scales if self.per_channel else self.weight_scales[0]
        return f32(scales), i32(np.full(np.shape(scales), self.weight_zero_point))

    def _body(self, bb, x, w):
        if self.float_graph:
            conv = bb.emit(relax.op.nn.conv2d(x, w, strides=self.strides, padding=self.padding,
                                              dilation=self.dilation, data_layout="NHWC", kernel_layout="HWIO"))
            return relax.op.nn.relu(conv)
        dq_x = bb.emit(relax.op.dequantize(x, f32(self.input_scale), i32(self.input_zero_point), axis=0))
        scale, zp = self._scale_axis()
        if self.op == "depthwise":
            c = self.x_shape[-1]
            dq_w = bb.emit(relax.op.dequantize(w, scale, zp, axis=3 if self.per_channel else 0))
            dq_w = bb.emit(relax.op.reshape(dq_w, (*self.kernel, c, 1)))
            acc = bb.emit(relax.op.nn.conv2d(dq_x, dq_w, strides=self.strides, padding=self.padding,
                                             dilation=self.dilation, groups=c, data_layout="NHWC",
                                             kernel_layout="HWOI"))
        elif self.op == "fc":
            wt = bb.emit(relax.op.permute_dims(w, [1, 0]))
            dq_w = bb.emit(relax.op.dequantize(wt, scale, zp, axis=1))
            acc = bb.emit(relax.op.matmul(dq_x, dq_w))
        else:
            dq_w = bb.emit(relax.op.dequantize(w, scale, zp, axis=3 if self.per_channel else 0))
            acc = bb.emit(relax.op.nn.conv2d(dq_x, dq_w, strides=self.strides, padding=self.padding,
                                             dilation=self.dilation, data_layout="NHWC", kernel_layout="HWIO"))
        if self.bias:
            bias_scale = np.float32(self.input_scale) * self.weight_scales * np.float32(self.bias_scale_factor)
            dq_b = bb.emit(relax.op.dequantize(i32(self.bias_values), f32(bias_scale), i32(0), axis=0))
            acc = bb.emit(relax.op.add(acc, dq_b))
        q = relax.op.quantize(acc, f32(self.output_scale), i32(self.output_zero_point), axis=0, out_dtype="int8")
        if self.clip is None:
            return q
        return relax.op.clip(bb.emit(q), float(self.clip[0]), float(self.clip[1]))


def add_module(shape=(1, 6, 6, 8), shape2=None, q1=(0.03, -5), q2=(0.02, 7), q_out=(0.05, 1), clip=None,
               op=relax.op.add):
    """quantize(op(dequantize(a), dequantize(b))) [-> clip], the importer's int8 ADD (SUB, MUL with ``op``)."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(shape, "int8"))
    b = relax.Var("b", relax.TensorType(shape2 or shape, "int8"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            da = bb.emit(relax.op.dequantize(a, f32(q1[0]), i32(q1[1]), axis=0))
            db = bb.emit(relax.op.dequantize(b, f32(q2[0]), i32(q2[1]), axis=0))
            s = bb.emit(op(da, db))
            out = relax.op.quantize(s, f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8")
            if clip is not None:
                out = relax.op.clip(bb.emit(out), float(clip[0]), float(clip[1]))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def mean_module(shape=(1, 5, 5, 16), axis=(1, 2), keepdims=False, q_in=(0.02, -128), q_out=(0.01, -128)):
    """quantize(mean(dequantize(x))), the importer's int8 MEAN (global average pooling)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(q_in[0]), i32(q_in[1]), axis=0))
            m = bb.emit(relax.op.mean(dx, axis=list(axis), keepdims=keepdims))
            gv = bb.emit_output(relax.op.quantize(m, f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def pool_module(kind, shape=(1, 9, 9, 8), pool_size=(2, 2), strides=(2, 2), padding=(0, 0, 0, 0),
                dtype="int8", count_include_pad=False):
    """int8 max_pool2d as is, or the astype(int32) -> avg_pool2d -> astype(int8) idiom."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    options = dict(pool_size=pool_size, strides=strides, padding=padding, layout="NHWC")
    with bb.function("main", [x]):
        with bb.dataflow():
            if kind == "max":
                out = relax.op.nn.max_pool2d(x, **options)
            else:
                wide = bb.emit(relax.op.astype(x, "int32"))
                pooled = bb.emit(relax.op.nn.avg_pool2d(wide, count_include_pad=count_include_pad, **options))
                out = relax.op.astype(pooled, dtype)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def _integer_accumulator(bb, idiom: ConvIdiom, real, centred: bool = True):
    """Quantize the float model input, then ``idiom``'s int32 accumulator on it: a conv2d (HWIO) or, for
    op="fc", a matmul with [IC, OC] weights, the input zero point subtracted if ``centred``, bias added."""
    x = bb.emit(relax.op.quantize(real, f32(idiom.input_scale), i32(idiom.input_zero_point), axis=0,
                                  out_dtype="int8"))
    wide = bb.emit(relax.op.astype(x, "int32"))
    if centred:
        wide = bb.emit(relax.op.subtract(wide, i32(idiom.input_zero_point)))
    if idiom.op == "fc":
        w = bb.emit(relax.op.astype(relax.const(np.ascontiguousarray(idiom.weights.T)), "int32"))
        acc = bb.emit(relax.op.matmul(wide, w, out_dtype="int32"))
    else:
        w = bb.emit(relax.op.astype(relax.const(idiom.weights), "int32"))
        acc = bb.emit(relax.op.nn.conv2d(wide, w, strides=idiom.strides, padding=idiom.padding,
                                         dilation=idiom.dilation, data_layout="NHWC", kernel_layout="HWIO",
                                         out_dtype="int32"))
    return bb.emit(relax.op.add(acc, i32(idiom.bias_values))) if idiom.bias else acc


def integer_conv_module(idiom: ConvIdiom, centred: bool = True, requantize_with_clip: bool = False):
    """The same convolution as ``idiom`` in the integer domain (the old qnn.conv2d -> requantize).

    The input's scale appears only on the quantize that produces it, never on the
    convolution: recovering it takes the dataflow analysis.
    """
    bb = relax.BlockBuilder()
    real = relax.Var("real", relax.TensorType(idiom.x_shape, "float32"))
    with bb.function("main", [real]):
        with bb.dataflow():
            acc = _integer_accumulator(bb, idiom, real, centred)
            acc_scale = np.float32(idiom.input_scale) * idiom.weight_scales
            real_acc = bb.emit(relax.op.dequantize(acc, f32(acc_scale if idiom.per_channel else acc_scale[0]),
                                                   i32(0), axis=3))
            out = relax.op.quantize(real_acc, f32(idiom.output_scale), i32(idiom.output_zero_point), axis=0,
                                    out_dtype="int8")
            if idiom.clip is not None:
                out = relax.op.clip(bb.emit(out), float(idiom.clip[0]), float(idiom.clip[1]))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def activation_module(op=relax.op.sigmoid, shape=(1, 4, 4, 8), q_in=(0.05, 3), q_out=(1 / 256, -128)):
    """quantize(activation(dequantize(x))): TVM's importer form of int8 LOGISTIC / TANH."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(q_in[0]), i32(q_in[1]), axis=0))
            act = bb.emit(op(dx))
            gv = bb.emit_output(relax.op.quantize(act, f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def integer_mean_module(shape=(1, 5, 5, 16), q_in=(0.02, -7), q_out=(0.015, 3), keepdims=True):
    """The old ``cast -> mean -> qnn.requantize``: an int32 mean, requantized as dequantize -> quantize.

    Only the requantize states the input's qparams (scale ``q_in``, zero point ``q_in[1]``).
    """
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "int32"))
            m = bb.emit(relax.op.mean(wide, axis=[1, 2], keepdims=keepdims))
            real = bb.emit(relax.op.dequantize(m, f32(q_in[0]), i32(q_in[1]), axis=0))
            gv = bb.emit_output(relax.op.quantize(real, f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def integer_fc_module(idiom: ConvIdiom):
    """``idiom`` (op="fc") as the old ``qnn.dense -> bias_add -> requantize``: an int32 matmul of the centred
    input and the [IC, OC] weights, requantized by dequantize(acc, s_in * s_w) -> quantize."""
    bb = relax.BlockBuilder()
    real = relax.Var("real", relax.TensorType(idiom.x_shape, "float32"))
    with bb.function("main", [real]):
        with bb.dataflow():
            acc = _integer_accumulator(bb, idiom, real)
            acc_scale = np.float32(idiom.input_scale) * idiom.weight_scales
            real_acc = bb.emit(relax.op.dequantize(acc, f32(acc_scale if idiom.per_channel else acc_scale[0]),
                                                   i32(0), axis=1))
            gv = bb.emit_output(relax.op.quantize(real_acc, f32(idiom.output_scale), i32(idiom.output_zero_point),
                                                  axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def fixed_point_conv_module(idiom: ConvIdiom, multipliers=None, shifts=None):
    """``idiom``'s convolution in the integer domain with its requantization written in fixed point:
    ``(acc * M + 2**(S-1)) >> S + z_out``, clipped and narrowed; M, S from the float32 scales as TFLite's
    single-rounding build derives them, unless given. Only the input's quantize and the output's dequantize
    state qparams."""
    from simulator.numerics import Rounding, conv_multipliers

    if multipliers is None:
        multipliers, shifts = conv_multipliers(idiom.input_scale, idiom.weight_scales, idiom.output_scale,
                                               Rounding.TFLITE_SINGLE)
        multipliers = np.broadcast_to(multipliers, (idiom.out_channels,))
        shifts = np.broadcast_to(shifts, (idiom.out_channels,))
    right = 31 - np.asarray(shifts, np.int64)
    bb = relax.BlockBuilder()
    real = relax.Var("real", relax.TensorType(idiom.x_shape, "float32"))
    with bb.function("main", [real]):
        with bb.dataflow():
            acc = _integer_accumulator(bb, idiom, real)
            i64 = lambda v: relax.const(np.array(v, dtype=np.int64), "int64")  # noqa: E731
            product = bb.emit(relax.op.multiply(relax.op.astype(acc, "int64"), i64(multipliers)))
            shifted = bb.emit(relax.op.right_shift(relax.op.add(product, i64(np.int64(1) << (right - 1))),
                                                   i64(right)))
            out = bb.emit(relax.op.add(relax.op.astype(shifted, "int32"), i32(idiom.output_zero_point)))
            low, high = idiom.clip or (-128, 127)
            q = bb.emit(relax.op.astype(relax.op.clip(out, low, high), "int8"))
            gv = bb.emit_output(relax.op.dequantize(q, f32(idiom.output_scale), i32(idiom.output_zero_point),
                                                    axis=0))
        bb.emit_func_output(gv)
    return bb.get()
