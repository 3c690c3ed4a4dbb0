"""Serialization of command streams: the only module that touches flatc's output.

A 2.x stream file is a 44-byte header, then the flatbuffer::

    0   b"NPUS"                      magic
    4   uint16 major, uint16 minor   format version (little endian)
    8   uint32                       payload length in bytes
    12  32 bytes                     SHA-256 of bytes 0..11 and of the payload
    44  payload                      the CommandStream flatbuffer (identifier "NPUC")

so any flipped, lost or added byte is refused before anything is parsed, and a
file of another major version is named as such. 1.x files are the bare
flatbuffer (no checksum), still read. Decoding is also defensive: every length
and offset read from the flatbuffer is checked against its size before it is
used, so a hostile payload raises ``StreamError`` instead of crashing, hanging
or allocating wildly.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import fields

import flatbuffers
import numpy as np

from ._generated import AccumulatorOverflow as fb_overflow
from ._generated import Buffer as fb_buffer
from ._generated import Command as fb_command
from ._generated import CommandStream as fb_stream
from ._generated import Convolution as fb_conv
from ._generated import DmaCopy as fb_dma
from ._generated import Elementwise as fb_elementwise
from ._generated import FeatureMap as fb_fmap
from ._generated import HardwareConfig as fb_hardware
from ._generated import MatMul as fb_matmul
from ._generated import Pooling as fb_pooling
from ._generated import Reduction as fb_reduction
from ._generated import Resize as fb_resize
from ._generated import Softmax as fb_softmax
from ._generated import TableLookup as fb_lut
from .config import NpuConfig, get_config
from .errors import ConfigError, StreamError
from .isa import (DEPS_SINCE, DTYPE_SINCE, READABLE_MAJORS, RECORD_SINCE, SCALE_RECORD, SCALE_RECORD_SINCE,
                  ActivationType, Buffer, BufferKind, Command, CommandStream, Convolution, DmaCopy, Elementwise,
                  FeatureMap, MatMul, MemorySpace, Opcode, Pooling, Reduction, Resize, Softmax, TableLookup,
                  WORD_RECORD, feature_maps)
from .numerics import ACCUMULATOR_OVERFLOWS, Rounding
from .opcodes import opcode_def

FILE_IDENTIFIER = b"NPUC"
CONTAINER_MAGIC = b"NPUS"
_HEADER = struct.Struct("<4sHHI")
HEADER_BYTES = _HEADER.size + 32

_DMA_FIELDS = ("src_space", "src_buffer", "src_offset", "dst_space", "dst_buffer", "dst_offset",
               "row_bytes", "rows", "src_stride", "dst_stride")
_FMAP_FIELDS = ("address", "height", "width", "channels", "dtype")
_CONV_FIELDS = ("weights_address", "scale_bias_address", "kernel_h", "kernel_w", "stride_h",
                "stride_w", "dilation_h", "dilation_w", "pad_top", "pad_left", "pad_bottom",
                "pad_right", "input_zero_point", "output_zero_point", "act_min", "act_max", "rounding",
                "scale_bias_record", "input_scale", "output_scale")


OVERFLOW_CODES = {mode: getattr(fb_overflow.AccumulatorOverflow, mode.upper()) for mode in ACCUMULATOR_OVERFLOWS}
"""``NpuConfig.accumulator_overflow`` -> the schema's ``AccumulatorOverflow`` value (format 2.1)."""
OVERFLOW_SINCE = (2, 1)
"""The format that added ``HardwareConfig.accumulator_overflow``; older streams mean ``"wrap"``."""
ARRAY_FIELDS_SINCE = (2, 4)
ARRAY_FIELDS = ("fold_fill_cycles", "parallel_depthwise")
"""``HardwareConfig`` fields of the MAC array's dataflow (format 2.4); older streams mean their defaults."""


