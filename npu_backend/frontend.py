"""Model loading with the project's errors instead of importer tracebacks."""

from __future__ import annotations

from pathlib import Path

import tvm

from .errors import ModelImportError
from .reference import mark_source

TFLITE_IDENTIFIER = b"TFL3"


def load_tflite(path: str | Path) -> tvm.IRModule:
    """Import a .tflite file with TVM's own TFLite frontend, extended for the quantized operators it refuses
    (:mod:`npu_backend.tflite_import`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelImportError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) < 8 or data[4:8] != TFLITE_IDENTIFIER:
        raise ModelImportError(f"{path} is not a TFLite flatbuffer (no 'TFL3' identifier)")
    import tflite
    from tvm.relax.frontend.tflite import from_tflite

    from .tflite_import import NpuOperatorConverter

    model = tflite.Model.GetRootAsModel(data, 0)
    try:
        return mark_source(from_tflite(model, op_converter=NpuOperatorConverter), "tflite")
    except Exception as exc:  # the importer raises assorted types (16x8 refusals included); the user needs one line
        raise ModelImportError(f"TVM's TFLite importer rejected {path.name}: {_last_line(exc)}") from None


def _last_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]


def load_onnx(path: str | Path) -> tvm.IRModule:
    """Import an .onnx file (e.g. a QDQ model from onnxruntime's ``quantize_static``) with TVM's ONNX frontend.

    Constants stay in the graph (``keep_params_in_input=False``) and nothing is
    folded, so quantized weights reach the pattern table as int8 constants
    under their ``dequantize``.
    """
    path = Path(path)
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    try:
        model = onnx.load_model_from_string(path.read_bytes())
    except OSError as exc:
        raise ModelImportError(f"cannot read {path}: {exc.strerror}") from None
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ModelImportError(f"{path} is not an ONNX model: {_last_line(exc)}") from None
    try:
        return mark_source(from_onnx(model, keep_params_in_input=False), "onnx")
    except Exception as exc:
        raise ModelImportError(f"TVM's ONNX importer rejected {path.name}: {_last_line(exc)}") from None


def load_quantized_model(path: str | Path) -> tvm.IRModule:
    """The QDQ module of a quantized-model file written by ``npu quantize``."""
    from .quantization.stored import load_quantized

    return load_quantized(path).module


LOADERS = {".tflite": load_tflite, ".onnx": load_onnx, ".npuq": load_quantized_model}


def load_model(path: str | Path) -> tvm.IRModule:
    """Import a model by its file extension (.tflite, .onnx, or .npuq from ``npu quantize``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in LOADERS:
        raise ModelImportError(f"{Path(path).name}: unknown model type {suffix!r} (known: {', '.join(LOADERS)})")
    return LOADERS[suffix](path)
