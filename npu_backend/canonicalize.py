"""Canonicalization: every quantized idiom becomes the one form the pattern table matches.

The canonical form of a MAC-array operator is the float-emulated QDQ form with
every qparam a constant on the graph:
``quantize(add(op(dequantize(x, s_in, z_in), dequantize(w, s_w, 0)), dequantize(b, s_in*s_w, 0)), s_out, z_out)``.
TFLite's importer already emits it; other idioms are rewritten into it here,
so there is one pattern per operator, whatever produced the graph.

Rewritten idioms:

* integer-domain convolution (the old ``qnn.conv2d -> bias_add -> requantize``):
  ``conv2d(astype(x, "int32") [- z_in], astype(w, "int32"), out_dtype="int32") [+ bias]``
  requantized as ``quantize(dequantize(acc, s_acc, 0), s_out, z_out)``. The input
  scale ``s_in`` comes from :func:`npu_backend.qparams.infer_qparams`; the weight
  scale is recovered as ``s_acc / s_in`` (seed 003: the composite must carry both,
  not only their product). When ``s_in`` cannot be inferred the idiom is left
  alone and stays on the host.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl.pattern import is_const, is_op, wildcard
from tvm.relax.dpl.rewrite import rewrite_call
from tvm.relax.expr_functor import PyExprMutator, mutator

from .qparams import TensorQParams, infer_qparams


def _const_array(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, Constant) else None


def _integer_conv_pattern():
    x = wildcard()
    widened = is_op("relax.astype")(x)
    input_zp = is_const()
    centred = is_op("relax.subtract")(widened, input_zp)
    weight = is_const()
    conv = is_op("relax.nn.conv2d")(centred | widened, is_op("relax.astype")(weight) | weight)
    bias = is_const()
    biased = is_op("relax.add")(conv, bias)
    acc_scale, acc_zp = is_const(), is_const()
    dequantized = is_op("relax.dequantize")(biased | conv, acc_scale, acc_zp)
    root = is_op("relax.quantize")(dequantized, is_const(), is_const())
    names = dict(x=x, input_zp=input_zp, centred=centred, weight=weight, conv=conv, bias=bias, biased=biased,
                 acc_scale=acc_scale, acc_zp=acc_zp)
    return root, names


def _f32(values) -> relax.Expr:
    return relax.const(np.asarray(values, dtype=np.float32))


def _i32(values) -> relax.Expr:
    return relax.const(np.asarray(values, dtype=np.int32))


def _rewrite_integer_conv(known: dict, var_of_value: dict, names: dict):
    def rewriter(orig, matched):
        get = lambda name: matched.get(names[name])  # noqa: E731
        # The matcher sees through bindings: x may be the producer's value; refer to its variable.
        x, conv = get("x"), get("conv")
        x = var_of_value.get(x, x)
        qp: TensorQParams | None = known.get(x)
        weights = _const_array(get("weight"))
        acc_scale, acc_zp = _const_array(get("acc_scale")), _const_array(get("acc_zp"))
        input_zp = _const_array(get("input_zp")) if get("centred") is not None else np.zeros(1)
        if (qp is None or weights is None or str(conv.attrs.out_dtype) != "int32"
                or input_zp.size != 1 or int(input_zp.reshape(-1)[0]) != qp.zero_point
                or np.any(acc_zp != 0) or weights.min() < -128 or weights.max() > 127):
            return orig
        attrs = conv.attrs
        oc_axis = str(attrs.kernel_layout).index("O")
        weight_scales = (acc_scale.astype(np.float64) / qp.scale).astype(np.float32)
        per_channel = weight_scales.size > 1
        dq_x = relax.op.dequantize(x, _f32(qp.scale), _i32(qp.zero_point), axis=0)
        dq_w = relax.op.dequantize(relax.const(weights.astype(np.int8)), _f32(weight_scales if per_channel else
                                   weight_scales.reshape(-1)[0]), _i32(np.zeros(weight_scales.shape, np.int32)
                                   if per_channel else 0), axis=oc_axis if per_channel else 0)
        out = relax.op.nn.conv2d(dq_x, dq_w, strides=attrs.strides, padding=attrs.padding,
                                 dilation=attrs.dilation, groups=attrs.groups, data_layout=attrs.data_layout,
                                 kernel_layout=attrs.kernel_layout, out_layout=attrs.out_layout)
        if get("biased") is not None:
            bias = _const_array(get("bias")).reshape(-1)
            bias_scale = np.float32(qp.scale) * weight_scales
            out = relax.op.add(out, relax.op.dequantize(_i32(bias), _f32(bias_scale), _i32(0), axis=0))
        return relax.op.quantize(out, orig.args[1], orig.args[2], axis=int(orig.attrs.axis),
                                 out_dtype=str(orig.attrs.out_dtype))

    return rewriter


@mutator
class _UniqueNames(PyExprMutator):
    """Rename variables whose name is already taken in the function.

    Rewrites name their new bindings after the ones they replace; the partition
    report identifies operators by binding name, so names must stay unique.
    """

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def _fresh(self, var, cls):
        if var.name not in self.seen:
            self.seen.add(var.name)
            return var
        k = 1
        while f"{var.name}_{k}" in self.seen:
            k += 1
        self.seen.add(f"{var.name}_{k}")
        return cls(f"{var.name}_{k}", var.ty)

    def visit_var_def_(self, var):
        return self._fresh(var, relax.Var)

    def visit_dataflow_var_def_(self, var):
        return self._fresh(var, relax.DataflowVar)


def canonicalize(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite the quantized idioms of every Relax function into the canonical QDQ form."""
    out = mod.clone()
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs is not None and "Codegen" in func.attrs):
            continue
        known = infer_qparams(func)
        var_of_value = {value: var for var, value in relax.analysis.get_var2val(func).items()}
        root, names = _integer_conv_pattern()
        rewritten = rewrite_call(root, _rewrite_integer_conv(known, var_of_value, names), func)
        out[gvar] = rewritten if rewritten.same_as(func) else _UniqueNames().visit_expr(rewritten)
    return out