def _new_array_fields(config: NpuConfig) -> list[str]:
    """The dataflow fields of ``config`` away from their defaults, which formats before 2.4 cannot say."""
    return [f"{name}={getattr(config, name)!r}" for name in ARRAY_FIELDS
            if getattr(config, name) != NpuConfig.__dataclass_fields__[name].default]


def _int16_feature_map(commands) -> str | None:
    """The first command holding an INT16 feature map (format 2.3), as ``command i (OPCODE) name``, or None."""
    for index, command in enumerate(commands):
        for name, fmap in feature_maps(command.payload):
            if fmap.dtype != ActivationType.INT8:
                return f"command {index} ({command.opcode.name}) {name}"
    return None


def _packed_record(commands, version: tuple[int, int]) -> str | None:
    """The first command whose scale/bias records ``version`` cannot carry (other than 12 bytes before 2.5, the
    8-byte record before 2.6), as ``command i (OPCODE)``, or None."""
    for index, command in enumerate(commands):
        if isinstance(command.payload, Convolution) and (
                (command.payload.scale_bias_record != WORD_RECORD and version < RECORD_SINCE)
                or (command.payload.scale_bias_record == SCALE_RECORD.itemsize and version < SCALE_RECORD_SINCE)):
            return f"command {index} ({command.opcode.name})"
    return None


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _flatten_conv(conv: Convolution) -> dict[str, int]:
    flat = {name: getattr(conv, name) for name in ("weights_address", "scale_bias_address",
                                                   "input_zero_point", "output_zero_point",
                                                   "act_min", "act_max", "scale_bias_record",
                                                   "input_scale", "output_scale")}
    flat.update(kernel_h=conv.kernel[0], kernel_w=conv.kernel[1], stride_h=conv.stride[0],
                stride_w=conv.stride[1], dilation_h=conv.dilation[0], dilation_w=conv.dilation[1],
                pad_top=conv.padding[0], pad_left=conv.padding[1], pad_bottom=conv.padding[2],
                pad_right=conv.padding[3], rounding=int(conv.rounding))
    return flat


def _unflatten_conv(flat: dict[str, int], ifm: FeatureMap, ofm: FeatureMap) -> Convolution:
    try:
        rounding = Rounding(flat["rounding"])
    except ValueError:
        raise StreamError(f"unknown rounding mode {flat['rounding']}") from None
    return Convolution(
        ifm=ifm, ofm=ofm, weights_address=flat["weights_address"],
        scale_bias_address=flat["scale_bias_address"],
        kernel=(flat["kernel_h"], flat["kernel_w"]), stride=(flat["stride_h"], flat["stride_w"]),
        dilation=(flat["dilation_h"], flat["dilation_w"]),
        padding=(flat["pad_top"], flat["pad_left"], flat["pad_bottom"], flat["pad_right"]),
        input_zero_point=flat["input_zero_point"], output_zero_point=flat["output_zero_point"],
        act_min=flat["act_min"], act_max=flat["act_max"], rounding=rounding,
        scale_bias_record=flat["scale_bias_record"], input_scale=flat["input_scale"],
        output_scale=flat["output_scale"])


FLAT_PAYLOADS = {Elementwise: (fb_elementwise, "Elementwise"), Reduction: (fb_reduction, "Reduction"),
                 Pooling: (fb_pooling, "Pooling"), TableLookup: (fb_lut, "TableLookup"),
                 Softmax: (fb_softmax, "Softmax"), Resize: (fb_resize, "Resize"), MatMul: (fb_matmul, "MatMul")}
"""Payloads whose dataclass fields map one to one onto schema tables (feature maps nested); the slot each
occupies in ``Command`` is the opcode table's."""


def _encode_fmap(builder, fmap: FeatureMap) -> int:
    return _add_table(builder, fb_fmap, "FeatureMap", {f: getattr(fmap, f) for f in _FMAP_FIELDS}, {})


