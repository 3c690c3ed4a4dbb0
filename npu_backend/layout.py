"""NCHW graphs (ONNX) in the NPU's NHWC layout, with transposes only where NCHW is really needed.

TVM's own ``ConvertLayout`` moves a convolution to NHWC but stops at
``quantize`` / ``dequantize``, which have no layout rule, so a QDQ graph would
get a float transpose around every operator. Here every 4-D tensor produced by
a layout-sensitive operator (conv2d, pooling, spatial mean, channel concat) gets
an NHWC *twin*; layout-agnostic operators (quantize, dequantize, activations,
same-shape elementwise arithmetic) of twins produce twins, so NHWC flows
through the whole quantized graph. An operator that needs the NCHW tensor
(a reshape, the graph output) gets it back with one transpose, placed on the
int8 side of a dequantize whenever there is one, so that transposes move int8
data, never floats.

Constant weights are transposed at compile time: OIHW becomes HWIO, or HWOI for
a depthwise convolution (the TFLite importer's layouts), and a per-channel
axis follows its dimension.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from .qparams import per_tensor_qparams
from .relax_ops import ELEMENTWISE_OPS
from .relax_exprs import is_call, static_shape

TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)
CONVERTED_CONV_LAYOUTS = ("NCHW", "OIHW", "NCHW")
"""The (data, kernel, out) layouts of a convolution the conversion rewrites to NHWC (groups 1 or depthwise)."""


class _NhwcRewriter:
    """One pass over a function's bindings, emitting the NHWC graph with a BlockBuilder."""

    def __init__(self, func: relax.Function):
        self.func = func
        self.bb = relax.BlockBuilder()
        self.values: dict = {}    # original var -> original value
        self.mapped: dict = {}    # original var -> emitted expr in the original layout
        self.twins: dict = {}     # original var -> emitted expr in NHWC
        self.rules = {"relax.nn.conv2d": self._conv2d, "relax.nn.avg_pool2d": self._pool,
                      "relax.nn.max_pool2d": self._pool, "relax.mean": self._mean, "relax.concat": self._concat}

    # -- the two views of a tensor ---------------------------------------------------------------
    def nhwc(self, expr):
        """The NHWC version of a 4-D tensor, transposing on the int8 side of a dequantize if needed."""
        if isinstance(expr, Constant):
            return relax.const(np.ascontiguousarray(np.transpose(expr.value.numpy(), TO_NHWC)))
        if expr in self.twins:
            return self.twins[expr]
        value = self.values.get(expr)
        if (is_call(value, "relax.dequantize") and _nhwc_axis(value) is not None
                and static_shape(value.args[0]) == static_shape(expr)):
            twin = self.bb.emit(relax.op.dequantize(self.nhwc(value.args[0]), value.args[1], value.args[2],
                                                    axis=_nhwc_axis(value), out_dtype=str(value.attrs.out_dtype)))
        else:
            twin = self.bb.emit(relax.op.permute_dims(self.nchw(expr), TO_NHWC))
        self.twins[expr] = twin
        return twin

    def nchw(self, expr):
        """The tensor in its original layout (transposed back from its twin only when asked for)."""
        if not isinstance(expr, relax.Var):
            return expr
        if expr in self.mapped:
            return self.mapped[expr]
        value = self.values.get(expr)
        if is_call(value, "relax.dequantize") and value.args[0] in self.twins:
            back = self.bb.emit(relax.op.dequantize(self.nchw(value.args[0]), value.args[1], value.args[2],
                                                    axis=int(value.attrs.axis), out_dtype=str(value.attrs.out_dtype)))
        else:
            back = self.bb.emit(relax.op.permute_dims(self.twins[expr], TO_NCHW))
        self.mapped[expr] = back
        return back

    # -- layout-sensitive operators ----------------------------------------------------------------
    def _conv2d(self, call):
        a = call.attrs
        if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != CONVERTED_CONV_LAYOUTS:
            return None
        channels = static_shape(call.args[0])[1]
        depthwise = int(a.groups) == channels and int(a.groups) > 1
        if int(a.groups) != 1 and not depthwise:
            return None
        # OIHW -> HWIO; depthwise [C, 1, KH, KW] -> HWOI [KH, KW, C, 1]
        kernel_axes, layout = ((2, 3, 0, 1), "HWOI") if depthwise else ((2, 3, 1, 0), "HWIO")
        weight = self._transposed_weight(call.args[1], kernel_axes)
        if weight is None:
            return None
        return relax.op.nn.conv2d(self.nhwc(call.args[0]), weight, strides=a.strides, padding=a.padding,
                                  dilation=a.dilation, groups=a.groups, data_layout="NHWC", kernel_layout=layout,
                                  out_layout="NHWC", out_dtype=str(a.out_dtype) if a.out_dtype else None)

    def _transposed_weight(self, weight, axes):
        """A constant (or dequantized constant) weight, transposed at compile time."""
        value = self.values.get(weight, weight)
        if isinstance(value, Constant):
            return relax.const(np.ascontiguousarray(np.transpose(value.value.numpy(), axes)))
        if is_call(value, "relax.dequantize") and isinstance(value.args[0], Constant):
            raw = np.ascontiguousarray(np.transpose(value.args[0].value.numpy(), axes))
            axis = axes.index(int(value.attrs.axis) % 4) if per_tensor_qparams(value) is None else 0
            return self.bb.emit(relax.op.dequantize(relax.const(raw), value.args[1], value.args[2], axis=axis,
                                                    out_dtype=str(value.attrs.out_dtype)))
        return None

    def _pool(self, call):
        a = call.attrs
        if str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW":
            return None
        options = dict(pool_size=a.pool_size, strides=a.strides, dilation=a.dilation, padding=a.padding,
                       ceil_mode=bool(a.ceil_mode), layout="NHWC", out_layout="NHWC")
        if is_call(call, "relax.nn.avg_pool2d"):
            return relax.op.nn.avg_pool2d(self.nhwc(call.args[0]), count_include_pad=bool(a.count_include_pad),
                                          **options)
        return relax.op.nn.max_pool2d(self.nhwc(call.args[0]), **options)

    def _mean(self, call):
        axes = sorted(int(x) % 4 for x in call.attrs.axis) if call.attrs.axis is not None else None
        if axes != [2, 3] or not call.attrs.keepdims:
            return None
        return relax.op.mean(self.nhwc(call.args[0]), axis=[1, 2], keepdims=True)

    def _concat(self, call):
        fields = self.values.get(call.args[0], call.args[0])
        if not isinstance(fields, relax.Tuple) or int(call.attrs.axis) % 4 != 1:
            return None
        if not any(self._has_twin(f) for f in fields.fields):
            return None  # no operand is NHWC yet: converting would only add transposes
        return relax.op.concat(relax.Tuple([self.nhwc(f) for f in fields.fields]), axis=3)

    def _has_twin(self, expr) -> bool:
        """Whether the NHWC view of ``expr`` exists or costs no float transpose (a dequantized twin)."""
        value = self.values.get(expr)
        return expr in self.twins or (is_call(value, "relax.dequantize") and value.args[0] in self.twins)

    # -- layout-agnostic operators ----------------------------------------------------------------
    def _agnostic(self, var, call):
        """NHWC version of an elementwise operator, if an operand already has a twin and all operands fit."""
        out_shape = static_shape(var)
        tensors = [arg for arg in call.args if static_shape(arg) is not None and len(static_shape(arg)) == 4]
        if out_shape is None or len(out_shape) != 4:
            return None
        if not any(self._has_twin(t) for t in tensors) and not _channel_broadcast(call, self.values):
            return None
        args = []
        for arg in call.args:
            shape = static_shape(arg)
            if shape is not None and len(shape) == 4:
                args.append(self.nhwc(arg))
            elif shape is None or int(np.prod(shape)) == 1:
                args.append(arg)
            else:
                return None  # a lower-rank operand broadcasts against the last axis, which the layout changes
        attrs = call.attrs
        if is_call(call, "relax.quantize") or is_call(call, "relax.dequantize"):
            axis = _nhwc_axis(call)
            if axis is None:
                return None
            make = relax.op.quantize if is_call(call, "relax.quantize") else relax.op.dequantize
            return make(args[0], args[1], args[2], axis=axis, out_dtype=str(attrs.out_dtype))
        return relax.Call(call.op, args, attrs, call.ty_args)

    # -- driver -------------------------------------------------------------------------------------
    def run(self) -> relax.Function:
        func = self.func
        params = list(func.params)
        for p in params:
            self.mapped[p] = p
        attrs = {str(k): v for k, v in func.attrs.items()} if func.attrs is not None else {}
        with self.bb.function("f", params, attrs=attrs, private=True):
            with self.bb.dataflow():
                for block in func.body.blocks:
                    for binding in block.bindings:
                        self._visit(binding.var, binding.value)
                outputs = self._in_original_layout(func.body.body)
                gv = self.bb.emit_output(outputs)
            self.bb.emit_func_output(gv)
        return self.bb.get()["f"]

    def _visit(self, var, value):
        self.values[var] = value
        twin = None
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            rule = self.rules.get(value.op.name)
            if rule is not None and len(static_shape(var) or ()) == 4:
                twin = rule(value)
            elif value.op.name in ELEMENTWISE_OPS:
                twin = self._agnostic(var, value)
        if twin is not None:
            self.twins[var] = self.bb.emit(twin, name_hint=var.name)
            return
        self.mapped[var] = self.bb.emit(self._in_original_layout(value), name_hint=var.name)

    def _in_original_layout(self, value):
        if isinstance(value, relax.Call):
            return relax.Call(value.op, [self._in_original_layout(a) for a in value.args], value.attrs,
                              value.ty_args)
        if isinstance(value, relax.Tuple):
            return relax.Tuple([self._in_original_layout(f) for f in value.fields])
        if isinstance(value, relax.TupleGetItem):
            return relax.TupleGetItem(self._in_original_layout(value.tuple_value), value.index)
        return self.nchw(value) if isinstance(value, relax.Var) else value


