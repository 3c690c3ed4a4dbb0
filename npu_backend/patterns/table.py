"""The pattern table: one ordered entry per (NPU operator, idiom variant).

Order is priority, highest first, the order ``FuseOpsByPattern`` consumes.
TVM's registry treats *later* registrations as higher priority, so
``register_table`` registers the table reversed; ``get_patterns_with_prefix``
then returns it in this order.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix, register_patterns
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl.pattern import DFPattern, is_const, is_op, is_tuple, wildcard

from simulator.config import NpuConfig, get_config
from simulator.numerics import Rounding

from ..errors import NpuError
from ..params import OPERAND_ROLES, NpuOp, NpuParams
from ..reference import Reference, follow_reference
from .fixed_point import QPARAM_ROLES, extract_fixed_point, fixed_point_pattern
from .checks import CONV_RULES, ELEMENTWISE_RULES, POOL_RULES, SOFTMAX_RULES, first_violation, tiles_fit_sram
from .extract import (extract_add, extract_avg_pool2d, extract_concat, extract_conv2d, extract_depthwise_conv2d,
                      extract_exp, extract_gelu, extract_gelu_tanh,
                      extract_fully_connected, extract_hard_swish, extract_leaky_relu, extract_max_pool2d,
                      extract_mean, extract_multiply, extract_pad, extract_qdq_avg_pool2d,
                      extract_qdq_max_pool2d, extract_requantize, extract_reshape,
                      extract_sigmoid, extract_softmax, extract_strided_slice, extract_subtract, extract_tanh,
                      extract_transpose)

PREFIX = "npu"


def _with_clip(root: DFPattern, annotations: dict, with_clip: bool):
    """Optionally follow a pattern with an int8 clip: the fused ReLU/ReLU6 of TFLite's importer."""
    if not with_clip:
        return root, annotations
    clip = is_op("relax.clip")(root, wildcard(), wildcard())
    annotations["clip"] = clip
    return clip, annotations


def _quantized(op_pattern: DFPattern, annotations: dict, with_clip: bool):
    """Wrap an operator pattern in [+ dequantized bias] -> quantize [-> int8 clip]."""
    bias = is_op("relax.dequantize")(is_const(), is_const(), is_const())
    quantize = is_op("relax.quantize")(is_op("relax.add")(op_pattern, bias) | op_pattern,
                                       is_const(), is_const())
    annotations.update(bias=bias, quantize=quantize)
    return _with_clip(quantize, annotations, with_clip)


def _dequantized_input():
    x = wildcard()
    return x, is_op("relax.dequantize")(x, is_const(), is_const())


def conv2d_pattern(with_clip: bool):
    """conv2d of dequantized int8 input and constant weights (a reshape of the weights, e.g. TFLite's
    depthwise [1, KH, KW, C] -> HWOI, is folded into the constant by canonicalization)."""
    x, input_dq = _dequantized_input()
    weight = is_const()
    weight_dq = is_op("relax.dequantize")(weight, is_const(), is_const())
    conv = is_op("relax.nn.conv2d")(input_dq, weight_dq)
    annotations = dict(input=x, input_dq=input_dq, weight=weight, weight_dq=weight_dq, anchor=conv)
    return _quantized(conv, annotations, with_clip)


def matmul_pattern(with_clip: bool):
    """matmul of dequantized int8 input and constant weights (optionally transposed)."""
    x, input_dq = _dequantized_input()
    weight = is_const()
    weight_permute = is_op("relax.permute_dims")(weight)
    weight_dq = is_op("relax.dequantize")(weight_permute | weight, is_const(), is_const())
    matmul = is_op("relax.matmul")(input_dq, weight_dq)
    annotations = dict(input=x, input_dq=input_dq, weight=weight, weight_permute=weight_permute,
                       weight_dq=weight_dq, anchor=matmul)
    return _quantized(matmul, annotations, with_clip)


