"""Dataflow analysis: the (scale, zero point) of int8 tensors that carry no quantize/dequantize.

Idioms such as the integer-domain convolution (``astype(x, "int32") - zp``)
never state the scale of their input; it lives on whatever produced ``x`` (a
``quantize``), or consumes it elsewhere (a ``dequantize``), possibly across
operators that move int8 data without changing its meaning. This pass
propagates those facts forwards and backwards to a fixed point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from .relax_exprs import constant_value
from .relax_ops import QPARAM_TRANSPARENT_OPS

@dataclass(frozen=True)
class TensorQParams:
    scale: float
    zero_point: int


def per_tensor_qparams(call) -> TensorQParams | None:
    """(scale, zero point) of a quantize/dequantize call with constant per-tensor qparams, else None."""
    scale, zero_point = call.args[1], call.args[2]
    if not (isinstance(scale, Constant) and isinstance(zero_point, Constant)):
        return None
    s, z = constant_value(scale), constant_value(zero_point)
    if s.size != 1 or z.size != 1:
        return None
    return TensorQParams(float(np.float32(s.reshape(-1)[0])), int(z.reshape(-1)[0]))


def _is_int8(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "int8"


def infer_qparams(func: relax.Function) -> dict[relax.Var, TensorQParams]:
    """Map every int8 variable whose qparams the graph determines to those qparams."""
    bindings = [(b.var, b.value) for block in func.body.blocks for b in block.bindings
                if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]
    known: dict[relax.Var, TensorQParams] = {}

    def learn(var, qp) -> bool:
        if qp is None or not isinstance(var, relax.Var) or var in known or not _is_int8(var):
            return False
        known[var] = qp
        return True

    # Each quantize/dequantize's constants read once (a fixed point takes several sweeps), in binding order.
    steps = []
    for var, call in bindings:
        op = call.op.name
        if op == "relax.quantize":
            steps.append((var, per_tensor_qparams(call), None))
        elif op == "relax.dequantize":
            steps.append((call.args[0], per_tensor_qparams(call), None))
        elif op in QPARAM_TRANSPARENT_OPS and call.args and _is_int8(call.args[0]):
            steps.append((var, None, call.args[0]))
    changed = True
    while changed:
        changed = False
        for var, stated, source in steps:
            if source is None:
                changed |= learn(var, stated)
            else:
                changed |= learn(var, known.get(source))
                changed |= learn(source, known.get(var))
    return known