def _encode_flat(builder, payload) -> int:
    module, prefix = FLAT_PAYLOADS[type(payload)]
    scalars, offsets = {}, {}
    for f in fields(payload):
        value = getattr(payload, f.name)
        if isinstance(value, FeatureMap):
            offsets[f.name] = _encode_fmap(builder, value)
        else:
            scalars[f.name] = value if isinstance(value, float) else int(value)
    return _add_table(builder, module, prefix, scalars, offsets)


def _decode_flat(table, cls):
    values = {}
    for f in fields(cls):
        raw = getattr(table, _camel(f.name))()
        if f.name.startswith("ifm") or f.name == "ofm":
            values[f.name] = _decode_fmap(raw, f.name)
        elif f.name == "rounding":
            values[f.name] = _enum(Rounding, raw, "rounding mode")
        else:
            values[f.name] = raw
    return cls(**values)


def _add_table(builder, module, prefix: str, scalars: dict[str, int | float], offsets: dict[str, int]):
    """Scalars are ints, or floats for the schema's float32 fields; offsets are the encoded sub-tables."""
    getattr(module, f"{prefix}Start")(builder)
    for name, value in {**scalars, **offsets}.items():
        getattr(module, f"{prefix}Add{_camel(name)}")(builder, value if isinstance(value, float) else int(value))
    return getattr(module, f"{prefix}End")(builder)


def _add_vector(builder, items: list[int]):
    builder.StartVector(4, len(items), 4)
    for offset in reversed(items):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _encode_payload(builder, payload) -> int:
    if isinstance(payload, DmaCopy):
        return _add_table(builder, fb_dma, "DmaCopy", {f: getattr(payload, f) for f in _DMA_FIELDS}, {})
    if isinstance(payload, Convolution):
        fmaps = {name: _encode_fmap(builder, getattr(payload, name)) for name in ("ifm", "ofm")}
        return _add_table(builder, fb_conv, "Convolution", _flatten_conv(payload), fmaps)
    return _encode_flat(builder, payload)


def _introduced(definition, version: tuple[int, int]) -> None:
    """Refuse an opcode a stream's format does not define (its readers would not know it)."""
    if definition.since is not None and tuple(version) < definition.since:
        raise StreamError(f"{definition.opcode.name} is not defined in format {version[0]}.{version[1]} "
                          f"(added in {definition.since[0]}.{definition.since[1]})")


def _encode_command(builder, command: Command, version: tuple[int, int]) -> int:
    definition = opcode_def(command.opcode)
    _introduced(definition, version)
    if not isinstance(command.payload, definition.payload):
        raise StreamError(f"{command.opcode.name} cannot carry {type(command.payload).__name__}")
    offsets = {"layer": builder.CreateString(command.layer),
               definition.slot: _encode_payload(builder, command.payload)}
    if command.deps is not None:
        offsets["deps"] = builder.CreateNumpyVector(np.asarray(command.deps, dtype=np.uint32))
    return _add_table(builder, fb_command, "Command", {"opcode": int(command.opcode)}, offsets)


def _encode_hardware(builder, config: NpuConfig) -> int:
    strings = {"name": builder.CreateString(config.name), "fingerprint": builder.CreateString(config.fingerprint)}
    values = config.values()
    values["accumulator_overflow"] = OVERFLOW_CODES[values["accumulator_overflow"]]  # WRAP, the default, is not written
    return _add_table(builder, fb_hardware, "HardwareConfig", values, strings)


