"""Small questions the graph passes ask of Relax expressions, answered in one place."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant


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


SMALL_CONSTANT = 4096
"""Elements up to which :func:`constant_value` keeps a constant's array: qparams and small vectors."""

_VALUES: OrderedDict = OrderedDict()
_VALUES_KEPT = 1024
_VALUES_LOCK = threading.Lock()


def constant_value(expr: Constant) -> np.ndarray:
    """A Relax constant's value as a read-only numpy array.

    The graph passes read the same qparam constants many times per partition (the checks, the dataflow
    analysis, each extraction): a device-to-numpy copy costs about 30 microseconds, a look-up one. Small
    arrays are kept in a bounded table keyed by the constant's address (the table holds the constant, so the
    address cannot be reused while its entry lives); larger ones are copied each time. Read-only, so no
    caller can change a value another one reads."""
    key = hash(expr)  # the object's address: unique while the table holds the constant
    with _VALUES_LOCK:
        kept = _VALUES.get(key)
        if kept is not None:
            _VALUES.move_to_end(key)
            return kept[1]
    value = expr.value.numpy()
    value.setflags(write=False)
    if value.size <= SMALL_CONSTANT:
        with _VALUES_LOCK:
            _VALUES[key] = (expr, value)
            if len(_VALUES) > _VALUES_KEPT:
                _VALUES.popitem(last=False)
    return value
