"""The project's exception hierarchy.

It lives in the simulator because the simulator is the bottom of the dependency
graph (it imports neither TVM nor npu_backend); the compiler re-exports it.
Every error carries a one-line reason fit for a command-line user.
"""


class NpuError(Exception):
    """Root of every error npu_backend and the simulator raise on bad input."""


class StreamError(NpuError):
    """A command stream is malformed, of another format version, or inconsistent."""


class ConfigError(NpuError):
    """A hardware configuration is invalid or unknown."""


class NumericsError(NpuError):
    """A quantization parameter is outside what the integer arithmetic can represent."""


class ExecutionError(NpuError):
    """A valid stream was run with inputs that do not match its declared buffers."""
