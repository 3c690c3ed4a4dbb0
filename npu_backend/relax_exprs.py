"""Small questions the graph passes ask of Relax expressions, answered in one place."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import pattern as dpl
from tvm.relax.dpl.pattern import DFPattern


def is_call(expr, op_name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator ``op_name`` (e.g. ``"relax.dequantize"``)."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op_name


def operators(func: relax.Function) -> set[str]:
    """The names of the Relax operators ``func`` calls (nested functions included)."""
    names: set[str] = set()
    relax.analysis.post_order_visit(func, lambda e: names.add(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return names


def required_ops(pattern: DFPattern) -> frozenset[str]:
    """The operators every expression ``pattern`` matches must call: a lower bound, empty when nothing is
    certain (an alternation needs only what both sides need; a wildcard, constant or negation needs nothing)."""
    if isinstance(pattern, dpl.CallPattern):
        op = pattern.op
        own = {op.expr.name} if isinstance(op, dpl.ExprPattern) and isinstance(op.expr, tvm.ir.Op) else set()
        return frozenset(own).union(*(required_ops(a) for a in (pattern.args or ())))
    if isinstance(pattern, dpl.OrPattern):
        return required_ops(pattern.left) & required_ops(pattern.right)
    if isinstance(pattern, dpl.AndPattern):
        return required_ops(pattern.left) | required_ops(pattern.right)
    if isinstance(pattern, (dpl.AttrPattern, dpl.TypePattern, dpl.ShapePattern, dpl.DataTypePattern)):
        return required_ops(pattern.pattern)
    if isinstance(pattern, dpl.TupleGetItemPattern):
        return required_ops(pattern.tuple)
    if isinstance(pattern, (dpl.TuplePattern, dpl.UnorderedTuplePattern)):
        return frozenset().union(*(required_ops(f) for f in pattern.fields))
    return frozenset()


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