def binary_pattern(op_name: str):
    """op of two dequantized int8 tensors, requantized (TFLite ADD, SUB, MUL)."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        x2, input2_dq = _dequantized_input()
        binary = is_op(op_name)(input_dq, input2_dq)
        quantize = is_op("relax.quantize")(binary, is_const(), is_const())
        annotations = dict(input=x, input_dq=input_dq, input2=x2, input2_dq=input2_dq, anchor=binary,
                           quantize=quantize)
        return _with_clip(quantize, annotations, with_clip)

    build.__doc__ = f"quantize({op_name}(dequantize(a), dequantize(b))) [-> int8 clip]."
    return build


def mean_pattern(with_clip: bool):
    """mean of a dequantized int8 tensor, requantized (global average pooling)."""
    x, input_dq = _dequantized_input()
    mean = is_op("relax.mean")(input_dq)
    quantize = is_op("relax.quantize")(mean, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, anchor=mean, quantize=quantize)


def max_pool_pattern(with_clip: bool):
    """max_pool2d straight on int8 data (qparam-transparent)."""
    x = wildcard()
    pool = is_op("relax.nn.max_pool2d")(x)
    return _with_clip(pool, dict(input=x, anchor=pool), with_clip)


def avg_pool_pattern(with_clip: bool):
    """The cast idiom astype(int32) -> avg_pool2d -> astype(int8)."""
    x = wildcard()
    widen = is_op("relax.astype")(x)
    pool = is_op("relax.nn.avg_pool2d")(widen)
    narrow = is_op("relax.astype")(pool)
    return _with_clip(narrow, dict(input=x, widen=widen, anchor=pool, narrow=narrow), with_clip)


def qdq_pool_pattern(op_name: str):
    """quantize(pool(dequantize(x))): pooling as ONNX QDQ graphs write it, qparams on both sides."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        pool = is_op(op_name)(input_dq)
        quantize = is_op("relax.quantize")(pool, is_const(), is_const())
        return _with_clip(quantize, dict(input=x, input_dq=input_dq, anchor=pool, quantize=quantize), with_clip)

    build.__doc__ = f"quantize({op_name}(dequantize(x))) [-> int8 clip]."
    return build


def reshape_pattern(with_clip: bool):
    """reshape or squeeze of int8 data (qparam-transparent, e.g. Flatten before a dense layer)."""
    x = wildcard()
    reshape = is_op("relax.reshape")(x, wildcard()) | is_op("relax.squeeze")(x)
    return reshape, dict(input=x, anchor=reshape)


def activation_pattern(op_name: str):
    """dequantize -> activation -> quantize: a fake-quantized elementwise activation."""

    def build(with_clip: bool):
        x, input_dq = _dequantized_input()
        act = is_op(op_name)(input_dq)
        quantize = is_op("relax.quantize")(act, is_const(), is_const())
        return quantize, dict(input=x, input_dq=input_dq, anchor=act, quantize=quantize)

    build.__doc__ = f"quantize({op_name}(dequantize(x))): an int8 table look-up on the NPU."
    return build


def hard_swish_pattern(with_clip: bool):
    """quantize(x * clip(x + 3, 0, 6) / 6) of x = dequantize(...): TVM's spelling of int8 HARD_SWISH.

    The canonical graph dequantizes once per use, so x is two dequantizes of the same int8 tensor.
    """
    x, input_dq = _dequantized_input()
    input_dq2 = is_op("relax.dequantize")(x, is_const(), is_const())
    plus = is_op("relax.add")(input_dq, is_const())
    relu6 = is_op("relax.clip")(plus, wildcard(), wildcard())
    scaled = is_op("relax.divide")(is_op("relax.multiply")(input_dq2, relu6), is_const())
    quantize = is_op("relax.quantize")(scaled, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, input_dq2=input_dq2, plus=plus, relu6=relu6, anchor=scaled,
                          quantize=quantize)


def requantize_pattern(with_clip: bool):
    """quantize(dequantize(x)) of int8 x: a standalone requantization (TFLite QUANTIZE int8 -> int8)."""
    x, input_dq = _dequantized_input()
    quantize = is_op("relax.quantize")(input_dq, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, anchor=quantize, quantize=quantize)


def transpose_pattern(with_clip: bool):
    """permute_dims of int8 data (the layout conversion's transposes at a graph's edges)."""
    x = wildcard()
    permute = is_op("relax.permute_dims")(x)
    return permute, dict(input=x, anchor=permute)


def strided_slice_pattern(with_clip: bool):
    """strided_slice of int8 data (qparam-transparent; TFLite STRIDED_SLICE)."""
    x = wildcard()
    sliced = is_op("relax.strided_slice")(x, wildcard(), wildcard(), wildcard(), wildcard())
    return sliced, dict(input=x, anchor=sliced)


def pad_pattern(with_clip: bool):
    """Constant padding of int8 data (TFLite PAD, the pad value being the zero point)."""
    x = wildcard()
    pad = is_op("relax.nn.pad")(x)
    return pad, dict(input=x, anchor=pad)


MAX_CONCAT_INPUTS = 6


