"""Command-stream format: round trip, decoded fields, and rejection of malformed bytes."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from layer_streams import layer_stream, random_params
from npu_backend.params import NpuOp
from simulator import (FORMAT_VERSION, BufferKind, CommandStream, DmaCopy, MemorySpace, Opcode,
                       StreamError, decode_stream, encode_stream, get_config, run_stream, validate_stream)

CONFIG = get_config("npu-256")


@pytest.fixture(scope="module")
def conv_stream() -> CommandStream:
    p = random_params(np.random.default_rng(3), NpuOp.CONV2D, (1, 8, 8, 4), out_channels=6, strides=(2, 2),
                      padding=(0, 0, 1, 1), clamp=(-100, 127))
    return layer_stream(p, CONFIG)


def test_round_trip_preserves_every_field(conv_stream):
    decoded = decode_stream(encode_stream(conv_stream))
    assert decoded == conv_stream
    conv = next(c for c in decoded.commands if c.opcode == Opcode.CONV2D).payload
    assert (conv.kernel, conv.stride, conv.padding) == ((3, 3), (2, 2), (0, 0, 1, 1))
    assert (conv.ifm.height, conv.ifm.width, conv.ifm.channels) == (8, 8, 4)
    assert (conv.ofm.height, conv.ofm.width, conv.ofm.channels) == (4, 4, 6)
    assert (conv.act_min, conv.act_max) == (-100, 127)
    assert decoded.version == FORMAT_VERSION
    kinds = [b.kind for b in decoded.buffers]
    assert kinds == [BufferKind.INPUT, BufferKind.OUTPUT, BufferKind.CONSTANT, BufferKind.CONSTANT]


def _corrupt(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[:5], "too short"),
    (lambda d: _corrupt(d, 0, b"XXXX"), "neither the 'NPUS' header nor a bare 'NPUC' flatbuffer"),
    (lambda d: d[:30], "truncated command stream: 30 bytes, the header alone is 44"),
    (lambda d: d[:len(d) // 3], "truncated or extended"),
    (lambda d: d + b"\0", "truncated or extended"),
    (lambda d: _corrupt(d, len(d) - 7, bytes([d[-7] ^ 1])), "checksum mismatch"),
    (lambda d: _corrupt(d, 20, bytes([d[20] ^ 0x80])), "checksum mismatch"),   # the digest itself
    (lambda d: _corrupt(d, 6, b"\x07\x00"), "checksum mismatch"),              # the minor version
    (lambda d: b"\x00" * 4 + b"NPUC" + b"\xff" * 64, "older than this simulator reads"),
])
def test_malformed_bytes_raise_stream_error(conv_stream, mutate, message):
    with pytest.raises(StreamError, match=message):
        decode_stream(mutate(encode_stream(conv_stream)))


def test_every_single_byte_flip_is_caught_by_the_checksum(conv_stream):
    """A checksum covers header and payload: no corrupted byte reaches the parser."""
    data = encode_stream(conv_stream)
    for offset in range(0, len(data), max(1, len(data) // 997)):
        with pytest.raises(StreamError):
            decode_stream(_corrupt(data, offset, bytes([data[offset] ^ 0x10])))


def test_other_major_versions_are_named(conv_stream):
    newer = dataclasses.replace(conv_stream, version=(FORMAT_VERSION[0] + 1, 0))
    with pytest.raises(StreamError, match=r"stream format 3.0 is newer than this simulator reads \(1.x, 2.x\)"):
        decode_stream(encode_stream(newer))
    older = dataclasses.replace(conv_stream, version=(0, 9))
    with pytest.raises(StreamError, match="stream format 0.9 is older than this simulator reads"):
        decode_stream(encode_stream(older))


def test_a_1_x_stream_is_still_read(conv_stream):
    """1.x files are bare flatbuffers, without the header; a 2.x payload without its header is refused."""
    from simulator.stream import HEADER_BYTES

    legacy = dataclasses.replace(conv_stream, version=(1, 3))
    data = encode_stream(legacy)
    assert data[4:8] == b"NPUC" and decode_stream(data) == legacy
    with pytest.raises(StreamError, match=r"a format 2\.\d+ stream must carry its header and checksum"):
        decode_stream(encode_stream(conv_stream)[HEADER_BYTES:])


def _with_command(stream, index, **changes):
    commands = list(stream.commands)
    commands[index] = dataclasses.replace(commands[index], payload=dataclasses.replace(commands[index].payload, **changes))
    return dataclasses.replace(stream, commands=tuple(commands))


def _conv_index(stream):
    return next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.CONV2D)


@pytest.mark.parametrize("changes, message", [
    (dict(row_bytes=10**6), "past|ends at byte"),
    (dict(src_buffer=99), "does not exist"),
    (dict(dst_space=MemorySpace.DRAM), "between DRAM and SRAM"),
])
def test_validation_rejects_bad_dma(conv_stream, changes, message):
    with pytest.raises(StreamError, match=message):
        validate_stream(_with_command(conv_stream, 0, **changes), CONFIG)


@pytest.mark.parametrize("changes, message", [
    (dict(stride=(4, 4)), "stride"),
    (dict(kernel=(9, 9)), "kernel"),
    (dict(act_min=50, act_max=10), "act_min"),
    (dict(padding=(2, 2, 2, 2)), "window arithmetic"),
    (dict(weights_address=CONFIG.sram_bytes - 8), "past"),
    (dict(input_zero_point=300), "outside int8"),
])
def test_validation_rejects_bad_convolution(conv_stream, changes, message):
    with pytest.raises(StreamError, match=message):
        validate_stream(_with_command(conv_stream, _conv_index(conv_stream), **changes), CONFIG)


def test_stream_runs_only_on_its_preset(conv_stream):
    with pytest.raises(StreamError, match=r"compiled for other hardware \('npu-256', simulator 'npu-1024'\): "
                                          "mac_rows: 16 != 32"):
        validate_stream(conv_stream, get_config("npu-1024"))


def test_writes_into_constants_are_refused(conv_stream):
    bad = DmaCopy(MemorySpace.SRAM, -1, 0, MemorySpace.DRAM, 2, 0, 4)
    stream = dataclasses.replace(conv_stream, commands=(conv_stream.commands[0].__class__(Opcode.DMA_COPY, bad),))
    with pytest.raises(StreamError, match="writes into CONSTANT"):
        validate_stream(stream, CONFIG)


def test_statistics_add_up(conv_stream):
    x = np.zeros((1, 8, 8, 4), np.int8)
    _, stats = run_stream(encode_stream(conv_stream), {"ifm": x})
    assert stats.total_cycles == sum(c.cycles for c in stats.commands) > 0
    assert stats.total_dram_bytes == sum(c.dram_read_bytes + c.dram_write_bytes for c in stats.commands)
    moved = [c.payload.bytes_moved for c in conv_stream.commands if c.opcode == Opcode.DMA_COPY]
    assert stats.total_dram_bytes == sum(moved)
    assert stats.total_macs == 4 * 4 * 6 * 3 * 3 * 4


def test_simulator_does_not_import_tvm():
    code = "import sys, simulator; assert 'tvm' not in sys.modules, 'tvm imported'; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_opcode_table_is_complete():
    """Every opcode has a schema value, a payload in its schema slot, a validator, a kernel and a cost; every
    NPU operator a definition whose opcodes exist."""
    from simulator._generated.Command import Command as GeneratedCommand
    from simulator._generated.Opcode import Opcode as Generated
    from simulator.opcodes import OPCODES
    from npu_backend.ops import OPS
    from npu_backend.params import NpuOp

    generated = {name: value for name, value in vars(Generated).items() if not name.startswith("_")}
    assert generated == {op.name: op.value for op in Opcode}
    assert set(OPCODES) == set(Opcode)
    for op, definition in OPCODES.items():
        assert definition.opcode == op
        assert hasattr(GeneratedCommand, "".join(w.capitalize() for w in definition.slot.split("_")))
        assert all(callable(f) for f in (definition.validate, definition.execute, definition.cost))
    assert sorted(d.op.name for d in OPS) == sorted(op.name for op in NpuOp)
    for definition in OPS:
        assert definition.idioms and set(definition.opcodes) <= set(OPCODES), definition.op
        assert all(callable(f) for f in (definition.plan, definition.prepare, definition.lower, *definition.rules))


def test_an_opcode_without_a_definition_is_a_stream_error(conv_stream, monkeypatch):
    """Nothing falls back to a default payload or kernel: an opcode the table lacks is refused by name."""
    from simulator import opcodes

    data = encode_stream(conv_stream)
    monkeypatch.delitem(opcodes.OPCODES, Opcode.CONV2D)
    with pytest.raises(StreamError, match="opcode CONV2D has no definition"):
        decode_stream(data)
    with pytest.raises(StreamError, match="opcode CONV2D has no definition"):
        validate_stream(conv_stream, conv_stream.config)


def test_mutated_streams_fail_only_with_stream_errors(conv_stream):
    """Random byte flips and truncations: decode, validate and run raise NpuError or succeed. The 1.x format
    has no checksum, so its mutants reach the parser, the validator and the kernels."""
    import random

    legacy = dataclasses.replace(conv_stream, version=(1, 3))
    mutate_and_run(encode_stream(legacy), random.Random(1234), count=400, max_flips=6, truncate=0.2)


def mutate_and_run(data: bytes, rng, count: int, max_flips: int, truncate: float = 0.0) -> None:
    """Flip up to ``max_flips`` random bytes (and truncate a share of the mutants); each mutant must decode,
    validate and run, or fail with NpuError: never any other exception."""
    from simulator import NpuError

    for _ in range(count):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, max_flips)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if rng.random() < truncate:
            mutated = mutated[:rng.randrange(len(mutated))]
        try:
            stream = decode_stream(bytes(mutated))
            validate_stream(stream, stream.config)
            run_stream(stream, {b.name: np.zeros(b.shape, b.dtype) for _, b in stream.buffers_of(BufferKind.INPUT)})
        except NpuError:
            pass


def test_stream_larger_than_dram_is_refused(conv_stream):
    huge = dataclasses.replace(conv_stream.buffers[1], size=CONFIG.dram_bytes)
    stream = dataclasses.replace(conv_stream, buffers=(conv_stream.buffers[0], huge, *conv_stream.buffers[2:]))
    with pytest.raises(StreamError, match="bytes of DRAM"):
        validate_stream(stream, CONFIG)


def _compute_stream(*commands) -> CommandStream:
    """A stream of compute commands on SRAM only (validation needs no DMA), with one output buffer."""
    from simulator import Buffer

    return CommandStream("compute", CONFIG.name, (Buffer("ofm", BufferKind.OUTPUT, 16, shape=(16,)),), commands)


def _softmax_command(**changes):
    from simulator import Command, FeatureMap
    from simulator.isa import Softmax

    fields = dict(ifm=FeatureMap(0, 2, 3, 10), ofm=FeatureMap(64, 2, 3, 10), input_multiplier=1717986944,
                  input_left_shift=22, diff_min=-496)
    return Command(Opcode.SOFTMAX, Softmax(**{**fields, **changes}), layer="probs")


def _elementwise_command(opcode, **changes):
    from simulator import Command, FeatureMap
    from simulator.isa import Elementwise

    fields = dict(ifm=FeatureMap(0, 1, 8, 4), ifm2=FeatureMap(32, 1, 8, 4), ofm=FeatureMap(64, 1, 8, 4),
                  input_zero_point=-7, input2_zero_point=12, output_zero_point=3, input_multiplier=0, input_shift=0,
                  input2_multiplier=0, input2_shift=0, output_multiplier=1936639616, output_shift=-4, left_shift=0)
    if opcode == Opcode.SUB:
        fields.update(input_multiplier=1385473313, input_shift=-1, input2_multiplier=1 << 30,
                      output_multiplier=1479377541, output_shift=-19, left_shift=20)
    return Command(opcode, Elementwise(**{**fields, **changes}), layer=opcode.name.lower())


def test_new_opcodes_round_trip():
    """Format 1.1: SUB and MUL carry Elementwise, SOFTMAX the new Softmax table; every field survives."""
    stream = _compute_stream(_elementwise_command(Opcode.SUB), _elementwise_command(Opcode.MUL),
                             _softmax_command(), _softmax_command(output_zero_point=5, diff_min=-3))
    decoded = decode_stream(encode_stream(stream))
    assert decoded == stream and decoded.version == FORMAT_VERSION >= (1, 1)
    assert [c.opcode for c in decoded.commands] == [Opcode.SUB, Opcode.MUL, Opcode.SOFTMAX, Opcode.SOFTMAX]
    sub, mul = decoded.commands[0].payload, decoded.commands[1].payload
    assert (sub.left_shift, sub.input_shift, sub.output_shift) == (20, -1, -19)
    assert (mul.left_shift, mul.output_multiplier, mul.output_shift) == (0, 1936639616, -4)
    softmax, shifted = decoded.commands[2].payload, decoded.commands[3].payload
    assert (softmax.input_multiplier, softmax.input_left_shift, softmax.diff_min) == (1717986944, 22, -496)
    assert (softmax.ifm.height, softmax.ifm.width, softmax.ifm.channels) == (2, 3, 10)
    assert softmax.output_zero_point == -128 and shifted.output_zero_point == 5
    validate_stream(decoded, CONFIG)


def test_opcode_and_payload_must_agree():
    from simulator import Command

    stream = _compute_stream(Command(Opcode.SOFTMAX, _elementwise_command(Opcode.ADD).payload))
    with pytest.raises(StreamError, match="SOFTMAX cannot carry Elementwise"):
        encode_stream(stream)
    with pytest.raises(StreamError, match=r"command 0 \(SOFTMAX\): payload is Elementwise, expected Softmax"):
        validate_stream(stream, CONFIG)


@pytest.mark.parametrize("field, value", [("input_multiplier", 1 << 30), ("input_shift", -1),
                                          ("input2_multiplier", 5), ("input2_shift", -2), ("left_shift", 20)])
def test_validation_rejects_mul_with_add_fields(field, value):
    validate_stream(_compute_stream(_elementwise_command(Opcode.MUL)), CONFIG)
    with pytest.raises(StreamError, match=f"MUL rescales only the product; {field} must be 0"):
        validate_stream(_compute_stream(_elementwise_command(Opcode.MUL, **{field: value})), CONFIG)


@pytest.mark.parametrize("opcode", [Opcode.SUB, Opcode.MUL])
def test_validation_rejects_elementwise_count_mismatch(opcode):
    from simulator import FeatureMap

    bad = _elementwise_command(opcode, ifm2=FeatureMap(32, 1, 8, 3))
    with pytest.raises(StreamError, match=r"command 0 \((SUB|MUL)\): elementwise operands hold different"):
        validate_stream(_compute_stream(bad), CONFIG)


def _softmax_rejected(message, **changes):
    with pytest.raises(StreamError, match=message):
        validate_stream(_compute_stream(_softmax_command(**changes)), CONFIG)


def test_validation_softmax_shapes():
    from simulator import FeatureMap

    _softmax_rejected(r"ofm 3x2x10 must have the ifm's shape 2x3x10", ofm=FeatureMap(64, 3, 2, 10))
    _softmax_rejected("ifm dimensions must be positive", ifm=FeatureMap(0, 2, 3, 0), ofm=FeatureMap(64, 2, 3, 0))
    _softmax_rejected("ofm overlaps ifm", ofm=FeatureMap(59, 2, 3, 10))
    validate_stream(_compute_stream(_softmax_command(ofm=FeatureMap(60, 2, 3, 10))), CONFIG)  # adjacent is fine
    _softmax_rejected("ofm ends at SRAM byte", ofm=FeatureMap(CONFIG.sram_bytes - 59, 2, 3, 10))


def test_validation_softmax_parameters_at_their_limits():
    validate_stream(_compute_stream(_softmax_command(input_left_shift=31, diff_min=0,
                                                     input_multiplier=(1 << 31) - 1)), CONFIG)
    _softmax_rejected("input multiplier 1717986944 / left shift 32 out of range", input_left_shift=32)
    _softmax_rejected("left shift -1 out of range", input_left_shift=-1)
    _softmax_rejected("input multiplier 2147483648 / left shift 22 out of range", input_multiplier=1 << 31)
    _softmax_rejected(r"diff_min 1 must be <= 0 \(the row maximum always counts\)", diff_min=1)
    _softmax_rejected("output_zero_point 128 is outside int8", output_zero_point=128)
    validate_stream(_compute_stream(_softmax_command(input_left_shift=24, diff_min=-128)), CONFIG)  # -2**31 fits
    _softmax_rejected("diff_min -129 shifted left by 24 overflows int32", input_left_shift=24, diff_min=-129)


def test_softmax_runs_from_decoded_bytes():
    """The stream format and the kernel agree: a decoded SOFTMAX stream runs and normalises every row."""
    from simulator import Buffer, Command

    x = np.arange(-30, 30, dtype=np.int8).reshape(1, 2, 3, 10)
    dma_in = DmaCopy(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, -1, 0, x.size)
    dma_out = DmaCopy(MemorySpace.SRAM, -1, 64, MemorySpace.DRAM, 1, 0, x.size)
    stream = CommandStream("softmax", CONFIG.name,
                           (Buffer("ifm", BufferKind.INPUT, x.size, shape=x.shape),
                            Buffer("ofm", BufferKind.OUTPUT, x.size, shape=x.shape)),
                           (Command(Opcode.DMA_COPY, dma_in), _softmax_command(), Command(Opcode.DMA_COPY, dma_out)))
    outputs, _ = run_stream(encode_stream(stream), {"ifm": x})
    probabilities = (outputs["ofm"].astype(int).reshape(6, 10) + 128).sum(axis=1)
    assert np.all(np.abs(probabilities - 256) <= 10)


def _ort_commands():
    """One ONNXRUNTIME command of each payload that carries scales (format 1.2)."""
    from simulator import Command, FeatureMap, Rounding
    from simulator.isa import Pooling, Reduction

    ort = Rounding.ONNXRUNTIME
    zeros = dict(output_multiplier=0, output_shift=0)
    mul = _elementwise_command(Opcode.MUL, rounding=ort, input_scale=0.02, input2_scale=0.031, output_scale=0.011,
                               **zeros)
    mean = Command(Opcode.MEAN, Reduction(FeatureMap(0, 3, 4, 8), FeatureMap(128, 1, 1, 8), -5, 7, 0, 0,
                                          rounding=ort, input_scale=0.05, output_scale=0.04), layer="mean")
    pool = Command(Opcode.AVG_POOL2D, Pooling(FeatureMap(0, 4, 4, 2), FeatureMap(64, 2, 2, 2), 2, 2, 2, 2, 0, 0, 0, 0,
                                              rounding=ort, input_scale=0.05, input_zero_point=-3,
                                              output_scale=0.07, output_zero_point=9), layer="pool")
    return mul, mean, pool


def test_onnxruntime_fields_round_trip():
    """The float32 scales (format 1.2) survive encoding exactly (the payloads hold float32 values)."""
    stream = _compute_stream(*_ort_commands())
    decoded = decode_stream(encode_stream(stream))
    assert decoded == stream and decoded.version == FORMAT_VERSION >= (1, 2)
    mul, mean, pool = (c.payload for c in decoded.commands)
    assert (mul.input_scale, mul.input2_scale, mul.output_scale) == tuple(
        float(np.float32(s)) for s in (0.02, 0.031, 0.011))
    assert (mean.input_scale, mean.output_scale) == (float(np.float32(0.05)), float(np.float32(0.04)))
    assert (pool.rounding.name, pool.input_zero_point, pool.output_zero_point) == ("ONNXRUNTIME", -3, 9)
    validate_stream(decoded, CONFIG)


def test_older_streams_decode_with_tflite_defaults():
    """A 1.1 stream carries none of the 1.2 fields: they decode as the TFLite mode's zeros and still validate."""
    from simulator import Command, FeatureMap
    from simulator.isa import Pooling

    pool = Command(Opcode.AVG_POOL2D, Pooling(FeatureMap(0, 4, 4, 2), FeatureMap(64, 2, 2, 2), 2, 2, 2, 2, 0, 0, 0, 0))
    old = dataclasses.replace(_compute_stream(_elementwise_command(Opcode.SUB), pool), version=(1, 1))
    decoded = decode_stream(encode_stream(old))
    assert decoded == old
    sub, pool = (c.payload for c in decoded.commands)
    assert (sub.rounding.name, sub.input_scale) == (pool.rounding.name, pool.output_scale) == ("TFLITE_DOUBLE", 0)
    validate_stream(decoded, CONFIG)


