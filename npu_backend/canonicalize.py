"""Canonicalization: every quantized idiom becomes the one form the pattern table matches.

The canonical form of a MAC-array operator is the float-emulated QDQ form with
every qparam a constant on the graph:
``quantize(add(op(dequantize(x, s_in, z_in), dequantize(w, s_w, 0)), dequantize(b, s_in*s_w, 0)), s_out, z_out)``.
TFLite's importer already emits it; other idioms are rewritten into it here,
so there is one pattern per operator, whatever produced the graph.

Rewritten idioms:

* integer-domain convolution or matmul (the old ``qnn.conv2d`` / ``qnn.dense -> bias_add -> requantize``):
  ``conv2d|matmul(astype(x, "int32") [- z_in], astype(w, "int32"), out_dtype="int32") [+ bias]``
  requantized as ``quantize(dequantize(acc, s_acc, 0), s_out, z_out)``. The input
  scale ``s_in`` comes from :func:`npu_backend.qparams.infer_qparams`; the weight
  scale is recovered as ``s_acc / s_in`` (seed 003: the composite must carry both,
  not only their product). When ``s_in`` cannot be inferred the idiom is left
  alone and stays on the host.
* (not rewritten here) the same convolution requantized by an explicit
  fixed-point multiply / rounding shift / clip chain: its integer multipliers
  decide its results and no float scale can carry them, so the pattern table
  matches it as it stands (:mod:`npu_backend.patterns.fixed_point`).
* concatenation of inputs whose qparams differ from the output's:
  ``quantize(concat(dequantize(x_i, s_i, z_i)...), s, z)``. Each such input gets
  its own requantize, ``dequantize(quantize(dequantize(x_i, s_i, z_i), s, z), s, z)``,
  which is exactly what the float graph computes per element; the concat then
  only moves bytes (TFLite's int8 rule) and each requantize is a table look-up.
* the integer mean ``astype(x, "int32") -> mean -> dequantize(s_in, z_in) -> quantize``
  (the old ``cast -> mean -> qnn.requantize``) becomes
  ``quantize(mean(dequantize(x, s_in, z_in)))``: the real-valued mean TFLite's MEAN
  computes, instead of an int32 mean that truncates before requantizing.
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl.pattern import is_const, is_op, wildcard
from tvm.relax.dpl.rewrite import rewrite_call
from tvm.relax.expr_functor import PyExprMutator, mutator

from .layout import convert_to_nhwc
from .patterns.builders import integer_accumulator
from .relax_exprs import constant_value, is_call, operators, required_ops
from .qparams import TensorQParams, infer_qparams, per_tensor_qparams


def _const_array(expr) -> np.ndarray | None:
    return constant_value(expr) if isinstance(expr, Constant) else None


def _integer_conv_pattern():
    acc, names = integer_accumulator(("relax.nn.conv2d", "relax.matmul"))
    acc_scale, acc_zp = is_const(), is_const()
    dequantized = is_op("relax.dequantize")(acc, acc_scale, acc_zp)
    root = is_op("relax.quantize")(dequantized, is_const(), is_const())
    return root, dict(names, acc_scale=acc_scale, acc_zp=acc_zp)


def _f32(values) -> relax.Expr:
    return relax.const(np.asarray(values, dtype=np.float32))


def _i32(values) -> relax.Expr:
    return relax.const(np.asarray(values, dtype=np.int32))


def _rewrite_integer_conv(graph: "_GraphFacts"):
    """The integer-domain convolution or matmul (see the module docstring)."""
    root, names = _integer_conv_pattern()

    def rewriter(orig, matched):
        get = lambda name: matched.get(names[name])  # noqa: E731
        # The matcher sees through bindings: x may be the producer's value; refer to its variable.
        x, conv = graph.var(get("input")), get("anchor")
        qp: TensorQParams | None = graph.known.get(x)
        weights = _const_array(get("weight"))
        acc_scale, acc_zp = _const_array(get("acc_scale")), _const_array(get("acc_zp"))
        input_zp = _const_array(get("input_zp")) if get("centred") is not None else np.zeros(1)
        if (qp is None or weights is None or str(conv.ty.dtype) != "int32"
                or input_zp.size != 1 or int(input_zp.reshape(-1)[0]) != qp.zero_point
                or np.any(acc_zp != 0) or weights.min() < -128 or weights.max() > 127):
            return orig
        attrs = conv.attrs
        is_matmul = is_call(conv, "relax.matmul")
        oc_axis = weights.ndim - 1 if is_matmul else str(attrs.kernel_layout).index("O")  # matmul: [IC, OC]
        weight_scales = (acc_scale.astype(np.float64) / qp.scale).astype(np.float32)
        per_channel = weight_scales.size > 1
        dq_x = relax.op.dequantize(x, _f32(qp.scale), _i32(qp.zero_point), axis=0)
        dq_w = relax.op.dequantize(relax.const(weights.astype(np.int8)), _f32(weight_scales if per_channel else
                                   weight_scales.reshape(-1)[0]), _i32(np.zeros(weight_scales.shape, np.int32)
                                   if per_channel else 0), axis=oc_axis if per_channel else 0)
        if is_matmul:
            out = relax.op.matmul(dq_x, dq_w)
        else:
            out = relax.op.nn.conv2d(dq_x, dq_w, strides=attrs.strides, padding=attrs.padding,
                                     dilation=attrs.dilation, groups=attrs.groups, data_layout=attrs.data_layout,
                                     kernel_layout=attrs.kernel_layout, out_layout=attrs.out_layout)
        if get("biased") is not None:
            bias = _const_array(get("bias")).reshape(-1)
            bias_scale = np.float32(qp.scale) * weight_scales
            out = relax.op.add(out, relax.op.dequantize(_i32(bias), _f32(bias_scale), _i32(0), axis=0))
        return _requantized_like(orig, out)

    return root, rewriter


def _requantized_like(orig: relax.Call, value: relax.Expr) -> relax.Expr:
    """``value`` quantized with the qparams and dtype of the ``quantize`` call ``orig``."""
    return relax.op.quantize(value, orig.args[1], orig.args[2], axis=int(orig.attrs.axis),
                             out_dtype=str(orig.attrs.out_dtype))


def _rewrite_unequal_concat(graph: "_GraphFacts"):
    """Concatenation whose inputs have other qparams than its output (see the module docstring)."""
    concat = is_op("relax.concat")(wildcard())
    root = is_op("relax.quantize")(concat, is_const(), is_const())

    def rewriter(orig, matched):
        call = matched[concat]
        fields = graph.value(call.args[0])
        out_qp = per_tensor_qparams(orig)
        if out_qp is None or str(orig.attrs.out_dtype) != "int8" or not isinstance(fields, relax.Tuple):
            return orig
        requantized = []
        for field in fields.fields:
            value = graph.value(field)
            if is_call(value, "relax.dequantize") and per_tensor_qparams(value) not in (None, out_qp):
                field = relax.op.dequantize(_requantized_like(orig, field), orig.args[1], orig.args[2], axis=0)
            requantized.append(field)
        if all(new.same_as(old) for new, old in zip(requantized, fields.fields)):
            return orig
        return _requantized_like(orig, relax.op.concat(relax.Tuple(requantized), axis=call.attrs.axis))

    return root, rewriter


def _rewrite_integer_mean(graph: "_GraphFacts"):
    """``astype(int32) -> mean -> requantize`` (see the module docstring)."""
    x = wildcard()
    widened = is_op("relax.astype")(x)
    mean = is_op("relax.mean")(widened)
    dequantized = is_op("relax.dequantize")(mean, is_const(), is_const())
    root = is_op("relax.quantize")(dequantized, is_const(), is_const())

    def rewriter(orig, matched):
        source, acc = graph.var(matched[x]), matched[dequantized]
        if (str(source.ty.dtype) != "int8" or str(matched[widened].ty.dtype) != "int32"
                or per_tensor_qparams(acc) is None):
            return orig
        attrs = matched[mean].attrs
        real = relax.op.dequantize(source, acc.args[1], acc.args[2], axis=0)
        return _requantized_like(orig, relax.op.mean(real, axis=attrs.axis, keepdims=bool(attrs.keepdims)))

    return root, rewriter


def _rewrite_constant_layout(graph: "_GraphFacts"):
    """``permute_dims`` / ``reshape`` of a dequantized constant, done at compile time.

    ONNX Gemm transposes its dequantized weights, biases are reshaped to
    [1, C, 1, 1], TFLite's depthwise weights are reshaped to HWOI: folded, each
    is one dequantized constant whose per-channel axis follows its dimension.
    """
    raw = is_const()
    dequantized = is_op("relax.dequantize")(raw, is_const(), is_const())
    root = is_op("relax.permute_dims")(dequantized) | is_op("relax.reshape")(dequantized, wildcard())

    def rewriter(orig, matched):
        dq, values = matched[dequantized], _const_array(matched[raw])
        per_channel = _const_array(dq.args[1]).size > 1
        axis = int(dq.attrs.axis) % max(values.ndim, 1)
        if is_call(orig, "relax.permute_dims"):
            axes = ([int(a) % values.ndim for a in orig.attrs.axes] if orig.attrs.axes is not None
                    else list(reversed(range(values.ndim))))
            folded, new_axis = np.transpose(values, axes), axes.index(axis) if per_channel else 0
        else:
            target = tuple(int(d) for d in orig.ty.shape.values)
            folded, new_axis = values.reshape(target), 0
            if per_channel:  # only unit dimensions may come or go, or the channel axis has no meaning left
                kept, placed = ([i for i, d in enumerate(shape) if d != 1] for shape in (values.shape, target))
                if [values.shape[i] for i in kept] != [target[i] for i in placed] or axis not in kept:
                    return orig
                new_axis = placed[kept.index(axis)]
        return relax.op.dequantize(relax.const(np.ascontiguousarray(folded)), dq.args[1], dq.args[2], axis=new_axis,
                                   out_dtype=str(dq.attrs.out_dtype))

    return root, rewriter


def _rewrite_float_activation(graph: "_GraphFacts"):
    """``quantize(relu(y))`` / ``quantize(clip(y, 0, hi))``: a fused activation applied in float.

    TVM's TFLite importer writes ADD's fused RELU this way, ONNX graphs every
    Relu/Clip. Quantization is monotonic, so ``quantize(max(y, 0)) ==
    max(quantize(y), quantize(0))`` exactly: the activation becomes the int8
    clamp ``[z, q(hi)]`` the pattern table already knows. A bound whose scaled
    value is a rounding tie (which rounding convention decides) is left alone.
    """
    y = wildcard()
    relu = is_op("relax.nn.relu")(y)
    clip = is_op("relax.clip")(y, wildcard(), wildcard())
    root = is_op("relax.quantize")(relu | clip, is_const(), is_const())

    def rewriter(orig, matched):
        qp = per_tensor_qparams(orig)
        if qp is None or str(orig.attrs.out_dtype) != "int8":
            return orig
        activation = matched[relu] if relu in matched else matched[clip]
        low, top = 0.0, float("inf")
        if is_call(activation, "relax.clip"):
            low, top = (float(getattr(a.value, "value", a.value)) for a in activation.args[1:3])
        bounds = quantized_activation(low, top, qp.scale, qp.zero_point)
        if bounds is None:
            return orig
        return relax.op.clip(_requantized_like(orig, matched[y]), float(bounds[0]), float(bounds[1]))

    return root, rewriter


def quantized_activation(low: float, top: float, scale: float, zero_point: int) -> tuple[int, int] | None:
    """The int8 clamp ``[z, q(top)]`` that a float activation ``clip(y, low, top)`` (ReLU: ``top`` infinite)
    becomes in front of ``quantize(., scale, zero_point)``, or None where it stays a float op: a lower bound other
    than 0, or an upper one whose scaled value is a rounding tie. The rewrite above applies it; calibration
    predicts a layer's record with it (:mod:`npu_backend.quantization.predicted`)."""
    if low != 0.0:
        return None
    high = 127
    if top != float("inf"):
        scaled = float(np.float32(top) / np.float32(scale))
        if scaled - np.floor(scaled) == 0.5:
            return None
        high = int(min(127, max(-128, np.rint(scaled) + zero_point)))
    return max(-128, min(127, zero_point)), high


