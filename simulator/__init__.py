"""Cycle-approximate, bit-exact simulator of the NPU: the hardware side of the contract.

It owns the command-stream format, the instruction set and the integer
numerics, and depends only on numpy and flatbuffers (never on TVM), so a
hardware team can run streams without the compiler.
"""

from .config import DEFAULT_PRESET, PRESETS, NpuConfig, get_config, load_config, register_preset, resolve_config
from .errors import ConfigError, ExecutionError, NpuError, NumericsError, StreamError
from .isa import (FORMAT_VERSION, ActivationType, Buffer, BufferKind, Command, CommandStream, Convolution, DmaCopy,
                  FeatureMap, MemorySpace, Opcode)
from .machine import CommandStats, RunStats, run_stream
from .opcodes import OPCODES, OpcodeDef, Unit, opcode_def
from .numerics import Rounding
from .stream import decode_stream, encode_stream
from .validate import validate_stream

__all__ = [
    "DEFAULT_PRESET", "PRESETS", "NpuConfig", "get_config", "load_config", "register_preset", "resolve_config", "ConfigError", "ExecutionError",
    "NpuError", "NumericsError", "StreamError", "FORMAT_VERSION", "ActivationType", "Buffer", "BufferKind", "Command",
    "CommandStream", "Convolution", "DmaCopy", "FeatureMap", "MemorySpace", "Opcode", "CommandStats",
    "RunStats", "run_stream", "OPCODES", "OpcodeDef", "Unit", "opcode_def", "Rounding", "decode_stream", "encode_stream", "validate_stream",
]