@pytest.mark.parametrize("index, changes, message", [
    (0, dict(input_scale=0.0), "ONNXRUNTIME input_scale 0.0 must be positive and finite"),
    (0, dict(output_scale=float("nan")), "ONNXRUNTIME output_scale nan must be positive"),
    (0, dict(input2_scale=float("inf")), "input2_scale inf must be positive"),
    (0, dict(output_multiplier=1 << 30), "computes with the scales; output_multiplier must be 0"),
    (0, dict(left_shift=20), "left_shift must be 0"),
    (1, dict(multiplier=1 << 30, shift=-3), "multiplier, shift must be 0"),
    (1, dict(output_scale=-0.5), "output_scale -0.5 must be positive"),
    (2, dict(input_scale=0.0), "input_scale 0.0 must be positive"),
    (2, dict(output_zero_point=128), "output_zero_point 128 is outside int8"),
])
def test_validation_of_onnxruntime_commands(index, changes, message):
    commands = list(_ort_commands())
    commands[index] = dataclasses.replace(commands[index], payload=dataclasses.replace(commands[index].payload,
                                                                                         **changes))
    with pytest.raises(StreamError, match=message):
        validate_stream(_compute_stream(*commands), CONFIG)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_scales_need_onnxruntime_rounding(index):
    """In a TFLite mode nothing reads the scales: a stream that sets them is refused, not silently ignored."""
    from simulator import Rounding

    command = _ort_commands()[index]
    fixed_point = {0: dict(output_multiplier=1936639616, output_shift=-4), 1: dict(multiplier=1 << 30, shift=-3),
                   2: {}}[index]
    tflite = dataclasses.replace(command.payload, rounding=Rounding.TFLITE_DOUBLE, **fixed_point)
    with pytest.raises(StreamError, match="only ONNXRUNTIME reads"):
        validate_stream(_compute_stream(dataclasses.replace(command, payload=tflite)), CONFIG)


