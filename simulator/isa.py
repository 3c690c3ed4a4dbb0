"""The instruction set: opcodes and the decoded form of every command.

Decoded commands are frozen dataclasses so that the compiler builds them, the
encoder/decoder round-trip them and the kernels and cycle model read them
without ever touching flatbuffers objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum

import numpy as np

from .config import NpuConfig, get_config
from .errors import StreamError
from .numerics import Rounding, float_scales

FORMAT_VERSION = (2, 6)
"""(major, minor) of the command-stream format; a reader accepts the majors in ``READABLE_MAJORS``.

1.1 added SUB, MUL and SOFTMAX (new opcodes, the Softmax table, Command.softmax).
1.2 added ``Rounding.ONNXRUNTIME`` and the float32 scales it needs, appended to
Elementwise, Reduction and Pooling (plus Pooling's rounding and zero points);
their defaults (0) keep 1.0 and 1.1 streams meaning what they meant.
1.3 added ``CommandStream.hardware``: the configuration's numbers and fingerprint.
Older streams name only a preset, which the reader looks up.
2.0 wraps the flatbuffer in a header holding the version, the payload's length and a
SHA-256 over header and payload (:mod:`simulator.stream`); 1.x files are bare flatbuffers.
2.1 added ``HardwareConfig.accumulator_overflow`` (``NpuConfig.accumulator_overflow``); a stream
without it, as every older one, means ``"wrap"``, what the accumulators always did. Older formats
cannot carry ``"saturate"``: the encoder refuses rather than write a stream that would run wrapped.
2.2 added RESIZE_BILINEAR (the Resize table, ``Command.resize``) and BATCH_MATMUL (the MatMul table,
``Command.matmul``); an opcode's record names the format that introduced it
(:attr:`simulator.opcodes.OpcodeDef.since`): the encoder refuses to write it in an older format and the
decoder refuses a stream of an older format that uses it.
2.3 added ``FeatureMap.dtype`` (:class:`ActivationType`): INT16 feature maps for the 16x8 CONV2D
(TFLite's 16x8 mode). Absent, as in every older stream, it reads INT8; the encoder refuses to write an
INT16 feature map in an older format and the decoder refuses one in a stream that claims an older format.
2.4 added ``Command.deps``: the earlier commands a command waits for, so that the DMA engine and the
compute units overlap (:mod:`simulator.timeline`). Absent, as in every older stream, a command waits for
the previous one: the stream runs serially, as it always did. The encoder refuses to write explicit
dependencies in an older format. 2.4 also added the MAC array's dataflow to ``HardwareConfig``
(``NpuConfig.fold_fill_cycles``, ``parallel_depthwise``); absent, they mean their defaults, and an older
format cannot carry other values.
2.5 added ``Convolution.scale_bias_record``: the bytes of each output channel's scale/bias record, 12 (three
int32 words, what every older stream holds and what absent means) or 9 (int32 bias, int32 multiplier, int8
shift, packed; TFLite's roundings only), which moves a quarter fewer bytes. The encoder refuses a 9-byte
record in an older format.
2.6 added the 8-byte record for the float64-scale roundings (int32 bias, float32 weight scale) and the two
float32 scales it needs, ``Convolution.input_scale`` and ``output_scale``: the output stage forms the float64
scale from the three as TFLite does, so a per-channel classifier moves a third fewer record bytes. Absent, as
in every older stream, they are 0 and unused. The encoder refuses an 8-byte record in an older format."""

READABLE_MAJORS = (1, 2)

DTYPE_SINCE = (2, 3)
"""The format that added ``FeatureMap.dtype``."""

DEPS_SINCE = (2, 4)
"""The format that added ``Command.deps``."""

RECORD_SINCE = (2, 5)
"""The format that added ``Convolution.scale_bias_record``."""

SCALE_RECORD_SINCE = (2, 6)
"""The format that added the 8-byte record and ``Convolution.input_scale``/``output_scale``."""

SCALE_BIAS_WORDS = 3
"""Words per output channel of a decoded scale/bias table (:func:`scale_bias_words`): bias, multiplier, shift."""

WORD_RECORD = SCALE_BIAS_WORDS * 4
"""Bytes of the scale/bias record every format reads: three int32 words (what a stream before 2.5 holds)."""


class ActivationType(IntEnum):
    """Element type of a feature map; values are the stream's ``ActivationType`` (format 2.3)."""

    INT8 = 0
    INT16 = 1

    def __repr__(self) -> str:  # as `npu inspect` lists feature maps: dtype=INT16
        return self.name


@dataclass(frozen=True)
class ActivationFormat:
    """What the MAC array and output stage do with one element type: one record per :class:`ActivationType`."""

    dtype: np.dtype
    accumulator_bits: int | None
    """Width of a MAC-array accumulator fed by this type; ``None``: the configuration's ``accumulator_bits``.
    16x8 has 48 bits, [-2**47, 2**47): the domain TFLite's int64 ``MultiplyByQuantizedMultiplier`` (its output
    stage) asserts, so the NPU equals TFLite's int64 accumulator wherever TFLite's kernel is defined."""
    mac_passes: int
    """Passes the array's 8 x 8-bit multipliers make per product: an int16 activation is two bytes, so 16x8
    runs at half the int8 rate (as Ethos-U's 16-bit mode); a cycle-model fact."""


ACTIVATION_FORMATS = {
    ActivationType.INT8: ActivationFormat(np.dtype(np.int8), None, 1),
    ActivationType.INT16: ActivationFormat(np.dtype(np.int16), 48, 2),
}


class Opcode(IntEnum):
    """Values are those of ``npu_stream.Opcode`` in command_stream.fbs."""

    DMA_COPY = 0
    CONV2D = 1
    DEPTHWISE_CONV2D = 2
    FULLY_CONNECTED = 3
    ADD = 4
    MEAN = 5
    MAX_POOL2D = 6
    AVG_POOL2D = 7
    LUT = 8
    SUB = 9
    MUL = 10
    SOFTMAX = 11
    RESIZE_BILINEAR = 12
    BATCH_MATMUL = 13


class BufferKind(IntEnum):
    INPUT = 0
    OUTPUT = 1
    CONSTANT = 2
    SCRATCH = 3


class MemorySpace(IntEnum):
    DRAM = 0
    SRAM = 1


@dataclass(frozen=True)
class Buffer:
    """A DRAM region; CONSTANT buffers carry their bytes, the others only a size."""

    name: str
    kind: BufferKind
    size: int
    dtype: str = "int8"
    shape: tuple[int, ...] = ()
    data: bytes = b""


@dataclass(frozen=True)
class DmaCopy:
    """2-D copy of ``rows`` x ``row_bytes`` between DRAM buffers and SRAM."""

    src_space: MemorySpace
    src_buffer: int
    src_offset: int
    dst_space: MemorySpace
    dst_buffer: int
    dst_offset: int
    row_bytes: int
    rows: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.row_bytes * self.rows


@dataclass(frozen=True)
class FeatureMap:
    """NHWC tile (batch 1) at an SRAM address; int8 elements, or int16 for the 16x8 CONV2D (format 2.3)."""

    address: int
    height: int
    width: int
    channels: int
    dtype: ActivationType = ActivationType.INT8

    @property
    def size(self) -> int:
        """Elements (bytes for INT8; see :attr:`nbytes`)."""
        return self.height * self.width * self.channels

    @property
    def nbytes(self) -> int:
        """SRAM bytes the tile occupies."""
        return self.size * ACTIVATION_FORMATS[self.dtype].dtype.itemsize

    @property
    def numpy_dtype(self) -> np.dtype:
        return ACTIVATION_FORMATS[self.dtype].dtype


@dataclass(frozen=True)
class Convolution:
    """Operands of a MAC-array operation; see command_stream.fbs for layouts."""

    ifm: FeatureMap
    ofm: FeatureMap
    weights_address: int
    scale_bias_address: int
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(top, left, bottom, right) in input pixels, filled with the input zero point."""
    input_zero_point: int = 0
    output_zero_point: int = 0
    act_min: int = -128
    act_max: int = 127
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    scale_bias_record: int = WORD_RECORD
    """Bytes of each output channel's scale/bias record (:data:`SCALE_BIAS_RECORDS`, format 2.5)."""
    input_scale: float = 0.0
    output_scale: float = 0.0
    """The float32 scales the 8-byte record's float64 scale is formed with (format 2.6; 0 with other records)."""

    def __post_init__(self):
        _as_float32(self, ("input_scale", "output_scale"))


def _as_float32(payload, names: tuple[str, ...]) -> None:
    """Hold scale fields as the float32 values the stream stores, so a decoded payload equals its original."""
    with np.errstate(over="ignore"):
        for name in names:
            object.__setattr__(payload, name, float(np.float32(getattr(payload, name))))


@dataclass(frozen=True)
class Elementwise:
    """Operands of an int8 ADD, SUB or MUL; see command_stream.fbs.

    TFLite roundings: ADD and SUB use every fixed-point field; MUL multiplies
    the centred inputs and requantizes with the output multiplier alone (the
    input multipliers, shifts and ``left_shift`` must be 0); the scales are 0.
    ``Rounding.ONNXRUNTIME``: the float32 scales replace every fixed-point field (all 0).
    """

    ifm: FeatureMap
    ifm2: FeatureMap
    ofm: FeatureMap
    input_zero_point: int
    input2_zero_point: int
    output_zero_point: int
    input_multiplier: int
    input_shift: int
    input2_multiplier: int
    input2_shift: int
    output_multiplier: int
    output_shift: int
    left_shift: int
    act_min: int = -128
    act_max: int = 127
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    input_scale: float = 0.0
    input2_scale: float = 0.0
    output_scale: float = 0.0

    def __post_init__(self):
        _as_float32(self, ("input_scale", "input2_scale", "output_scale"))


@dataclass(frozen=True)
class Reduction:
    """Operands of a spatial MEAN; see command_stream.fbs.

    TFLite roundings: multiplier and shift (1 / count folded in), scales 0.
    ``Rounding.ONNXRUNTIME``: the float32 scales, multiplier and shift 0.
    """

    ifm: FeatureMap
    ofm: FeatureMap
    input_zero_point: int
    output_zero_point: int
    multiplier: int
    shift: int
    act_min: int = -128
    act_max: int = 127
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    input_scale: float = 0.0
    output_scale: float = 0.0

    def __post_init__(self):
        _as_float32(self, ("input_scale", "output_scale"))


@dataclass(frozen=True)
class Pooling:
    """Operands of MAX_POOL2D / AVG_POOL2D; padding (top, left, bottom, right) is never counted.

    The qparams are used only by AVG_POOL2D with ``Rounding.ONNXRUNTIME``
    (onnxruntime's float32 average, requantized); otherwise they are 0.
    """

    ifm: FeatureMap
    ofm: FeatureMap
    kernel_h: int
    kernel_w: int
    stride_h: int
    stride_w: int
    pad_top: int
    pad_left: int
    pad_bottom: int
    pad_right: int
    act_min: int = -128
    act_max: int = 127
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    input_scale: float = 0.0
    input_zero_point: int = 0
    output_scale: float = 0.0
    output_zero_point: int = 0

    def __post_init__(self):
        _as_float32(self, ("input_scale", "output_scale"))


@dataclass(frozen=True)
class TableLookup:
    """Operands of LUT: an int8 table of ``NpuConfig.lut_entries`` entries indexed by the int8 input."""

    ifm: FeatureMap
    ofm: FeatureMap
    table_address: int


@dataclass(frozen=True)
class Softmax:
    """Softmax over the channels of every pixel (TFLite int8 SOFTMAX, reference kernel)."""

    ifm: FeatureMap
    ofm: FeatureMap
    input_multiplier: int
    input_left_shift: int
    diff_min: int
    output_zero_point: int = -128   # TFLite int8 softmax output is fixed at scale 1/256, zp -128


@dataclass(frozen=True)
class Resize:
    """Operands of RESIZE_BILINEAR (pooling unit): TFLite's integer bilinear interpolation of an NHWC tile.

    Output row ``j`` samples the input at ``offset_h + j * step_h`` in 1/1024 input pixels, relative to the
    tile's first input row (columns likewise); :mod:`simulator.resize` defines the arithmetic. The offsets
    let a tile of rows start anywhere in the image with TFLite's global positions.
    """

    ifm: FeatureMap
    ofm: FeatureMap
    step_h: int
    step_w: int
    offset_h: int
    offset_w: int
    rounding: Rounding = Rounding.TFLITE_DOUBLE


@dataclass(frozen=True)
class MatMul:
    """Operands of BATCH_MATMUL (MAC array): the product of two int8 activations, requantized per tensor.

    Feature maps hold [batch, rows, columns] as height x width x channels: ``ifm`` [B, M, K], ``ifm2``
    [B, K, N] ([B, N, K] with ``adj_y``, TFLite's flag: read transposed), ``ofm`` [B, M, N].
    """

    ifm: FeatureMap
    ifm2: FeatureMap
    ofm: FeatureMap
    input_zero_point: int
    input2_zero_point: int
    output_zero_point: int
    output_multiplier: int
    output_shift: int
    act_min: int = -128
    act_max: int = 127
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    adj_y: bool = False


DOUBLE_SCALE_ROUNDINGS = (Rounding.FLOAT64, Rounding.ONNXRUNTIME)
"""Modes whose scale/bias table holds a float64 scale per channel instead of (multiplier, shift)."""

PACKED_RECORD = np.dtype([("bias", "<i4"), ("multiplier", "<i4"), ("shift", "i1")])
"""The 9-byte record (format 2.5): what TFLite's fixed-point output stage needs per channel, unpadded. Ethos-U
packs its scale/bias records likewise (10 bytes: a 40-bit bias, a 32-bit scale, a 6-bit shift)."""

SCALE_RECORD = np.dtype([("bias", "<i4"), ("weight_scale", "<f4")])
"""The 8-byte record (format 2.6) of the float64-scale roundings: the float64 scale is
``double(input_scale) * double(weight_scale) / double(output_scale)`` (:func:`simulator.numerics.float_scales`),
so the float32 weight scale is all a channel needs; the command carries the other two."""

SCALE_BIAS_RECORDS = {WORD_RECORD: "three int32 words",
                      PACKED_RECORD.itemsize: "int32 bias, int32 multiplier, int8 shift",
                      SCALE_RECORD.itemsize: "int32 bias, float32 weight scale"}
"""Bytes per output channel a scale/bias record may take -> its layout (command_stream.fbs)."""


def scale_bias_record(rounding: Rounding) -> int:
    """The record the codegen writes for ``rounding``: packed where the shift fits a byte, bias and weight scale
    where the output stage forms a float64 scale."""
    return SCALE_RECORD.itemsize if rounding in DOUBLE_SCALE_ROUNDINGS else PACKED_RECORD.itemsize


def scale_bias_bytes(conv: Convolution) -> int:
    """Bytes of the command's scale/bias table in SRAM."""
    return conv.ofm.channels * conv.scale_bias_record


def scale_bias_words(raw: np.ndarray, conv: Convolution) -> np.ndarray:
    """The ``[OC, SCALE_BIAS_WORDS]`` int32 words of a table's bytes (``raw``: uint8, :func:`scale_bias_bytes`
    of them), whatever its record: a view for 12-byte records, a new array for the others (an 8-byte record's
    last two words are the bits of the float64 scale the output stage forms, as a 12-byte record holds it)."""
    if conv.scale_bias_record == WORD_RECORD:
        return raw.view("<i4").reshape(conv.ofm.channels, SCALE_BIAS_WORDS)
    if conv.scale_bias_record == SCALE_RECORD.itemsize:
        records = raw.view(SCALE_RECORD)
        scales = float_scales(conv.input_scale, records["weight_scale"], conv.output_scale).view("<i4")
        return np.stack([records["bias"], scales[0::2], scales[1::2]], axis=1)
    records = raw.view(PACKED_RECORD)
    return np.stack([records["bias"], records["multiplier"], records["shift"].astype(np.int32)], axis=1)


def pack_scale_bias(words: np.ndarray, record: int) -> bytes:
    """The table's bytes in ``record``-byte records from its ``[OC, SCALE_BIAS_WORDS]`` int32 words."""
    words = np.asarray(words, dtype="<i4")
    if record == WORD_RECORD:
        return words.tobytes()
    if np.any(words[:, 2] < -128) or np.any(words[:, 2] > 127):
        raise StreamError("a shift does not fit the packed record's byte")
    records = np.empty(len(words), PACKED_RECORD)
    records["bias"], records["multiplier"], records["shift"] = words[:, 0], words[:, 1], words[:, 2]
    return records.tobytes()


def pack_scale_records(bias: np.ndarray, weight_scales: np.ndarray) -> bytes:
    """The table's bytes in 8-byte records (:data:`SCALE_RECORD`) from the per-channel bias and float32 weight
    scales."""
    records = np.empty(len(bias), SCALE_RECORD)
    records["bias"], records["weight_scale"] = bias, np.broadcast_to(np.float32(weight_scales), len(bias))
    return records.tobytes()


def feature_maps(payload) -> list[tuple[str, FeatureMap]]:
    """(field name, feature map) of every feature map a payload holds (none for DMA)."""
    return [(f.name, value) for f in fields(payload) if isinstance(value := getattr(payload, f.name), FeatureMap)]


@dataclass(frozen=True)
class Command:
    opcode: Opcode
    payload: DmaCopy | Convolution | Elementwise | Reduction | Pooling | TableLookup | Softmax | Resize | MatMul
    layer: str = ""
    deps: tuple[int, ...] | None = None
    """Indices of earlier commands this one waits for, besides the previous command of its own engine
    (format 2.4); ``None``: it waits for the previous command of the stream, whatever its engine (serial,
    what every older stream means). The validator rejects dependencies that miss an SRAM hazard
    (:mod:`simulator.hazards`)."""


@dataclass(frozen=True)
class CommandStream:
    """A whole program: what DRAM holds and the commands to run, in order."""

    name: str
    config: NpuConfig
    """The hardware it was compiled for (a preset name is accepted and looked up)."""
    buffers: tuple[Buffer, ...]
    commands: tuple[Command, ...]
    version: tuple[int, int] = field(default=FORMAT_VERSION)

    def __post_init__(self):
        if isinstance(self.config, str):
            object.__setattr__(self, "config", get_config(self.config))

    def buffers_of(self, kind: BufferKind) -> list[tuple[int, Buffer]]:
        return [(i, b) for i, b in enumerate(self.buffers) if b.kind == kind]


WEIGHT_LAYOUTS = {
    Opcode.CONV2D: lambda kh, kw, oc, ic: (oc, kh, kw, ic),
    Opcode.DEPTHWISE_CONV2D: lambda kh, kw, oc, ic: (oc, kh, kw),
    Opcode.FULLY_CONNECTED: lambda kh, kw, oc, ic: (oc, ic),
}
"""SRAM weight layout of each MAC-array opcode (command_stream.fbs); one definition for validator and kernels."""


def weight_shape(opcode: Opcode, conv: Convolution) -> tuple[int, ...]:
    try:
        layout = WEIGHT_LAYOUTS[opcode]
    except KeyError:
        raise StreamError(f"{opcode.name} is not a MAC-array opcode and has no weights") from None
    return layout(*conv.kernel, conv.ofm.channels, conv.ifm.channels)


def conv_output_size(size: int, kernel: int, stride: int, dilation: int, pad_before: int,
                     pad_after: int) -> int:
    """Output extent of a padded, strided, dilated window (0 when the window does not fit)."""
    span = dilation * (kernel - 1) + 1
    return max(0, (size + pad_before + pad_after - span) // stride + 1)
