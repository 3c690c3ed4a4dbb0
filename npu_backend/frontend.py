"""Model loading with the project's errors instead of importer tracebacks."""

from __future__ import annotations

from pathlib import Path

import tvm

from .errors import ModelImportError

TFLITE_IDENTIFIER = b"TFL3"


def load_tflite(path: str | Path) -> tvm.IRModule:
    """Import a .tflite file with TVM's own TFLite frontend."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelImportError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) < 8 or data[4:8] != TFLITE_IDENTIFIER:
        raise ModelImportError(f"{path} is not a TFLite flatbuffer (no 'TFL3' identifier)")
    import tflite
    from tvm.relax.frontend.tflite import from_tflite

    try:
        return from_tflite(tflite.Model.GetRootAsModel(data, 0))
    except Exception as exc:  # the importer raises assorted types; the user needs one line
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ModelImportError(f"TVM's TFLite importer rejected {path.name}: {first_line}") from None
