"""Whole-stream validation against a hardware configuration, before anything runs.

The stream's own configuration must be the simulator's (by value), its
buffers consistent, and every command legal: each opcode's validator
(:mod:`simulator.command_checks`, chosen by the opcode table) raises
``StreamError`` with a one-line reason naming the command. Running a stream
that passed validation cannot index outside DRAM buffers or SRAM, and its dependencies
order every SRAM hazard between the concurrent engines (:mod:`simulator.hazards`),
so running it in stream order computes what the concurrent machine computes.
"""

from __future__ import annotations

import numpy as np

from .config import NpuConfig
from .errors import StreamError
from .hazards import check_dependencies
from .isa import BufferKind, CommandStream, feature_maps
from .opcodes import opcode_def

DTYPES = {"int8": 1, "uint8": 1, "int16": 2, "int32": 4}


def _check_buffers(stream: CommandStream, config: NpuConfig) -> None:
    total = sum(buf.size for buf in stream.buffers)
    if total > config.dram_bytes:
        raise StreamError(f"buffers need {total} bytes of DRAM, more than the {config.dram_bytes} of {config.name}")
    names = set()
    for index, buf in enumerate(stream.buffers):
        where = f"buffer {index} ({buf.name!r})"
        if buf.size <= 0:
            raise StreamError(f"{where}: size must be positive")
        if buf.dtype not in DTYPES:
            raise StreamError(f"{where}: unknown dtype {buf.dtype!r}")
        if buf.kind == BufferKind.CONSTANT and len(buf.data) != buf.size:
            raise StreamError(f"{where}: holds {len(buf.data)} bytes but declares {buf.size}")
        if buf.kind != BufferKind.CONSTANT and buf.data:
            raise StreamError(f"{where}: only CONSTANT buffers may carry data")
        if buf.kind in (BufferKind.INPUT, BufferKind.OUTPUT):
            if buf.name in names:
                raise StreamError(f"{where}: duplicate input/output name")
            names.add(buf.name)
            if any(d <= 0 for d in buf.shape) or int(np.prod(buf.shape)) * DTYPES[buf.dtype] != buf.size:
                raise StreamError(f"{where}: shape {buf.shape} of {buf.dtype} does not make {buf.size} bytes")


def _check_command(stream: CommandStream, config: NpuConfig, index: int, command) -> None:
    where = f"command {index} ({command.opcode.name})"
    definition = opcode_def(command.opcode)
    if not isinstance(command.payload, definition.payload):
        raise StreamError(f"{where}: payload is {type(command.payload).__name__}, expected "
                          f"{definition.payload.__name__}")
    for name, fmap in feature_maps(command.payload):
        if fmap.dtype not in definition.activations:
            allowed = " or ".join(sorted(a.name for a in definition.activations))
            raise StreamError(f"{where}: {name} holds {fmap.dtype.name} elements; {command.opcode.name} takes "
                              f"{allowed}")
    definition.validate(stream, config, command.opcode, command.payload, where)


def validate_stream(stream: CommandStream, config: NpuConfig) -> None:
    """Raise ``StreamError`` unless the stream was compiled for ``config``'s numbers, every buffer and command is
    legal on it, and its dependencies order every hazard between the engines."""
    differences = stream.config.differences(config)
    if differences:
        raise StreamError(f"stream was compiled for other hardware ({stream.config.name!r}, simulator "
                          f"{config.name!r}): {'; '.join(differences)}")
    if not stream.buffers_of(BufferKind.OUTPUT):
        raise StreamError("stream declares no output buffer")
    _check_buffers(stream, config)
    for index, command in enumerate(stream.commands):
        _check_command(stream, config, index, command)
    check_dependencies(stream, config)