def _rewrite_identity_requantize(graph: "_GraphFacts"):
    """``quantize(dequantize(x, s, z), s, z)`` of int8 ``x`` is ``x``.

    ``f32(f32(x - z) * s) / s`` lies within a few ulps of the integer ``x - z``, so
    any rounding returns it: the pair is an exact identity. ONNX graphs with
    symmetric activations put one around every Relu, which the float-activation
    rewrite turns into ``clip(quantize(dequantize(x)))``; without the pair the
    clamp fuses into the operator that produced ``x``.
    """
    x = wildcard()
    dequantized = is_op("relax.dequantize")(x, is_const(), is_const())
    root = is_op("relax.quantize")(dequantized, is_const(), is_const())

    def rewriter(orig, matched):
        source = graph.var(matched[x])
        qp = per_tensor_qparams(orig)
        if (str(orig.attrs.out_dtype) != "int8" or str(source.ty.dtype) != "int8" or qp is None
                or per_tensor_qparams(matched[dequantized]) != qp or not 0 < qp.scale < float("inf")):
            return orig  # a zero or non-finite scale makes the pair no identity: leave it to the extraction's checks
        return source

    return root, rewriter


class _GraphFacts:
    """What rewriters may ask of the function being canonicalized, worked out when first asked: a function no
    rewrite matches (an already canonical one, as calibration builds a layer at a time) needs no analysis."""

    def __init__(self, func: relax.Function):
        self.func = func

    @functools.cached_property
    def var2val(self) -> dict:
        return relax.analysis.get_var2val(self.func)

    @functools.cached_property
    def var_of_value(self) -> dict:
        return {v: k for k, v in self.var2val.items()}

    @functools.cached_property
    def known(self) -> dict:
        """int8 variable -> :class:`TensorQParams` from the dataflow analysis."""
        return infer_qparams(self.func)

    def var(self, expr):
        """The matcher sees through bindings; refer to a producer by its variable, not its value."""
        return self.var_of_value.get(expr, expr)

    def value(self, expr):
        return self.var2val.get(expr, expr)


