"""Validation of every quantization parameter in a module, before partitioning.

A zero, negative or non-finite scale, a zero point outside its integer type, or
per-axis qparams that do not fit their axis are user errors, whichever side of
the partition the operator would land on: on the host TVM would run them into a
division by zero or a silently wrong result, and on the NPU no multiplier
exists for them. So ``partition_for_npu`` checks them all first and raises
:class:`QParamError` naming the binding, the tensor and the value.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from .errors import QParamError
from .relax_exprs import constant_value, is_call, static_shape

INTEGER_RANGES = {name: (int(np.iinfo(name).min), int(np.iinfo(name).max))
                  for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32")}


def _name(expr) -> str:
    return expr.name if isinstance(expr, relax.Var) else type(expr).__name__


def _check_call(var: relax.Var, call: relax.Call) -> None:
    quantize = is_call(call, "relax.quantize")
    data = call.args[0]
    tensor = f"{_name(var)} (quantized)" if quantize else f"{_name(data)} (dequantized)"
    where = f"{var.name} = {call.op.name}({_name(data)}): tensor {tensor}"
    scale, zero_point = call.args[1], call.args[2]
    shape = static_shape(data)
    axis = int(call.attrs.axis)
    sizes = {label: np.size(constant_value(arg)) if isinstance(arg, Constant) else 1
             for label, arg in (("scale", scale), ("zero point", zero_point))}
    if shape is not None and max(sizes.values()) > 1:
        if not -len(shape) <= axis < len(shape):
            raise QParamError(f"{where}: quantization axis {axis} is out of range for rank {len(shape)}")
        extent = shape[axis]
        for label, size in sizes.items():
            if size not in (1, extent):
                raise QParamError(f"{where}: {size} {label}s for axis {axis} of extent {extent}")
    if isinstance(scale, Constant):
        values = np.asarray(constant_value(scale), dtype=np.float64).reshape(-1)
        bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
        if bad.size:
            at = f"[{bad[0]}]" if values.size > 1 else ""
            raise QParamError(f"{where}: scale{at} = {values[bad[0]]:g} must be positive and finite")
    integer = str(call.attrs.out_dtype) if quantize else str(getattr(data.ty, "dtype", ""))
    if isinstance(zero_point, Constant) and integer in INTEGER_RANGES:
        low, high = INTEGER_RANGES[integer]
        values = np.asarray(constant_value(zero_point), dtype=np.int64).reshape(-1)
        bad = np.flatnonzero((values < low) | (values > high))
        if bad.size:
            at = f"[{bad[0]}]" if values.size > 1 else ""
            raise QParamError(f"{where}: zero point{at} = {values[bad[0]]} is outside {integer} [{low}, {high}]")


def check_qparams(func: relax.Function) -> None:
    """Raise :class:`QParamError` on the first invalid constant qparam of ``func``'s quantize/dequantize calls."""
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if is_call(value, "relax.quantize") or is_call(value, "relax.dequantize"):
                _check_call(binding.var, value)