def test_max_pool_ignores_the_onnxruntime_fields():
    from simulator import Command

    pool = _ort_commands()[2]
    validate_stream(_compute_stream(Command(Opcode.MAX_POOL2D, pool.payload)), CONFIG)


def test_onnxruntime_mac_rounding_runs_from_decoded_bytes():
    """A conv layer compiled with ONNXRUNTIME rounding: its scale/bias table holds the double scales."""
    from simulator import Rounding
    from simulator.numerics import float_scales

    p = random_params(np.random.default_rng(4), NpuOp.CONV2D, (1, 5, 5, 2), out_channels=3)
    p = dataclasses.replace(p, rounding=Rounding.ONNXRUNTIME)
    stream = layer_stream(p, CONFIG)
    conv = next(c.payload for c in stream.commands if c.opcode == Opcode.CONV2D)
    assert conv.rounding == Rounding.ONNXRUNTIME
    table = next(b for b in stream.buffers if b.name.endswith("scale_bias"))
    scales = np.frombuffer(table.data, "<i4").reshape(-1, 3)[:, 1:].copy().view(np.float64).ravel()
    np.testing.assert_array_equal(scales, float_scales(p.input_scale, p.weight_scales, p.output_scale))
    outputs, _ = run_stream(encode_stream(stream), {"ifm": np.ones(p.ifm_shape, np.int8)})
    assert outputs["ofm"].shape == p.ofm_shape


