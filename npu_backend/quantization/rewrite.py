"""Re-emit a float graph's layers: as float functions (to calibrate) or in the canonical QDQ form (to run).

One emitter serves both, so the graph calibrated is the graph that runs: a
layer's operands, weights and constants are supplied by the caller (float
values, or dequantized int8), the layer's own operators are copied, and a
multi-operator idiom is written in the one spelling the NPU's pattern matches
(hard swish as TFLite's importer writes it, whichever importer it came from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from .layers import HARD_SWISH, Alias, Layer, resolve


@dataclass(frozen=True)
class TensorQ:
    """Per-tensor int8 qparams of one activation."""

    scale: float
    zero_point: int


@dataclass(frozen=True)
class WeightQ:
    """A layer's quantized weight and bias, as the NPU stores them."""

    weight: np.ndarray  # int8, the float weight's layout
    scales: np.ndarray  # float32 [C]
    axis: int
    bias: np.ndarray | None = None  # int32 [C]
    bias_scales: np.ndarray | None = None  # float32 [C]: input scale x weight scale


_SCALARS: dict = {}
"""(dtype, value) -> the one Constant of that scalar: calibration emits a module per layer, each with its qparams
as constants, and making a Relax constant copies its value into a TVM tensor (70 us, however small)."""


def const(value, dtype: str) -> Constant:
    array = np.asarray(value, dtype=dtype)
    if array.ndim:
        return relax.const(array, dtype)
    key = (dtype, array.tobytes())
    constant = _SCALARS.get(key)
    if constant is None:
        if len(_SCALARS) > 4096:  # qparams of a few models at a time; bounded all the same
            _SCALARS.clear()
        constant = _SCALARS[key] = relax.const(array, dtype)
    return constant


def quantize(expr, q: TensorQ):
    return relax.op.quantize(expr, const(q.scale, "float32"), const(q.zero_point, "int32"), axis=-1,
                             out_dtype="int8")


def dequantize(expr, q: TensorQ):
    return relax.op.dequantize(expr, const(q.scale, "float32"), const(q.zero_point, "int32"), axis=-1,
                               out_dtype="float32")


def dequantized_weight(wq: WeightQ):
    channels = wq.scales.size
    return relax.op.dequantize(const(wq.weight, "int8"), const(wq.scales, "float32"),
                               const(np.zeros(channels), "int32"), axis=wq.axis, out_dtype="float32")


def dequantized_bias(wq: WeightQ, shape: tuple[int, ...]):
    """The int32 bias in the float bias's own shape, dequantized along its channel axis."""
    axis = next((i for i, d in enumerate(shape) if d == wq.bias.size and d > 1), len(shape) - 1)
    return relax.op.dequantize(const(wq.bias.reshape(shape), "int32"), const(wq.bias_scales, "float32"),
                               const(np.zeros(wq.bias.size), "int32"), axis=axis, out_dtype="float32")


@dataclass
class Operands:
    """What the emitter substitutes for a layer's inputs and constants."""

    activation: Callable  # (var, use) -> expr: a fresh expression per use (each consumer its own dequantize)
    weight: Callable | None = None  # () -> expr
    bias: Callable | None = None  # (shape) -> expr
    constant: Callable | None = None  # (Constant) -> expr


def _substitute(arg, layer: Layer, local: dict, folded: dict, ops: Operands, role: str):
    if isinstance(arg, relax.Tuple):
        return relax.Tuple([_substitute(f, layer, local, folded, ops, role) for f in arg.fields])
    if isinstance(arg, relax.Var):
        if isinstance(folded.get(arg), Alias):
            arg = resolve(arg, folded)
        if arg in local:
            return local[arg]
        if arg in folded:
            if role == "weight":
                return ops.weight()
            if role == "bias":
                return ops.bias(folded[arg].shape)
            return relax.const(folded[arg])
        return ops.activation(arg)
    if isinstance(arg, Constant):
        if role == "weight":
            return ops.weight()
        if role == "bias":
            return ops.bias(tuple(arg.value.shape))
        if arg in layer.constants and ops.constant is not None:
            return ops.constant(arg)
    return arg


def _roles(layer: Layer, position: int, value) -> list[str]:
    roles = ["operand"] * len(value.args)
    if layer.weight is not None and position == 0:
        roles[1] = "weight"
    if layer.bias is not None and position == 1:
        roles[1] = "bias"
    return roles


def emit_layer(bb: relax.BlockBuilder, layer: Layer, folded: dict, ops: Operands, emitted: dict | None = None):
    """Emit the layer's operators; returns its (float) output expression. ``emitted`` receives the emitted
    var of each of the layer's original bindings."""
    if layer.kind is HARD_SWISH:
        x = layer.inputs[0]
        plus = bb.emit(relax.op.add(ops.activation(x), relax.const(3.0, "float32")))
        relu6 = bb.emit(relax.op.clip(plus, 0, 6))
        product = bb.emit(relax.op.multiply(ops.activation(x), relu6))
        return bb.emit(relax.op.divide(product, relax.const(6.0, "float32")))
    local: dict = {} if emitted is None else emitted
    out = None
    for position, binding in enumerate(layer.bindings):
        value = binding.value
        if isinstance(value, relax.Call):
            roles = _roles(layer, position, value)
            args = [_substitute(a, layer, local, folded, ops, r) for a, r in zip(value.args, roles)]
            new = relax.Call(value.op, args, value.attrs, value.ty_args)
        else:
            new = _substitute(value, layer, local, folded, ops, "operand")
        out = bb.emit(new)
        local[binding.var] = out
    if layer.clamp is not None:
        lo, hi = layer.clamp
        out = bb.emit(relax.op.nn.relu(out) if (lo, hi) == (0.0, float("inf")) else relax.op.clip(out, lo, hi))
        for var in layer.clamp_vars:
            local[var] = out
    return out


