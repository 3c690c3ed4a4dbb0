"""Errors of the compiler side; all derive from the simulator's ``NpuError`` root."""

from simulator.errors import ConfigError, NpuError, NumericsError, StreamError


class ModelImportError(NpuError):
    """The model file is missing, malformed, or rejected by TVM's importer."""


class UnsupportedOpError(NpuError):
    """An operator, attribute or size the NPU cannot execute."""


class QParamError(NpuError):
    """Quantization parameters that are missing, inconsistent or out of range."""


class NpuWarning(UserWarning):
    """Something the user should know and may want to choose differently (e.g. numerics not detected)."""


class InternalError(NpuError):
    """A bug in npu_backend (an unforeseen case reached code that assumed otherwise): please report it."""


def first_line(exc: Exception) -> str:
    """The first line of an exception's message (a foreign library's error, shown as one line)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


__all__ = ["first_line", "InternalError", "NpuWarning", "NpuError", "ConfigError", "NumericsError", "StreamError", "ModelImportError",
           "UnsupportedOpError", "QParamError"]