def encode_stream(stream: CommandStream) -> bytes:
    """Serialize a stream in the format of its ``version``; the inverse of :func:`decode_stream`."""
    if tuple(stream.version) < OVERFLOW_SINCE and stream.config.accumulator_overflow != "wrap":
        raise StreamError(f"format {stream.version[0]}.{stream.version[1]} cannot carry accumulator_overflow "
                          f"{stream.config.accumulator_overflow!r} (added in {OVERFLOW_SINCE[0]}.{OVERFLOW_SINCE[1]}); "
                          f"its readers would wrap")
    late = _new_array_fields(stream.config) if tuple(stream.version) < ARRAY_FIELDS_SINCE else []
    if late:
        raise StreamError(f"format {stream.version[0]}.{stream.version[1]} cannot carry {', '.join(late)} (added in "
                          f"{ARRAY_FIELDS_SINCE[0]}.{ARRAY_FIELDS_SINCE[1]}); its readers would time another array")
    wide = _int16_feature_map(stream.commands) if tuple(stream.version) < DTYPE_SINCE else None
    if wide is not None:
        raise StreamError(f"format {stream.version[0]}.{stream.version[1]} cannot carry the INT16 feature map of "
                          f"{wide} (added in {DTYPE_SINCE[0]}.{DTYPE_SINCE[1]}); its readers would take it as INT8")
    if tuple(stream.version) < DEPS_SINCE and any(c.deps is not None for c in stream.commands):
        raise StreamError(f"format {stream.version[0]}.{stream.version[1]} cannot carry command dependencies "
                          f"(added in {DEPS_SINCE[0]}.{DEPS_SINCE[1]}); its readers would run the stream serially")
    packed = _packed_record(stream.commands, tuple(stream.version))
    if packed is not None:
        raise StreamError(f"format {stream.version[0]}.{stream.version[1]} cannot carry the scale/bias records of "
                          f"{packed} (9 bytes added in {RECORD_SINCE[0]}.{RECORD_SINCE[1]}, 8 in "
                          f"{SCALE_RECORD_SINCE[0]}.{SCALE_RECORD_SINCE[1]}); its readers would take them as 12-byte "
                          f"records")
    builder = flatbuffers.Builder(1024)
    buffer_offsets = []
    for buf in stream.buffers:
        offsets = {"name": builder.CreateString(buf.name), "dtype": builder.CreateString(buf.dtype),
                   "shape": builder.CreateNumpyVector(np.asarray(buf.shape, dtype=np.int32))}
        if buf.data:
            offsets["data"] = builder.CreateByteVector(buf.data)
        buffer_offsets.append(_add_table(builder, fb_buffer, "Buffer",
                                         {"kind": int(buf.kind), "size": buf.size}, offsets))
    command_offsets = [_encode_command(builder, c, stream.version) for c in stream.commands]
    tables = {"name": builder.CreateString(stream.name), "config": builder.CreateString(stream.config.name),
              "buffers": _add_vector(builder, buffer_offsets), "commands": _add_vector(builder, command_offsets)}
    if tuple(stream.version) >= (1, 3):  # older formats named a preset only
        tables["hardware"] = _encode_hardware(builder, stream.config)
    root = _add_table(builder, fb_stream, "CommandStream",
                      {"version_major": stream.version[0], "version_minor": stream.version[1]}, tables)
    builder.Finish(root, file_identifier=FILE_IDENTIFIER)
    payload = bytes(builder.Output())
    if stream.version[0] < 2:  # 1.x: the bare flatbuffer
        return payload
    header = _HEADER.pack(CONTAINER_MAGIC, stream.version[0], stream.version[1], len(payload))
    return header + hashlib.sha256(header + payload).digest() + payload


def _text(value) -> str:
    return value.decode("utf-8") if value is not None else ""


def _checked_length(length: int, element_size: int, total: int, what: str) -> int:
    if length * element_size > total:
        raise StreamError(f"{what} claims {length} elements, more than the stream's {total} bytes hold")
    return length


def _enum(enum_type, value, what: str):
    try:
        return enum_type(value)
    except ValueError:
        raise StreamError(f"unknown {what} {value}") from None


def _decode_fmap(table, what: str) -> FeatureMap:
    if table is None:
        raise StreamError(f"command has no {what} feature map")
    values = {f: getattr(table, _camel(f))() for f in _FMAP_FIELDS}
    values["dtype"] = _enum(ActivationType, values["dtype"], f"{what} activation type")
    return FeatureMap(**values)