def _nhwc_axis(call) -> int | None:
    """The quantization axis of a (de)quantize of NCHW data once the data is NHWC: -1 for per-tensor
    qparams, the channel axis's new place for per-axis ones, None if the qparams are not constants."""
    if per_tensor_qparams(call) is not None:
        return -1
    if not all(isinstance(a, Constant) for a in call.args[1:3]):
        return None
    return TO_NHWC.index(int(call.attrs.axis) % 4)


def _channel_broadcast(call, values: dict) -> bool:
    """An elementwise operator of NCHW data and a per-channel ``[1, C, 1, 1]`` operand (a squeeze-excite gate, a
    per-channel scale): in NCHW it broadcasts over the spatial axes, which the NPU does not, in NHWC along the
    last axis, which it does. Converted whether or not an operand is NHWC already, so that the operator is placed
    alike in a whole model (where a convolution before it made its data NHWC) and alone (calibration builds each
    layer as a module of its own). Only of dequantized or constant operands (``values``: each var's bound value),
    whose NHWC views are int8 transposes or compile-time ones: never a float transpose."""
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) and call.op.name in ELEMENTWISE_OPS
            and not is_call(call, "relax.quantize") and not is_call(call, "relax.dequantize")):
        return False
    shapes = [static_shape(a) for a in call.args]
    if len(shapes) != 2 or any(s is None or len(s) != 4 for s in shapes):
        return False
    if not all(isinstance(a, Constant) or is_call(values.get(a), "relax.dequantize") for a in call.args):
        return False
    for data, gate in (shapes, shapes[::-1]):
        if gate[0] == 1 and gate[2:] == (1, 1) and gate[1] == data[1] > 1 and data[2] * data[3] > 1:
            return True
    return False


