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
``partition_for_npu(mod, reference="auto")``; a hand-built module without the
mark is taken as TFLite's, and ``reference="tflite" | "onnxruntime"`` overrides
the detection.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

import tvm

from simulator.numerics import Rounding

from .errors import NpuError

SOURCE_ATTR = "npu.source"
"""Module attribute naming the frontend a module came from (``tflite`` or ``onnx``)."""


class Reference(str, Enum):
    TFLITE = "tflite"
    """TFLite's reference kernels (LiteRT BUILTIN_REF): fixed point, round half away from zero."""
    ONNXRUNTIME = "onnxruntime"
    """onnxruntime's CPU execution of QDQ graphs (float32 kernels, quantization rounding half to even)."""


REFERENCE_OF_SOURCE = {"tflite": Reference.TFLITE, "onnx": Reference.ONNXRUNTIME}


def mark_source(mod: tvm.IRModule, source: str) -> tvm.IRModule:
    return mod.with_attr(SOURCE_ATTR, source)


def resolve_reference(mod: tvm.IRModule, requested: str = "auto") -> Reference:
    """The reference to follow: the requested one, or the one of the module's recorded source."""
    if requested != "auto":
        try:
            return Reference(requested)
        except ValueError:
            known = ", ".join(["auto", *(r.value for r in Reference)])
            raise NpuError(f"unknown reference {requested!r}; known: {known}") from None
    source = mod.attrs.get(SOURCE_ATTR) if mod.attrs is not None else None
    return REFERENCE_OF_SOURCE.get(str(source), Reference.TFLITE) if source is not None else Reference.TFLITE


def follow_reference(params, reference: Reference):
    """The extracted record with the rounding of ``reference`` (extraction assumes TFLite's).

    Every record with a ``rounding`` field takes ``Rounding.ONNXRUNTIME``;
    records without one (pure data movement) are unchanged.
    """
    if reference == Reference.TFLITE or not any(f.name == "rounding" for f in dataclasses.fields(params)):
        return params
    return dataclasses.replace(params, rounding=Rounding.ONNXRUNTIME)