def _decode_payload(raw, payload_type: type):
    if payload_type is DmaCopy:
        fields = {f: getattr(raw, _camel(f))() for f in _DMA_FIELDS}
        fields["src_space"] = _enum(MemorySpace, fields["src_space"], "memory space")
        fields["dst_space"] = _enum(MemorySpace, fields["dst_space"], "memory space")
        return DmaCopy(**fields)
    if payload_type is Convolution:
        flat = {f: getattr(raw, _camel(f))() for f in _CONV_FIELDS}
        return _unflatten_conv(flat, _decode_fmap(raw.Ifm(), "ifm"), _decode_fmap(raw.Ofm(), "ofm"))
    return _decode_flat(raw, payload_type)


def _decode_command(raw, index: int, version: tuple[int, int], total: int) -> Command:
    opcode = _enum(Opcode, raw.Opcode(), "opcode")
    definition = opcode_def(opcode)
    try:
        _introduced(definition, version)
    except StreamError as exc:
        raise StreamError(f"command {index}: {exc}") from None
    table = getattr(raw, _camel(definition.slot))()
    if table is None:
        raise StreamError(f"command {index}: {opcode.name} has no {definition.slot} payload")
    deps = None
    if not raw.DepsIsNone():
        if version < DEPS_SINCE:
            raise StreamError(f"command {index}: dependencies are not defined in format {version[0]}.{version[1]}")
        _checked_length(raw.DepsLength(), 4, total, f"command {index}'s dependency list")
        deps = tuple(int(d) for d in raw.DepsAsNumpy())
    return Command(opcode, _decode_payload(table, definition.payload), _text(raw.Layer()), deps)


def _decode_hardware(root, version: tuple[int, int]) -> NpuConfig:
    """The configuration a stream carries (1.3), or the preset an older stream names; before 2.1 the
    accumulators wrap (the field is absent and reads as WRAP)."""
    raw = root.Hardware()
    if raw is None:
        if version >= (1, 3):
            raise StreamError("stream carries no hardware configuration")
        return get_config(_text(root.Config()))
    values = {name: getattr(raw, _camel(name))() for name in NpuConfig.__dataclass_fields__ if name != "name"}
    modes = {code: mode for mode, code in OVERFLOW_CODES.items()}
    code = values["accumulator_overflow"]
    if code not in modes or (version < OVERFLOW_SINCE and modes[code] != "wrap"):
        raise StreamError(f"accumulator overflow {code} is not defined in format {version[0]}.{version[1]}")
    values["accumulator_overflow"] = modes[code]
    try:
        config = NpuConfig(name=_text(raw.Name()), **values)
    except ConfigError as exc:
        raise StreamError(f"invalid hardware configuration in stream: {exc}") from None
    late = _new_array_fields(config) if version < ARRAY_FIELDS_SINCE else []
    if late:
        raise StreamError(f"{', '.join(late)} is not defined in format {version[0]}.{version[1]}")
    if _text(raw.Fingerprint()) != config.fingerprint:
        raise StreamError(f"hardware fingerprint {_text(raw.Fingerprint())!r} does not match the configuration's "
                          f"numbers ({config.fingerprint!r}): the stream is corrupt")
    return config


def _decode_buffer(raw, total: int) -> Buffer:
    shape_len = _checked_length(raw.ShapeLength(), 4, total, "buffer shape")
    data_len = _checked_length(raw.DataLength(), 1, total, "buffer data")
    data = raw.DataAsNumpy().tobytes() if data_len else b""
    shape = tuple(int(v) for v in raw.ShapeAsNumpy()) if shape_len else ()
    return Buffer(name=_text(raw.Name()), kind=_enum(BufferKind, raw.Kind(), "buffer kind"),
                  size=raw.Size(), dtype=_text(raw.Dtype()), shape=shape, data=data)