def test_mutated_onnxruntime_streams_fail_only_with_npu_errors():
    """Flipped bytes in the float32 scales (NaN, inf, huge, negative) end in NpuError or a result, never a crash."""
    import random

    from simulator import Buffer, Command

    dma_in = Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, -1, 0, 32))
    dma_in2 = Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, -1, 32, 32))
    dma_out = Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.SRAM, -1, 64, MemorySpace.DRAM, 1, 0, 8))
    buffers = (Buffer("ifm", BufferKind.INPUT, 32, shape=(1, 4, 4, 2)), Buffer("ofm", BufferKind.OUTPUT, 8, shape=(8,)))
    data = encode_stream(CommandStream("ort", CONFIG.name, buffers, (dma_in, dma_in2, *_ort_commands(), dma_out),
                                       version=(1, 3)))  # no checksum: the mutants reach the parser
    mutate_and_run(data, random.Random(99), count=300, max_flips=4)


def test_depthwise_ofm_channels_must_be_a_multiple_of_the_ifm_channels():
    """The channel multiplier is ofm / ifm channels: 10 outputs of 4 input channels is no multiplier."""
    p = random_params(np.random.default_rng(2), NpuOp.DEPTHWISE_CONV2D, (1, 6, 6, 4), multiplier=2)
    stream = layer_stream(p, CONFIG)
    index, conv = next((i, c.payload) for i, c in enumerate(stream.commands) if c.opcode == Opcode.DEPTHWISE_CONV2D)
    with pytest.raises(StreamError, match="depthwise ofm channels 10 are not a multiple of the ifm's 4"):
        validate_stream(_with_command(stream, index, ofm=dataclasses.replace(conv.ofm, channels=10)), CONFIG)