REWRITES = (_rewrite_constant_layout, _rewrite_float_activation,
            _rewrite_identity_requantize, _rewrite_integer_conv, _rewrite_unequal_concat, _rewrite_integer_mean)
"""Each builds (pattern, rewriter) for one idiom; applied in order (``rewrite_call`` reaches nested
matches, e.g. a bias reshaped, then transposed by the layout conversion)."""



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


@mutator
class _DequantizePerUse(PyExprMutator):
    """Give every consumer of a shared ``dequantize`` its own copy.

    TFLite's importer writes one dequantize per consumer, but rebuilding a
    function merges identical bindings, and ONNX graphs share them natively
    (a residual block's input feeds a convolution and the skip addition). A
    fused composite absorbs its input dequantize, which it cannot do if that
    float tensor is also used outside it; a dequantize costs nothing to repeat.
    """

    def __init__(self, shared: dict, returned: set):
        super().__init__()
        self.shared = shared  # var -> dequantize call
        self.returned = returned  # shared vars the function also returns: their binding stays

    def _own_copies(self, expr):
        if isinstance(expr, relax.Var) and expr in self.shared:
            call = self.shared[expr]
            copy = relax.Call(call.op, [self.visit_expr(a) for a in call.args], call.attrs, call.ty_args)
            return self.builder_.emit(copy, name_hint=expr.name)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._own_copies(f) for f in expr.fields])
        return self.visit_expr(expr)

    def visit_var_binding_(self, binding):
        if binding.var in self.shared and binding.var not in self.returned:
            return  # emitted at each use instead
        value = binding.value
        if isinstance(value, relax.Call):
            value = relax.Call(value.op, [self._own_copies(a) for a in value.args], value.attrs, value.ty_args)
        elif isinstance(value, relax.Tuple):
            value = self._own_copies(value)
        else:
            value = self.visit_expr(value)
        if isinstance(binding.var, relax.DataflowVar) or not self.builder_.current_block_is_dataflow():
            new_var = self.builder_.emit(value, name_hint=binding.var.name)
        else:  # a dataflow block's output
            new_var = self.builder_.emit_output(value, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new_var)


