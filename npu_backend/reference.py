"""Whose integer results the NPU reproduces: the reference runtime of the model's source.

A quantized graph does not say how its requantizations round; its source
does. TFLite's reference kernels use fixed-point multipliers and round half
away from zero. onnxruntime runs an ONNX QDQ graph literally in float32 and its
QuantizeLinear divides by the scale and rounds half to even; where the exact
value is a tie (common when scales are related by powers of two), float32
rounding in its kernels decides, so ``Rounding.ONNXRUNTIME`` follows MLAS's
float32 operation order for elementwise, pooling and mean units and its float
functions for tables, and uses the exact accumulator times the double scale for
convolutions (see :mod:`simulator.numerics`).

The choice is recorded by the loaders (:func:`npu_backend.load_tflite` marks a
module ``tflite``, :func:`npu_backend.load_onnx` marks it ``onnx``) and read by
``partition_for_npu(mod, reference="auto")``. A module straight from TVM's own
importers carries no mark, so the importer is recognised by what it leaves in
the module (:data:`EVIDENCE`); where nothing tells, TFLite's numerics are used
with a :class:`npu_backend.errors.NpuWarning` saying how to choose, and the
partition report states the choice and why. ``reference="tflite" |
"onnxruntime"`` overrides all of it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import tvm
from tvm import relax
from tvm.ir.expr import Constant

from simulator.numerics import Rounding

from .errors import NpuError, NpuWarning
from .relax_exprs import is_call

SOURCE_ATTR = "npu.source"
"""Module attribute naming the numerics a module follows (``tflite`` or ``onnx``): its loader's, or for a module
:func:`npu_backend.quantize` made, the rounding it was calibrated with."""


class Reference(str, Enum):
    TFLITE = "tflite"
    """TFLite's reference kernels (LiteRT BUILTIN_REF): fixed point, round half away from zero."""
    ONNXRUNTIME = "onnxruntime"
    """onnxruntime's CPU execution of QDQ graphs (float32 kernels, quantization rounding half to even)."""


REFERENCE_OF_SOURCE = {"tflite": Reference.TFLITE, "onnx": Reference.ONNXRUNTIME}


def mark_source(mod: tvm.IRModule, source: str) -> tvm.IRModule:
    return mod.with_attr(SOURCE_ATTR, source)


def _calls(mod: tvm.IRModule):
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for binding in block.bindings:
                    if isinstance(binding.value, relax.Call):
                        yield binding.value


def _tflite_function_attrs(mod: tvm.IRModule) -> str | None:
    func = mod["main"] if "main" in mod else None
    if func is not None and func.attrs is not None and "params" in func.attrs:
        return "main carries the 'params' attribute TVM's TFLite importer writes"
    return None


def _zero_point_dtypes(mod: tvm.IRModule) -> list[str]:
    """The dtype of every constant zero point of a quantize or dequantize: each importer types them its way."""
    return [str(call.args[2].value.dtype) for call in _calls(mod)
            if (is_call(call, "relax.quantize") or is_call(call, "relax.dequantize"))
            and isinstance(call.args[2], Constant)]


def _narrow_zero_points(mod: tvm.IRModule) -> str | None:
    if any(dtype in ("int8", "uint8") for dtype in _zero_point_dtypes(mod)):
        return "zero points are typed int8/uint8, as TVM's ONNX importer writes QuantizeLinear's"
    return None


def _int32_zero_points(mod: tvm.IRModule) -> str | None:
    dtypes = _zero_point_dtypes(mod)
    if dtypes and all(dtype == "int32" for dtype in dtypes):
        return "every zero point is int32, as TVM's TFLite importer writes them"
    return None


def _no_quantization(mod: tvm.IRModule) -> str | None:
    """Integer-only graphs (int8 data movement, the cast idioms) are TFLite's; float graphs have nothing to round."""
    if not any(is_call(call, "relax.quantize") or is_call(call, "relax.dequantize") for call in _calls(mod)):
        return "no quantize or dequantize: integer-only idioms are TFLite's"
    return None


def _nchw_layout(mod: tvm.IRModule) -> str | None:
    for call in _calls(mod):
        layout = getattr(call.attrs, "data_layout", None) or getattr(call.attrs, "layout", None)
        if layout is not None and str(layout) == "NCHW":
            return f"{call.op.name} computes in NCHW, ONNX's layout"
    return None


EVIDENCE: tuple[tuple[str, Callable[[tvm.IRModule], str | None]], ...] = (
    ("tflite", _tflite_function_attrs),
    ("tflite", _int32_zero_points),
    ("tflite", _no_quantization),
    ("onnx", _narrow_zero_points),
    ("onnx", _nchw_layout),
)
"""(source, test): what TVM's importers leave in a module; each test returns why it recognises one, or None."""


@dataclass(frozen=True)
class ReferenceChoice:
    reference: Reference
    why: str


def choose_reference(mod: tvm.IRModule, requested: str = "auto") -> ReferenceChoice:
    """The reference to follow and why: the requested one, the loader's mark, or what the module shows."""
    if requested != "auto":
        try:
            return ReferenceChoice(Reference(requested), f"requested (reference={requested!r})")
        except ValueError:
            known = ", ".join(["auto", *(r.value for r in Reference)])
            raise NpuError(f"unknown reference {requested!r}; known: {known}") from None
    source = mod.attrs.get(SOURCE_ATTR) if mod.attrs is not None else None
    if source is not None and str(source) in REFERENCE_OF_SOURCE:
        return ReferenceChoice(REFERENCE_OF_SOURCE[str(source)],
                               f"recorded on the module ({SOURCE_ATTR}={str(source)!r}: by npu_backend.load_{source}, "
                               "or by npu_backend.quantize for its rounding)")
    found = [(source, why) for source, test in EVIDENCE for why in (test(mod),) if why is not None]
    sources = {source for source, _ in found}
    if len(sources) == 1:
        source = sources.pop()
        return ReferenceChoice(REFERENCE_OF_SOURCE[source], "detected: " + "; ".join(why for _, why in found))
    why = ("the module shows signs of both importers (" + "; ".join(why for _, why in found) + ")" if found
           else "nothing in the module tells which runtime it came from")
    warnings.warn(NpuWarning(f"{why}: reproducing TFLite's reference kernels; pass reference='onnxruntime' "
                             "(npu --reference onnxruntime) to reproduce onnxruntime instead"), stacklevel=3)
    return ReferenceChoice(Reference.TFLITE, f"default, {why}")




def follow_reference(params, reference: Reference):
    """The extracted record with the rounding of ``reference`` (extraction assumes TFLite's).

    Every record with a ``rounding`` field takes ``Rounding.ONNXRUNTIME``;
    records without one (pure data movement) are unchanged.
    """
    if reference == Reference.TFLITE or not any(f.name == "rounding" for f in dataclasses.fields(params)):
        return params
    return dataclasses.replace(params, rounding=Rounding.ONNXRUNTIME)