def concat_pattern(arity: int):
    """quantize(concat(dequantize(x0), ..., dequantize(xn))) for one number of inputs."""

    def build(with_clip: bool):
        inputs = [_dequantized_input() for _ in range(arity)]
        concat = is_op("relax.concat")(is_tuple([dq for _, dq in inputs]))
        quantize = is_op("relax.quantize")(concat, is_const(), is_const())
        annotations = dict(anchor=concat, quantize=quantize)
        for i, (x, dq) in enumerate(inputs):
            annotations.update({f"input{i}": x, f"input_dq{i}": dq})
        return quantize, annotations

    build.__doc__ = f"int8 concatenation of {arity} tensors with equal qparams."
    return build


@dataclass(frozen=True)
class PatternEntry:
    """An NPU operator: its composite name, graph pattern, extraction and hardware rules."""

    name: str
    build: Callable[[bool], tuple[DFPattern, dict]]
    extract: Callable[[Mapping], NpuParams]
    rules: tuple = field(default=CONV_RULES)
    clip_variant: bool = True
    constant_operands: frozenset = frozenset()
    """Operand roles the extraction accepts as constants (it then carries their values)."""
    qparam_roles: tuple = ()
    """Annotated tensors whose qparams the extraction receives from the dataflow analysis (its second
    argument: role -> TensorQParams or None), for idioms that state no qparams of their own."""


OPERATORS = (
    PatternEntry(f"{PREFIX}.conv2d", fixed_point_pattern("relax.nn.conv2d"), extract_fixed_point(NpuOp.CONV2D),
                 clip_variant=False, qparam_roles=QPARAM_ROLES),
    PatternEntry(f"{PREFIX}.fully_connected", fixed_point_pattern("relax.matmul"),
                 extract_fixed_point(NpuOp.FULLY_CONNECTED), clip_variant=False, qparam_roles=QPARAM_ROLES),
    PatternEntry(f"{PREFIX}.conv2d", conv2d_pattern, extract_conv2d),
    PatternEntry(f"{PREFIX}.depthwise_conv2d", conv2d_pattern, extract_depthwise_conv2d),
    PatternEntry(f"{PREFIX}.fully_connected", matmul_pattern, extract_fully_connected),
    PatternEntry(f"{PREFIX}.add", binary_pattern("relax.add"), extract_add, rules=ELEMENTWISE_RULES,
                 constant_operands=frozenset({"input2"})),
    PatternEntry(f"{PREFIX}.subtract", binary_pattern("relax.subtract"), extract_subtract, rules=ELEMENTWISE_RULES,
                 constant_operands=frozenset({"input2"})),
    PatternEntry(f"{PREFIX}.multiply", binary_pattern("relax.multiply"), extract_multiply, rules=ELEMENTWISE_RULES,
                 constant_operands=frozenset({"input2"})),
    PatternEntry(f"{PREFIX}.mean", mean_pattern, extract_mean, rules=ELEMENTWISE_RULES, clip_variant=False),
    PatternEntry(f"{PREFIX}.max_pool2d", qdq_pool_pattern("relax.nn.max_pool2d"), extract_qdq_max_pool2d,
                 rules=POOL_RULES),
    PatternEntry(f"{PREFIX}.avg_pool2d", qdq_pool_pattern("relax.nn.avg_pool2d"), extract_qdq_avg_pool2d,
                 rules=POOL_RULES),
    PatternEntry(f"{PREFIX}.max_pool2d", max_pool_pattern, extract_max_pool2d, rules=POOL_RULES),
    PatternEntry(f"{PREFIX}.avg_pool2d", avg_pool_pattern, extract_avg_pool2d, rules=POOL_RULES),
    PatternEntry(f"{PREFIX}.reshape", reshape_pattern, extract_reshape, rules=(), clip_variant=False),
    PatternEntry(f"{PREFIX}.sigmoid", activation_pattern("relax.sigmoid"), extract_sigmoid, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.tanh", activation_pattern("relax.tanh"), extract_tanh, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.exp", activation_pattern("relax.exp"), extract_exp, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.gelu", activation_pattern("relax.nn.gelu"), extract_gelu, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.gelu_tanh", activation_pattern("relax.nn.gelu_tanh"), extract_gelu_tanh,
                 rules=ELEMENTWISE_RULES, clip_variant=False),
    PatternEntry(f"{PREFIX}.hard_swish", hard_swish_pattern, extract_hard_swish, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.leaky_relu", activation_pattern("relax.nn.leakyrelu"), extract_leaky_relu,
                 rules=ELEMENTWISE_RULES, clip_variant=False),
    PatternEntry(f"{PREFIX}.requantize", requantize_pattern, extract_requantize, rules=ELEMENTWISE_RULES,
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.softmax", activation_pattern("relax.nn.softmax"), extract_softmax,
                 rules=SOFTMAX_RULES, clip_variant=False),
    PatternEntry(f"{PREFIX}.transpose", transpose_pattern, extract_transpose, rules=(tiles_fit_sram,),
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.strided_slice", strided_slice_pattern, extract_strided_slice, rules=(tiles_fit_sram,),
                 clip_variant=False),
    PatternEntry(f"{PREFIX}.pad", pad_pattern, extract_pad, rules=(tiles_fit_sram,), clip_variant=False),
    *(PatternEntry(f"{PREFIX}.concat", concat_pattern(arity), extract_concat, rules=(tiles_fit_sram,),
                   clip_variant=False) for arity in range(2, MAX_CONCAT_INPUTS + 1)),
)
ENTRIES_BY_NAME: dict[str, tuple[PatternEntry, ...]] = {
    name: tuple(e for e in OPERATORS if e.name == name) for name in dict.fromkeys(e.name for e in OPERATORS)}