def _shared_dequantizes(func: relax.Function) -> tuple[dict, set]:
    uses: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1
        elif isinstance(expr, (relax.Call, relax.Tuple)):
            for a in (expr.args if isinstance(expr, relax.Call) else expr.fields):
                count(a)

    bindings = [b for block in func.body.blocks for b in block.bindings]
    for b in bindings:
        count(b.value)
    before = dict(uses)
    count(func.body.body)
    returned = {var for var, n in uses.items() if n > before.get(var, 0)}
    shared = {b.var: b.value for b in bindings if is_call(b.value, "relax.dequantize") and uses.get(b.var, 0) > 1}
    return shared, returned & set(shared)


def one_dequantize_per_use(func: relax.Function) -> relax.Function:
    shared, returned = _shared_dequantizes(func)
    return func if not shared else _DequantizePerUse(shared, returned).visit_expr(func)


_REWRITE_OPS: dict = {}


def _rewrite_ops(make_rewrite, pattern) -> frozenset[str]:
    """The operators a rewrite's pattern requires: its shape does not depend on the graph, so once per rewrite."""
    if make_rewrite not in _REWRITE_OPS:
        _REWRITE_OPS[make_rewrite] = required_ops(pattern)
    return _REWRITE_OPS[make_rewrite]


def canonicalize(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite the quantized idioms of every Relax function into the canonical QDQ form.

    NCHW graphs are first converted to NHWC (:mod:`npu_backend.layout`); bindings
    a rewrite made dead are removed, so the partition report lists only operators
    that run.
    """
    out = mod.clone()
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs is not None and "Codegen" in func.attrs):
            continue
        rewritten = convert_to_nhwc(func)
        present = operators(rewritten)
        graph = _GraphFacts(rewritten)
        for make_rewrite in REWRITES:
            pattern, rewriter = make_rewrite(graph)
            if not _rewrite_ops(make_rewrite, pattern) <= present:
                continue  # it cannot match: no call of one of its operators
            changed = []

            def tracked(expr, matches, rewriter=rewriter, changed=changed):
                if isinstance(expr, relax.Var):
                    # ``y = x`` (the layout conversion writes such aliases): the matcher follows ``x`` to the call it
                    # is bound to and hands the rewrite the var; that call's own binding is rewritten, the alias kept
                    return expr
                result = rewriter(expr, matches)
                if not result.same_as(expr):
                    changed.append(expr)
                return result

            result = rewrite_call(pattern, tracked, rewritten)
            if changed:  # else the function and its facts stay: the next rewrite needs no new analysis
                rewritten, graph, present = result, _GraphFacts(result), operators(result)
        rewritten = one_dequantize_per_use(rewritten)
        rewritten = relax.analysis.remove_all_unused(_UniqueNames().visit_expr(rewritten))
        out[gvar] = rewritten
    return out
