"""The pattern table, built from the operator definitions and registered under the prefix ``npu``.

Rows come from :data:`npu_backend.ops.OPS` (each operator's idioms, in
priority order), which :func:`npu_backend.register` passes to
:func:`register_table`; this module itself knows no operator. Order is
priority, highest first, the order ``FuseOpsByPattern`` consumes. TVM's
registry treats *later* registrations as higher priority, so
``register_table`` registers the table reversed; ``get_patterns_with_prefix``
then returns it in this order.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix, register_patterns
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl.pattern import DFPattern

from simulator.config import NpuConfig, get_config
from simulator.numerics import Rounding

from ..errors import InternalError, NpuError
from ..legality import violation
from ..params import OPERAND_ROLES, NpuParams
from ..reference import Reference, follow_reference
from ..relax_exprs import operators, required_ops

PREFIX = "npu"


@dataclass(frozen=True)
class Idiom:
    """One way a graph spells an operator: a pattern and the extraction of its parameter record."""

    build: Callable[[bool], tuple[DFPattern, dict]]
    """with_clip -> (root pattern, named sub-patterns)."""
    extract: Callable[..., NpuParams]
    """named matched expressions [, dataflow qparams of ``qparam_roles``] -> the operator's record."""
    fused_clip: bool
    """Whether a following int8 clip (fused ReLU/ReLU6) can be part of the match."""
    constant_operands: frozenset = frozenset()
    """Operand roles the extraction accepts as constants (it then carries their values)."""
    qparam_roles: tuple = ()
    """Annotated tensors whose qparams the extraction receives from the dataflow analysis (its second
    argument: role -> TensorQParams or None), for idioms that state no qparams of their own."""


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
    failure: Exception | None = None
    """A bug met while checking a match (raised by ``partition_for_npu`` once fusion returns: an exception
    raised inside TVM's callback would reach the caller as a bare RuntimeError)."""


def extract_params(idiom: Idiom, annotations: Mapping, reference: Reference,
                   qparams: Mapping | None = None) -> NpuParams:
    """The one extraction the check and the composite annotation share, in the reference's rounding.

    An idiom that states its own arithmetic (its ``rounding`` is not TFLite's default) keeps it.
    """
    params = idiom.extract(annotations, qparams or {}) if idiom.qparam_roles else idiom.extract(annotations)
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


def _make_check(definition, idiom: Idiom):
    def check(context) -> bool:
        # Applied outside partition_for_npu (FuseOpsByPattern on the registry's patterns, as TVM's own
        # backends are tested): the default preset and TFLite's numerics, as documented.
        inside = ACTIVE_CONTEXT.get()
        active = inside or PartitionContext(get_config())
        annotations = {str(k): v for k, v in context.annotated_expr.items()}
        anchor_var = context.value_to_bound_var.get(annotations["anchor"])
        anchor = anchor_var.name if anchor_var is not None else "?"
        reason = None
        if has_leaking_intermediate_variables(context):
            reason = "an intermediate result is also used outside the fused operator"
        elif any(isinstance(annotations.get(role), Constant) for role in OPERAND_ROLES
                 if role not in idiom.constant_operands):
            reason = "an operand is a constant; the NPU reads operands from tensors the graph computes"
        else:
            qparams = {role: active.tensor_qparams.get(_bound_name(annotations.get(role), context))
                       for role in idiom.qparam_roles}
            try:
                params = extract_params(idiom, annotations, active.reference, qparams)
                reason = violation(definition, params, active.config)
            except NpuError as exc:
                reason = str(exc)
            except Exception as exc:  # a bug: say where, never hide it as a host fallback
                bug = InternalError(f"checking the {definition.composite} match at {anchor}: "
                                    f"{type(exc).__name__}: {exc}")
                bug.__cause__ = exc  # the traceback of the bug itself, when partition_for_npu raises it
                if inside is None:
                    raise bug from exc
                inside.failure = inside.failure or bug
                return False
        if reason is not None:
            active.rejections.append(Rejection(definition.composite, anchor, reason))
        return reason is None

    return check


def table_rows(definitions) -> list[tuple]:
    """The ordered (name, pattern, annotations, check) tuples of ``definitions``, highest priority first."""
    rows = []
    for with_clip in (True, False):  # a fused activation must be claimed before the bare op
        for definition in definitions:
            for idiom in definition.idioms:
                if with_clip and not idiom.fused_clip:
                    continue
                pattern, annotations = idiom.build(with_clip)
                rows.append((definition.composite, pattern, annotations, _make_check(definition, idiom)))
    return rows


def register_table(definitions) -> None:
    register_patterns(list(reversed(table_rows(definitions))))


def registered_patterns():
    return get_patterns_with_prefix(PREFIX)


_required = functools.cache(required_ops)
""":func:`required_ops` of a registered pattern, worked out once (TVM objects hash by identity; the registry
keeps its patterns alive)."""


def patterns_for(mod) -> list:
    """The registered patterns that can match somewhere in ``mod``, in priority order: those whose required
    operators all occur in it. ``FuseOpsByPattern`` tries every pattern over the whole module in C++ (about
    0.1 ms each on a one-layer module, 45 patterns); a pattern whose operator is absent can neither match nor
    reach its check, so leaving it out changes nothing but the time."""
    present = set().union(*(operators(f) for f in mod.functions.values() if isinstance(f, relax.Function)))
    return [entry for entry in registered_patterns() if _required(entry.pattern) <= present]
