"""The NPU operators: one definition record each, the only place that says what an operator is.

An :class:`OpDef` names everything about one canonical operator: its composite,
its parameter record, the idioms that spell it in a graph (pattern and
extraction each), its hardware rules, the output qparams TFLite fixes for it,
its planner, its constant preparation, the opcodes it emits and its tile
program. The pattern table (:mod:`npu_backend.patterns.table`), the composite
annotation (:mod:`npu_backend.partition`) and the lowering
(:mod:`npu_backend.codegen.lower`) all read this table; nothing else lists
operators.

Order is pattern priority: within the table, an operator's idioms are tried
before the next operator's (TFLite's fused activations are claimed first for
all operators, see :func:`npu_backend.patterns.table.table_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from simulator import mlas, softmax, tables
from simulator.isa import Opcode

from . import prepare, tiling
from .codegen import emit
from .codegen.batch_matmul import emit_batch_matmul
from .codegen.resize import emit_resize_bilinear, emit_resize_nearest
from .errors import UnsupportedOpError
from .legality import CONV_RULES, POOL_RULES, resize_keeps_qparams, tflite_integer_kernel, tflite_kernel_only
from .params import (BatchMatMulParams, ConcatParams, ConvParams, ElementwiseParams, LutParams, MeanParams, NpuOp,
                     NpuParams, PadParams, PoolParams, ReshapeParams, ResizeBilinearParams, ResizeNearestParams,
                     SliceParams, SoftmaxParams, TransposeParams, from_attrs)
from .patterns import batch_matmul as bmm
from .patterns import builders as b
from .patterns import resize as rs
from .patterns import extract as x
from .patterns.fixed_point import QPARAM_ROLES, extract_fixed_point, fixed_point_pattern
from .patterns.table import PREFIX, Idiom


@dataclass(frozen=True)
class OpDef:
    """Everything the compiler knows about one NPU operator."""

    op: NpuOp
    record: type
    """The frozen parameter record its extraction returns and its composite's attributes encode."""
    idioms: tuple[Idiom, ...]
    rules: tuple[Callable, ...]
    """Its own hardware rules, ``(params, config) -> reason | None`` (:mod:`npu_backend.legality`)."""
    plan: Callable
    """``(params, config) -> plan`` (:mod:`npu_backend.tiling`); raises when the layer cannot be tiled."""
    prepare: Callable
    """``params -> constants`` (:mod:`npu_backend.prepare`); raises when they cannot be represented."""
    lower: Callable
    """The tile program (:mod:`npu_backend.codegen.emit`)."""
    opcodes: tuple[Opcode, ...]
    """What its tile program emits besides DMA_COPY."""
    fixed_output: tuple[float, int] | None = None
    """(scale, zero point) TFLite's int8 kernel requires of the output, if it fixes them."""

    @property
    def composite(self) -> str:
        return f"{PREFIX}.{self.op.value}"


def _idiom(build, extract, fused_clip: bool, **kwargs) -> Idiom:
    return Idiom(build, extract, fused_clip, **kwargs)


def _mac(op: NpuOp, opcode: Opcode, *idioms: Idiom) -> OpDef:
    return OpDef(op, ConvParams, idioms, CONV_RULES, tiling.plan_layer, prepare.conv_multipliers,
                 emit.mac_program(opcode), (opcode,))


def _binary(op: NpuOp, opcode: Opcode, relax_op: str) -> OpDef:
    idiom = _idiom(b.binary_pattern(relax_op), x.extract_elementwise(op, relax_op.split(".")[-1]), True,
                   constant_operands=frozenset({"input2"}))
    return OpDef(op, ElementwiseParams, (idiom,), (), tiling.plan_elementwise, prepare.elementwise_prepare(opcode),
                 emit.elementwise_program(opcode), (opcode,))


def _pool(op: NpuOp, opcode: Opcode, relax_op: str, qdq_extract, int8_idiom: Idiom, *also: Opcode) -> OpDef:
    return OpDef(op, PoolParams, (_idiom(b.qdq_pool_pattern(relax_op), qdq_extract, True), int8_idiom), POOL_RULES,
                 tiling.plan_pool, prepare.pool_qparams, emit.pool_program(opcode), (opcode, *also))