"""Composite name -> its entries (one per idiom variant, e.g. each concat arity)."""


@dataclass
class Rejection:
    """Why a pattern that matched the graph was refused (the op stays on the host)."""

    composite: str
    anchor: str
    reason: str


@dataclass
class PartitionContext:
    config: NpuConfig
    reference: Reference = Reference.TFLITE
    rejections: list[Rejection] = field(default_factory=list)
    tensor_qparams: dict = field(default_factory=dict)
    """Binding name -> TensorQParams of the graph being partitioned (the dataflow analysis)."""


def extract_params(entry: PatternEntry, annotations: Mapping, reference: Reference,
                   qparams: Mapping | None = None) -> NpuParams:
    """The one extraction the check and the composite annotation share, in the reference's rounding.

    An idiom that states its own arithmetic (its ``rounding`` is not TFLite's default) keeps it.
    """
    params = entry.extract(annotations, qparams or {}) if entry.qparam_roles else entry.extract(annotations)
    if getattr(params, "rounding", None) == Rounding.TFLITE_SINGLE:
        return params
    return follow_reference(params, reference)


ACTIVE_CONTEXT: contextvars.ContextVar[PartitionContext | None] = contextvars.ContextVar(
    "npu_partition_context", default=None)


def _bound_name(expr, context) -> str | None:
    """The binding name of a matched expression (the matcher hands over values, not their variables)."""
    if isinstance(expr, relax.Var):
        return expr.name
    var = context.value_to_bound_var.get(expr) if expr is not None else None
    return var.name if var is not None else None


def _make_check(entry: PatternEntry):
    def check(context) -> bool:
        active = ACTIVE_CONTEXT.get() or PartitionContext(get_config())
        annotations = {str(k): v for k, v in context.annotated_expr.items()}
        anchor_var = context.value_to_bound_var.get(annotations["anchor"])
        anchor = anchor_var.name if anchor_var is not None else "?"
        reason = None
        if has_leaking_intermediate_variables(context):
            reason = "an intermediate result is also used outside the fused operator"
        elif any(isinstance(annotations.get(role), Constant) for role in OPERAND_ROLES
                 if role not in entry.constant_operands):
            reason = "an operand is a constant; the NPU reads operands from tensors the graph computes"
        else:
            try:
                qparams = {role: active.tensor_qparams.get(_bound_name(annotations.get(role), context))
                           for role in entry.qparam_roles}
                reason = first_violation(extract_params(entry, annotations, active.reference, qparams),
                                         active.config, entry.rules)
            except NpuError as exc:
                reason = str(exc)
            except Exception as exc:  # an idiom variant the extraction did not foresee: host, not a crash
                reason = f"could not analyse this {entry.name} match ({type(exc).__name__}: {exc})"
        if reason is not None:
            active.rejections.append(Rejection(entry.name, anchor, reason))
        return reason is None

    return check


def table() -> list[tuple]:
    """The ordered (name, pattern, annotations, check) tuples, highest priority first."""
    rows = []
    for with_clip in (True, False):  # a fused activation must be claimed before the bare op
        for entry in OPERATORS:
            if with_clip and not entry.clip_variant:
                continue
            pattern, annotations = entry.build(with_clip)
            rows.append((entry.name, pattern, annotations, _make_check(entry)))
    return rows


def register_table() -> None:
    register_patterns(list(reversed(table())))


def registered_patterns():
    return get_patterns_with_prefix(PREFIX)
