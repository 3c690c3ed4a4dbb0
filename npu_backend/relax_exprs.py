"""Small questions the graph passes ask of Relax expressions, answered in one place."""

from __future__ import annotations

import tvm
from tvm import relax


def is_call(expr, op_name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator ``op_name`` (e.g. ``"relax.dequantize"``)."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op_name


def static_shape(expr) -> tuple[int, ...] | None:
    """The shape of a tensor-typed expression when every dimension is a constant, else None."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape.values)
    except (TypeError, AttributeError):
        return None