def _table(op: NpuOp, build, tflite, onnxruntime=None, fixed_output=None, extract=None) -> OpDef:
    """A look-up-table operator: its idiom, TFLite's table and (if reproduced) onnxruntime's."""
    idiom = _idiom(build, extract or x.extract_activation(op), False)
    return OpDef(op, LutParams, (idiom,), (), tiling.plan_lut, prepare.lut_prepare(tflite, onnxruntime),
                 emit.emit_lut, (Opcode.LUT,), fixed_output)


def _mover(op: NpuOp, record: type, build, extract, plan, lower) -> OpDef:
    """Data movement by DMA only: qparams unchanged, nothing to prepare."""
    return OpDef(op, record, (_idiom(build, extract, False),), (), plan, prepare.nothing, lower, ())


MAX_CONCAT_INPUTS = 6
"""Concatenations of 2 to this many inputs are matched (one pattern per arity); more stay on the host."""


OPS: tuple[OpDef, ...] = (
    _mac(NpuOp.CONV2D, Opcode.CONV2D,
         _idiom(fixed_point_pattern("relax.nn.conv2d"), extract_fixed_point(NpuOp.CONV2D), False,
                qparam_roles=QPARAM_ROLES),
         _idiom(b.conv2d_pattern, x.extract_conv2d, True)),
    _mac(NpuOp.DEPTHWISE_CONV2D, Opcode.DEPTHWISE_CONV2D, _idiom(b.conv2d_pattern, x.extract_depthwise_conv2d, True)),
    _mac(NpuOp.FULLY_CONNECTED, Opcode.FULLY_CONNECTED,
         _idiom(fixed_point_pattern("relax.matmul"), extract_fixed_point(NpuOp.FULLY_CONNECTED), False,
                qparam_roles=QPARAM_ROLES),
         _idiom(b.matmul_pattern, x.extract_fully_connected, True)),
    OpDef(NpuOp.BATCH_MATMUL, BatchMatMulParams, (_idiom(bmm.batch_matmul_pattern, bmm.extract_batch_matmul, False),),
          (tflite_integer_kernel,), tiling.plan_batch_matmul, prepare.batch_matmul_multiplier, emit_batch_matmul,
          (Opcode.BATCH_MATMUL,)),
    _binary(NpuOp.ADD, Opcode.ADD, "relax.add"),
    _binary(NpuOp.SUBTRACT, Opcode.SUB, "relax.subtract"),
    _binary(NpuOp.MULTIPLY, Opcode.MUL, "relax.multiply"),
    OpDef(NpuOp.MEAN, MeanParams, (_idiom(b.mean_pattern, x.extract_mean, False),), (), tiling.plan_mean,
          prepare.mean_multiplier, emit.emit_mean, (Opcode.MEAN,)),
    _pool(NpuOp.MAX_POOL2D, Opcode.MAX_POOL2D, "relax.nn.max_pool2d", x.extract_qdq_max_pool2d,
          _idiom(b.max_pool_pattern, x.extract_max_pool2d, True)),
    _pool(NpuOp.AVG_POOL2D, Opcode.AVG_POOL2D, "relax.nn.avg_pool2d", x.extract_qdq_avg_pool2d,
          _idiom(b.avg_pool_pattern, x.extract_avg_pool2d, True), Opcode.MEAN),  # onnxruntime's global average
    _mover(NpuOp.RESHAPE, ReshapeParams, b.reshape_pattern, x.extract_reshape, tiling.plan_copy, emit.emit_reshape),
    _table(NpuOp.SIGMOID, b.activation_pattern("relax.sigmoid"), prepare.fixed_output(tables.logistic_table),
           prepare.onnxruntime_function(mlas.logistic), tables.LOGISTIC_OUTPUT),
    _table(NpuOp.TANH, b.activation_pattern("relax.tanh"), prepare.fixed_output(tables.tanh_table),
           prepare.onnxruntime_function(mlas.tanh), tables.TANH_OUTPUT),
    _table(NpuOp.EXP, b.activation_pattern("relax.exp"), prepare.populated(np.exp)),
    _table(NpuOp.GELU, b.activation_pattern("relax.nn.gelu"), prepare.populated(tables.tflite_gelu)),
    _table(NpuOp.GELU_TANH, b.activation_pattern("relax.nn.gelu_tanh"), prepare.populated(tables.tflite_gelu_tanh)),
    _table(NpuOp.HARD_SWISH, b.hard_swish_pattern, prepare.with_qparams(tables.hard_swish_table),
           prepare.onnxruntime_function(mlas.hard_swish), extract=x.extract_hard_swish),
    _table(NpuOp.LEAKY_RELU, b.activation_pattern("relax.nn.leakyrelu"), prepare.tflite_leaky_relu,
           prepare.onnxruntime_leaky_relu, extract=x.extract_leaky_relu),
    _table(NpuOp.ELU, b.elu_pattern, prepare.populated(tables.tflite_elu), extract=x.extract_elu),
    _table(NpuOp.REQUANTIZE, b.requantize_pattern, prepare.with_qparams(tables.requantize_table),
           prepare.onnxruntime_function(np.float32)),
    OpDef(NpuOp.SOFTMAX, SoftmaxParams, (_idiom(b.activation_pattern("relax.nn.softmax"), x.extract_softmax, False),),
          (tflite_kernel_only,), tiling.plan_softmax, prepare.softmax_multiplier, emit.emit_softmax,
          (Opcode.SOFTMAX,), softmax.SOFTMAX_OUTPUT),
    _mover(NpuOp.TRANSPOSE, TransposeParams, b.transpose_pattern, x.extract_transpose, tiling.plan_transpose,
           emit.emit_transpose),
    _mover(NpuOp.STRIDED_SLICE, SliceParams, b.strided_slice_pattern, x.extract_strided_slice, tiling.plan_slice,
           emit.emit_strided_slice),
    _mover(NpuOp.PAD, PadParams, b.pad_pattern, x.extract_pad, tiling.plan_pad, emit.emit_pad),
    _mover(NpuOp.RESIZE_NEAREST, ResizeNearestParams, rs.nearest_pattern, rs.extract_resize_nearest,
           tiling.plan_resize_nearest, emit_resize_nearest),
    OpDef(NpuOp.RESIZE_BILINEAR, ResizeBilinearParams,
          (_idiom(rs.bilinear_pattern, rs.extract_resize_bilinear, False),),
          (tflite_integer_kernel, resize_keeps_qparams), tiling.plan_resize_bilinear, prepare.resize_bilinear_steps,
          emit_resize_bilinear, (Opcode.RESIZE_BILINEAR,)),
    OpDef(NpuOp.CONCAT, ConcatParams,
          tuple(_idiom(b.concat_pattern(arity), x.extract_concat, False) for arity in range(2, MAX_CONCAT_INPUTS + 1)),
          (), tiling.plan_concat, prepare.nothing, emit.emit_concat, ()),
)

_BY_OP: dict[NpuOp, OpDef] = {d.op: d for d in OPS}
BY_COMPOSITE: dict[str, OpDef] = {d.composite: d for d in OPS}


def op_def(op: NpuOp) -> OpDef:
    """The definition of ``op``; an operator without one is refused by name, never given a default."""
    try:
        return _BY_OP[op]
    except KeyError:
        raise UnsupportedOpError(f"NPU operator {getattr(op, 'name', op)} has no definition in npu_backend.ops") from None


def composite_def(name: str) -> OpDef:
    try:
        return BY_COMPOSITE[name]
    except KeyError:
        raise UnsupportedOpError(f"composite {name!r} is not an NPU operator; known: {', '.join(BY_COMPOSITE)}") \
            from None


def decode_composite(attrs) -> NpuParams:
    """The record a composite function's ``npu.*`` attributes encode."""
    try:
        op = NpuOp[str(attrs["npu.op"])]
    except KeyError:
        raise UnsupportedOpError(f"composite attribute npu.op={attrs.get('npu.op')!r} names no NPU operator") from None
    return from_attrs(attrs, op_def(op).record)