def _check_major(major: int, minor: int) -> None:
    if major not in READABLE_MAJORS:
        newer = "newer than" if major > max(READABLE_MAJORS) else "older than"
        raise StreamError(f"stream format {major}.{minor} is {newer} this simulator reads "
                          f"({', '.join(f'{m}.x' for m in READABLE_MAJORS)}); use the npu_backend that wrote it")


def _payload(data: bytes) -> tuple[bytes, tuple[int, int] | None]:
    """The flatbuffer inside a 2.x container (checked whole), or a bare 1.x flatbuffer; and the header's version."""
    if data[:4] == CONTAINER_MAGIC:
        if len(data) < HEADER_BYTES:
            raise StreamError(f"truncated command stream: {len(data)} bytes, the header alone is {HEADER_BYTES}")
        _, major, minor, length = _HEADER.unpack_from(data)
        _check_major(major, minor)
        if len(data) != HEADER_BYTES + length:
            raise StreamError(f"command stream holds {len(data) - HEADER_BYTES} payload bytes, its header says "
                              f"{length}: truncated or extended")
        if hashlib.sha256(data[:_HEADER.size] + data[HEADER_BYTES:]).digest() != data[_HEADER.size:HEADER_BYTES]:
            raise StreamError("command stream checksum mismatch: the file is corrupt")
        return data[HEADER_BYTES:], (major, minor)
    if len(data) >= 8 and data[4:8] == FILE_IDENTIFIER:
        return data, None
    raise StreamError("not a command stream: neither the 'NPUS' header nor a bare 'NPUC' flatbuffer")


def decode_stream(data: bytes) -> CommandStream:
    """Parse bytes into a :class:`CommandStream`, raising ``StreamError`` on any defect.

    Only the format is checked here; :func:`simulator.validate.validate_stream`
    checks that the program is consistent with a hardware configuration.
    """
    data = bytes(data)
    if len(data) < 8:
        raise StreamError(f"not a command stream: {len(data)} bytes is too short")
    payload, header_version = _payload(data)
    try:
        root = fb_stream.CommandStream.GetRootAs(payload, 0)
        version = (root.VersionMajor(), root.VersionMinor())
        _check_major(*version)
        if header_version is not None and version != header_version:
            raise StreamError(f"header says format {header_version[0]}.{header_version[1]}, the payload "
                              f"{version[0]}.{version[1]}")
        if header_version is None and version[0] >= 2:
            raise StreamError(f"a format {version[0]}.{version[1]} stream must carry its header and checksum")
        total = len(payload)
        n_buffers = _checked_length(root.BuffersLength(), 4, total, "buffer list")
        n_commands = _checked_length(root.CommandsLength(), 4, total, "command list")
        buffers = tuple(_decode_buffer(root.Buffers(i), total) for i in range(n_buffers))
        commands = tuple(_decode_command(root.Commands(i), i, version, total) for i in range(n_commands))
        wide = _int16_feature_map(commands) if version < DTYPE_SINCE else None
        if wide is not None:
            raise StreamError(f"{wide}: activation type INT16 is not defined in format {version[0]}.{version[1]}")
        packed = _packed_record(commands, version)
        if packed is not None:
            raise StreamError(f"{packed}: its scale/bias records are not defined in format {version[0]}.{version[1]}")
        return CommandStream(name=_text(root.Name()), config=_decode_hardware(root, version), buffers=buffers,
                             commands=commands, version=version)
    except StreamError:
        raise
    except ConfigError as exc:
        raise StreamError(f"stream names hardware this simulator does not know: {exc}") from None
    except (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        raise StreamError(f"corrupt command stream: {type(exc).__name__}: {exc}") from None


__all__ = ["encode_stream", "decode_stream", "FILE_IDENTIFIER", "CONTAINER_MAGIC", "HEADER_BYTES"]