@pytest.mark.parametrize("src_stride, dst_stride, message", [
    (0, 8, None),                                       # a broadcast read: the same row again
    (4, 8, "source stride 4 must be 0 .a broadcast read. or at least a row"),
    (8, 4, "destination stride 4 shorter than a row would overlap rows"),
    (8, 0, "destination stride 0 shorter than a row"),  # never a broadcast write
])
def test_dma_reads_may_repeat_a_row_but_writes_never_overlap(src_stride, dst_stride, message):
    from simulator import Buffer, Command

    buffers = (Buffer("ifm", BufferKind.INPUT, 8, shape=(8,)), Buffer("ofm", BufferKind.OUTPUT, 32, shape=(32,)))
    load = Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, -1, 0, 8, 4, src_stride,
                                            dst_stride))
    store = Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.SRAM, -1, 0, MemorySpace.DRAM, 1, 0, 32))
    stream = CommandStream("dma", CONFIG.name, buffers, (load, store))
    if message is None:
        outputs, _ = run_stream(stream, {"ifm": np.arange(8, dtype=np.int8)})
        np.testing.assert_array_equal(outputs["ofm"], np.tile(np.arange(8, dtype=np.int8), 4))
    else:
        with pytest.raises(StreamError, match=message):
            validate_stream(stream, CONFIG)


def test_corrupted_streams_never_run_to_other_outputs(conv_stream):
    """bench/bench_fuzz.py in small: 300 corrupted files of a format-2 stream end in NpuError, or are byte-for-
    byte the original (a flip that rewrote a byte with its own value) and give its outputs."""
    import random

    from simulator import NpuError

    data = encode_stream(conv_stream)
    x = {"ifm": np.random.default_rng(1).integers(-128, 128, (1, 8, 8, 4), dtype=np.int8)}
    reference, _ = run_stream(conv_stream, x)
    rng = random.Random(5)
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            outputs, _ = run_stream(decode_stream(bytes(mutated)), x)
        except NpuError:
            continue
        assert bytes(mutated) == data and np.array_equal(outputs["ofm"], reference["ofm"])