def _is_nchw_operator(value, values: dict) -> bool:
    """An operator written for NCHW data: a convolution, a pooling, a spatial mean over axes 2 and 3, or a
    per-channel broadcast (:func:`_channel_broadcast`; ``values``: each var's bound value)."""
    if _channel_broadcast(value, values):
        return True
    if is_call(value, "relax.nn.conv2d"):
        return str(value.attrs.data_layout) == "NCHW"
    if is_call(value, "relax.nn.avg_pool2d") or is_call(value, "relax.nn.max_pool2d"):
        return str(value.attrs.layout) == "NCHW"
    if (is_call(value, "relax.mean") and value.attrs.axis is not None
            and len(static_shape(value.args[0]) or ()) == 4):
        return sorted(int(a) % 4 for a in value.attrs.axis) == [2, 3] and bool(value.attrs.keepdims)
    return False


def _needs_conversion(func: relax.Function) -> bool:
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    return any(_is_nchw_operator(value, values) for value in values.values())


def convert_to_nhwc(func: relax.Function) -> relax.Function:
    """The function with its NCHW operators in NHWC (unchanged if it has none: TFLite graphs have no NCHW
    convolution or pooling, though a mean over axes 2 and 3 alone would also be converted, correctly)."""
    if not _needs_conversion(func) or len(func.body.blocks) != 1 or not isinstance(
            func.body.blocks[0], relax.DataflowBlock):
        return func
    return _NhwcRewriter(func).run()
