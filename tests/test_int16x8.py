"""TFLite's 16x8 mode (int16 activations, int8 weights, int64 bias) on the NPU's CONV2D.

The import (the int64 bias narrowed exactly, everything else of the mode refused in one line), the pattern's
int16 qparams and their limits, the simulator's 16x8 output stage and kernel against hand-computed values,
the stream format, and a hand-built layer against the slow reference of tests/reference_kernels.py. The
fixture itself runs bit-exact in tests/test_tflite_golden.py.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.ir.expr import Constant

import npu_backend
import reference_kernels as ref
from conftest import FIXTURES
from layer_streams import check_format_gate
from npu_backend.cli import main
from npu_backend.ops import decode_composite
from relax_idioms import f32, i32
from test_patterns import composite_attrs
from simulator import (ActivationType, Buffer, BufferKind, Command, CommandStream, Convolution, DmaCopy, FeatureMap,
                       MemorySpace, NumericsError, Opcode, Rounding, StreamError, decode_stream, encode_stream,
                       get_config, run_stream, validate_stream)
from simulator.cycles import conv2d_cost
from simulator.numerics import (conv_multipliers_16x8, multiply_by_quantized_multiplier,
                                multiply_by_quantized_multiplier_int64)

FIXTURE = FIXTURES / "tflite" / "conv2d_3x3_s1_same_int16x8.tflite"
CONFIG = get_config("npu-256")
INT16 = ActivationType.INT16


# --- import --------------------------------------------------------------------------------------------------

def _tflite_model(data: bytes):
    import tflite

    return tflite.Model.GetRootAsModel(data, 0)


def _fixture_bias() -> np.ndarray:
    model = _tflite_model(FIXTURE.read_bytes())
    bias = model.Subgraphs(0).Tensors(2)
    return model.Buffers(bias.Buffer()).DataAsNumpy().view(np.int64)


def test_the_fixture_imports_with_its_int64_bias_narrowed_exactly():
    mod = npu_backend.load_model(FIXTURE)
    (x,) = mod["main"].params
    assert str(x.ty.dtype) == "int16" and str(mod["main"].ret_ty.dtype) == "int16"
    biases = [call.args[0].value.numpy() for block in mod["main"].body.blocks for call in
              (b.value for b in block.bindings) if isinstance(call, relax.Call) and call.op.name == "relax.dequantize"
              and isinstance(call.args[0], Constant) and call.args[0].value.numpy().ndim == 1]
    (bias,) = biases
    assert bias.dtype == np.int32 and np.array_equal(bias.astype(np.int64), _fixture_bias())


def _patched(data: bytes, *patches) -> bytes:
    out = bytearray(data)
    for position, fmt, value in patches:
        struct.pack_into(fmt, out, position, value)
    return bytes(out)


def _as_depthwise(data: bytes) -> bytes:
    """The fixture with its operator code rewritten to DEPTHWISE_CONV_2D (both the old byte and the int32 field)."""
    code = _tflite_model(data).OperatorCodes(0)._tab
    return _patched(data, (code.Pos + code.Offset(4), "<b", 4), (code.Pos + code.Offset(10), "<i", 4))


def _int32_bias(data: bytes) -> bytes:
    """The fixture with its bias tensor typed INT32 (TFLite then accumulates the 16x8 layer in int32)."""
    tensor = _tflite_model(data).Subgraphs(0).Tensors(2)._tab
    return _patched(data, (tensor.Pos + tensor.Offset(6), "<B", 2))


def _bias_beyond_int32(data: bytes) -> bytes:
    """The fixture with the int64 bias of channel 0 set to 2**31, one past int32."""
    model = _tflite_model(data)
    buffer = model.Buffers(model.Subgraphs(0).Tensors(2).Buffer())._tab
    return _patched(data, (buffer.Vector(buffer.Offset(4)), "<q", 1 << 31))


@pytest.mark.parametrize("patch, message", [
    (_as_depthwise, "int16 activations (16x8 quantization) of DEPTHWISE_CONV_2D are not supported: npu_backend "
                    "imports 16x8 CONV_2D only"),
    (_int32_bias, "16x8 CONV_2D 'StatefulPartitionedCall_1:0' has no int64 bias: TFLite then accumulates in int32 "
                  "and requantizes as for int8, which the NPU's 16x8 convolution does not do"),
    (_bias_beyond_int32, "holds 2147483648, beyond the int32 bias the NPU's scale/bias table carries"),
], ids=["other_16x8_operator", "int32_bias", "bias_beyond_int32"])
def test_16x8_models_the_import_refuses_are_one_line(patch, message, tmp_path, capsys):
    model = tmp_path / "m.tflite"
    model.write_bytes(patch(FIXTURE.read_bytes()))
    assert main(["run", str(model)]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("npu: error: TVM's TFLite importer rejected m.tflite: ") and message in err


# --- pattern ---------------------------------------------------------------------------------------------------

def conv16_module(x_shape=(1, 9, 7, 5), out_channels=6, kernel=(3, 3), strides=(1, 1), dilation=(1, 1),
                  padding=(1, 1, 1, 1), input_scale=3.0517578e-05, output_scale=2.0e-4, zero_points=(0, 0),
                  weight_scales=None, out_dtype="int16", clip=None, depthwise=False, seed=0):
    """TVM's form of a 16x8 CONV_2D (as load_tflite imports it): dequantize(int16 x), dequantize(int8 w) per
    channel, conv2d, + dequantize(int32 bias), quantize to int16 [-> clip]; ``depthwise``: its DEPTHWISE form."""
    rng = np.random.default_rng(seed)
    channels = x_shape[-1]
    oc = channels if depthwise else out_channels
    weights = rng.integers(-128, 128, (*kernel, 1 if depthwise else channels, oc), dtype=np.int8)
    if depthwise:
        weights = weights.reshape(*kernel, oc, 1)
    scales = (rng.uniform(0.002, 0.01, oc) if weight_scales is None else np.broadcast_to(weight_scales, (oc,)))
    scales = scales.astype(np.float32)
    bias = rng.integers(-3_000_000, 3_000_000, oc).astype(np.int32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "int16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dq_x = bb.emit(relax.op.dequantize(x, f32(input_scale), i32(zero_points[0]), axis=0))
            dq_w = bb.emit(relax.op.dequantize(relax.const(weights), f32(scales), i32(np.zeros(oc)), axis=2
                                               if depthwise else 3))
            conv = bb.emit(relax.op.nn.conv2d(dq_x, dq_w, strides=strides, padding=padding, dilation=dilation,
                                              groups=channels if depthwise else 1, data_layout="NHWC",
                                              kernel_layout="HWOI" if depthwise else "HWIO"))
            dq_b = bb.emit(relax.op.dequantize(i32(bias), f32(np.float32(input_scale) * scales), i32(0), axis=0))
            q = relax.op.quantize(bb.emit(relax.op.add(conv, dq_b)), f32(output_scale), i32(zero_points[1]), axis=0,
                                  out_dtype=out_dtype)
            if clip is not None:
                q = relax.op.clip(bb.emit(q), float(clip[0]), float(clip[1]))
            gv = bb.emit_output(q)
        bb.emit_func_output(gv)
    return bb.get(), weights, scales, bias


def test_16x8_conv_matches_with_exact_int16_qparams():
    """A fused ReLU on int16 is clip(0, 32767): the clamp keeps the int16 range, zero points are 0, the bias is
    the int32 constant and the input and output scales are the float32 values of the graph."""
    mod, weights, scales, bias = conv16_module(clip=(0.0, 32767.0))
    partitioned = npu_backend.partition_for_npu(mod)
    assert not npu_backend.partition_report(partitioned).host_ops
    ((name, attrs),) = composite_attrs(partitioned)
    p = decode_composite(attrs)
    assert name == "npu.conv2d" and str(attrs["npu.activation_type"]) == "INT16"
    assert (p.activation_type, p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point, p.clamp) == (
        INT16, float(np.float32(3.0517578e-05)), 0, float(np.float32(2.0e-4)), 0, (0, 32767))
    assert p.rounding == Rounding.TFLITE_DOUBLE and p.per_channel and np.array_equal(p.weight_scales, scales)
    assert np.array_equal(p.bias, bias) and np.array_equal(p.weights, np.transpose(weights, (3, 0, 1, 2)))


def _conv_reason(mod, **partition) -> str:
    """Why the convolution stayed on the host (each pattern that tried it says why, joined by "; ")."""
    report = npu_backend.partition_report(npu_backend.partition_for_npu(mod, **partition))
    assert not report.npu_ops
    (reason,) = {o.reason for o in report.host_ops if o.op == "relax.nn.conv2d"}
    return reason


@pytest.mark.parametrize("changes, reason", [
    (dict(zero_points=(1, 0)), "npu.conv2d: input zero point 1 of an int16 tensor must be 0 (TFLite's 16x8 "
                               "quantization is symmetric)"),
    (dict(zero_points=(0, -1)), "npu.conv2d: output zero point -1 of an int16 tensor must be 0 (TFLite's 16x8 "
                                "quantization is symmetric)"),
    (dict(out_dtype="int8"), "npu.conv2d: output dtype int8 of an int16 convolution is not int16 (16x8 keeps "
                             "int16 activations)"),
    (dict(depthwise=True), "npu.depthwise_conv2d: int16 activations (16x8) run on the NPU as CONV2D only, not as "
                           "DEPTHWISE_CONV2D"),
    (dict(input_scale=1.0, weight_scales=1.0, output_scale=1 / 128),
     "npu.conv2d: 16x8 requantization multiplier s_in * s_w / s_out needs shift 8, but TFLite's int64 output "
     "stage takes at most 7"),
], ids=["input_zero_point", "output_zero_point", "int8_output", "depthwise", "multiplier_128"])
def test_16x8_limits_stay_on_the_host_with_their_reason(changes, reason):
    assert reason in _conv_reason(conv16_module(**changes)[0]).split("; ")


def test_the_largest_16x8_multiplier_runs():
    """127.5 = 0.996 * 2**7: shift 7, the last TFLite's int64 output stage takes (128 needs 8, above)."""
    p = decode_composite(composite_attrs(npu_backend.partition_for_npu(conv16_module(
        input_scale=1.0, weight_scales=1.0, output_scale=float(np.float32(1 / 127.5)))[0]))[0][1])
    assert conv_multipliers_16x8(p.input_scale, p.weight_scales, p.output_scale)[1].max() == 7


def test_onnxruntime_numerics_keep_a_16x8_conv_on_the_host():
    assert ("npu.conv2d: ONNXRUNTIME numerics are not implemented for int16: the NPU's 16x8 convolution "
            "requantizes as TFLite does (int64 MultiplyByQuantizedMultiplier)") in _conv_reason(
        conv16_module()[0], reference="onnxruntime").split("; ")


# --- end to end against the slow reference -----------------------------------------------------------------------

@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, name="sram-2k", sram_bytes=2048)],
                         ids=["one_tile", "tiled"])
def test_16x8_conv_on_the_npu_equals_the_slow_reference(config):
    """Strided, dilated, asymmetrically padded, a ReLU6-like clamp, inputs at both int16 limits; on a 2 KiB SRAM
    the int16 stripes (two bytes an element) must be tiled."""
    kernel, strides, dilation, padding, clip = (3, 2), (2, 1), (1, 2), (1, 2, 1, 1), (-1000, 30000)
    mod, weights, scales, bias = conv16_module(x_shape=(1, 11, 9, 7), out_channels=10, kernel=kernel,
                                               strides=strides, dilation=dilation, padding=padding, clip=clip,
                                               output_scale=1.5e-4, seed=3)
    partitioned = npu_backend.partition_for_npu(mod, config)
    assert not npu_backend.partition_report(partitioned).host_ops
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    x = np.random.default_rng(4).integers(-32768, 32768, (1, 11, 9, 7), dtype=np.int16)
    x[0, 0, :3, :] = [[-32768], [32767], [0]]
    with npu_backend.profile() as prof:
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
    mult, shift = ref.conv_multipliers(float(np.float32(3.0517578e-05)), scales.tolist(), float(np.float32(1.5e-4)))
    want = ref.conv2d_16x8(x[0].tolist(), np.transpose(weights, (3, 0, 1, 2)).tolist(), bias.tolist(), mult, shift,
                           clip, strides, dilation, padding)
    assert got.dtype == np.int16 and np.array_equal(got[0], np.array(want))
    conv_commands = [c for _, run in prof.runs for c in run.commands if c.opcode == Opcode.CONV2D]
    assert (len(conv_commands) > 1) == (config.sram_bytes == 2048)
    assert {-1000, 30000} <= set(np.unique(got))  # both clamp limits reached


def test_the_slow_reference_reproduces_tflite_on_the_fixture():
    """The second oracle agrees with BUILTIN_REF (two samples: it is slow)."""
    model = _tflite_model(FIXTURE.read_bytes())
    graph = model.Subgraphs(0)
    weights = model.Buffers(graph.Tensors(1).Buffer()).DataAsNumpy().view(np.int8).reshape(16, 3, 3, 8)
    scale = [graph.Tensors(i).Quantization().ScaleAsNumpy() for i in (0, 1, 3)]
    mult, shift = ref.conv_multipliers(float(scale[0][0]), [float(s) for s in scale[1]], float(scale[2][0]))
    golden = np.load(FIXTURE.with_suffix(".npz"))
    for x, expected in list(zip(golden["inputs"], golden["outputs"]))[:2]:
        got = ref.conv2d_16x8(x[0].tolist(), weights.tolist(), _fixture_bias().tolist(), mult, shift,
                              (-32768, 32767), (1, 1), (1, 1), (1, 1, 1, 1))
        assert np.array_equal(np.array(got), expected[0])


# --- simulator: the 16x8 output stage ----------------------------------------------------------------------------

def test_the_int64_output_stage_rounds_once():
    """Multiplier 0.25 (2**30, shift -1): TFLite's int64 stage computes floor((x + 2) / 4), one rounding, half
    up; the int32 stage of the int8 kernels rounds twice (x / 2 half up, then / 2 half away from zero), so
    5 * 0.25 = 1.25 becomes 2 there (2.5 -> 3 -> 1.5 -> 2) and -1.5 and -0.5 go down."""
    x = np.array([5, -6, -2, 6, 2, -3])
    assert multiply_by_quantized_multiplier_int64(x, 1 << 30, -1).tolist() == [1, -1, 0, 2, 1, -1]
    assert multiply_by_quantized_multiplier(x, 1 << 30, -1).tolist() == [2, -2, -1, 2, 1, -1]


def test_the_int64_output_stage_uses_a_16_bit_multiplier():
    """(m + 2**15) >> 16, saturating at 0x7FFF from 0x7FFF0000 on: 0x7FFF8000 (0.99998 of 2**31) acts as
    0x7FFF / 2**15, so 2**20 becomes 32 * 32767 = 1048544 (the exact product is 1048560)."""
    x = np.array([1 << 20])
    for m in (0x7FFF8000, 0x7FFF0000, 0x7FFEFFFF):
        assert multiply_by_quantized_multiplier_int64(x, m, 0).tolist() == [1048544]
    assert multiply_by_quantized_multiplier_int64(x, 0x7FFEFFFF - 0x8000, 0).tolist() == [32 * 0x7FFE]


@pytest.mark.parametrize("acc, shift, ok", [
    ((1 << 47) - 1, -31, True), (-(1 << 47), -31, True), (1 << 47, -31, False), (-(1 << 47) - 1, -31, False),
    (1, 7, True), (1, 8, False), (1, -32, False),
])
def test_the_int64_output_stage_domain_is_tflites(acc, shift, ok):
    """TFLite asserts -2**47 <= x < 2**47 and -31 <= shift < 8; the 48-bit accumulator holds exactly that."""
    if ok:
        multiply_by_quantized_multiplier_int64(np.array([acc]), 1 << 30, shift)
    else:
        with pytest.raises(NumericsError):
            multiply_by_quantized_multiplier_int64(np.array([acc]), 1 << 30, shift)


# --- simulator: one 16x8 CONV2D command ----------------------------------------------------------------------------

def _conv16_stream(x: np.ndarray, weights: np.ndarray, table: np.ndarray, act=(-32768, 32767),
                   **changes) -> CommandStream:
    """DMA in an int16 ifm [1, H, W, C], int8 weights [OC, 1, 1, C] and the scale/bias table; one 1x1 CONV2D
    with INT16 feature maps; DMA the int16 ofm out."""
    _, h, w, c = x.shape
    oc = weights.shape[0]
    ifm_bytes, ofm_bytes = x.nbytes, h * w * oc * 2
    buffers = (Buffer("ifm", BufferKind.INPUT, ifm_bytes, "int16", x.shape),
               Buffer("w", BufferKind.CONSTANT, weights.nbytes, data=weights.tobytes()),
               Buffer("sb", BufferKind.CONSTANT, table.nbytes, "int32", table.shape, table.astype("<i4").tobytes()),
               Buffer("ofm", BufferKind.OUTPUT, ofm_bytes, "int16", (1, h, w, oc)))
    addresses = (0, 1024, 2048, 4096)  # ifm, weights, table, ofm
    moves = [DmaCopy(MemorySpace.DRAM, i, 0, MemorySpace.SRAM, -1, addresses[i], buffers[i].size) for i in range(3)]
    conv = Convolution(FeatureMap(0, h, w, c, INT16), FeatureMap(4096, h, w, oc, INT16), 1024, 2048,
                       act_min=act[0], act_max=act[1])
    commands = [Command(Opcode.DMA_COPY, m) for m in moves]
    commands += [Command(Opcode.CONV2D, dataclasses.replace(conv, **changes)),
                 Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.SRAM, -1, 4096, MemorySpace.DRAM, 3, 0, ofm_bytes))]
    return CommandStream("conv16", CONFIG, buffers, tuple(commands))


def _table(bias: list[int], multiplier: int, shift: int) -> np.ndarray:
    """The scale/bias table, one row [bias, multiplier, shift] per output channel."""
    return np.array([[b, multiplier, shift] for b in bias], np.int32)


X_LIMITS = np.array([-32768, 32767, 1, -1], np.int16).reshape(1, 1, 4, 1)


@pytest.mark.parametrize("act, expected", [
    # real multiplier 1.0 (2**30, shift 1): out = clamp(w * x + bias); columns: x = -32768, 32767, 1, -1
    ((-32768, 32767), [[-32768, 32767, 127, -127],    # w 127: -4161536 and 4161409 clamp
                       [32767, -32768, -128, 128],    # w -128: 4194304 and -4194176 clamp
                       [-32768, 32767, 1, -1],        # w 1, bias 0: exactly the limits, unclamped
                       [-32767, 32767, 2, 0]]),       # w 1, bias 1: 32768 clamps to 32767
    ((0, 32767), [[0, 32767, 127, 0], [32767, 0, 0, 128], [0, 32767, 1, 0], [0, 32767, 2, 0]]),  # a fused ReLU
], ids=["int16_range", "relu"])
def test_16x8_kernel_clamps_at_the_int16_limits(act, expected):
    weights = np.array([127, -128, 1, 1], np.int8).reshape(4, 1, 1, 1)
    stream = _conv16_stream(X_LIMITS, weights, _table([0, 0, 0, 1], 1 << 30, 1), act)
    out, stats = run_stream(decode_stream(encode_stream(stream)), {"ifm": X_LIMITS})
    assert out["ofm"].dtype == np.int16 and out["ofm"][0, 0].T.tolist() == expected
    assert stats.total_overflows == 0


def test_16x8_kernel_rounds_the_accumulator_once():
    """Multiplier 0.25: accumulators 5, -6, -2, 6 (bias -6, w 1 on x 11, 0, 4, 12) become 1, -1, 0, 2, where
    the int8 output stage would give 2, -2, -1, 2 (test_the_int64_output_stage_rounds_once)."""
    x = np.array([11, 0, 4, 12], np.int16).reshape(1, 1, 4, 1)
    stream = _conv16_stream(x, np.ones((1, 1, 1, 1), np.int8), _table([-6], 1 << 30, -1))
    out, _ = run_stream(stream, {"ifm": x})
    assert out["ofm"].reshape(-1).tolist() == [1, -1, 0, 2]


@pytest.mark.parametrize("changes, message", [
    (dict(input_zero_point=1), "16x8 zero points must be 0, got input 1 and output 0"),
    (dict(rounding=Rounding.FLOAT64), "16x8 requantizes with TFLite's int64 output stage; rounding FLOAT64 does not"),
    (dict(act_max=32768), "act_max 32768 is outside int16"),
    (dict(ofm=FeatureMap(4096, 1, 4, 4)), "ifm holds INT16 and ofm INT8; a convolution keeps its element type"),
    (dict(ifm=FeatureMap(1, 1, 4, 1, INT16)), "INT16 ifm at SRAM byte 1 is not 2-byte aligned"),
    (dict(ofm=FeatureMap(CONFIG.sram_bytes - 30, 1, 4, 4, INT16)), "ofm ends at SRAM byte 262146, past 262144"),
], ids=["zero_point", "float_rounding", "clamp", "mixed_types", "alignment", "two_bytes_an_element"])
def test_invalid_16x8_commands_are_refused_before_running(changes, message):
    stream = _conv16_stream(X_LIMITS, np.ones((4, 1, 1, 1), np.int8), _table([0] * 4, 1 << 30, 1), **changes)
    with pytest.raises(StreamError, match=f"command 3 \\(CONV2D\\): .*{message}"):
        validate_stream(stream, CONFIG)


def test_int16_feature_maps_exist_for_conv2d_only():
    stream = _conv16_stream(X_LIMITS, np.ones((4, 1, 1, 1), np.int8), _table([0] * 4, 1 << 30, 1))
    depthwise = dataclasses.replace(stream, commands=tuple(
        dataclasses.replace(c, opcode=Opcode.DEPTHWISE_CONV2D) if c.opcode == Opcode.CONV2D else c
        for c in stream.commands))
    with pytest.raises(StreamError, match=r"command 3 \(DEPTHWISE_CONV2D\): ifm holds INT16 elements; "
                                          r"DEPTHWISE_CONV2D takes INT8$"):
        validate_stream(depthwise, CONFIG)


# --- the stream format and the cycle model -----------------------------------------------------------------------

def test_int16_feature_maps_round_trip_in_format_2_3_and_older_formats_cannot_carry_them(monkeypatch):
    stream = _conv16_stream(X_LIMITS, np.ones((4, 1, 1, 1), np.int8), _table([0] * 4, 1 << 30, 1))
    assert stream.commands[3].payload.ofm.dtype == INT16
    check_format_gate(monkeypatch, stream, "DTYPE_SINCE", (2, 2),
                      r"format 2.2 cannot carry the INT16 feature map of command 3 \(CONV2D\) ifm \(added in 2.3\)",
                      r"command 3 \(CONV2D\) ifm: activation type INT16 is not defined in format 2.2")


def test_16x8_takes_two_passes_of_the_mac_array():
    """Same shape, int8 and int16: twice the array time (8 x 8-bit multipliers), the same MAC count."""
    int8 = Convolution(FeatureMap(0, 8, 8, 16), FeatureMap(4096, 8, 8, 32), 8192, 16384, kernel=(3, 3),
                       padding=(1, 1, 1, 1))
    int16 = dataclasses.replace(int8, ifm=dataclasses.replace(int8.ifm, dtype=INT16),
                                ofm=dataclasses.replace(int8.ofm, dtype=INT16))
    cost8, cost16 = (conv2d_cost(Opcode.CONV2D, c, CONFIG) for c in (int8, int16))
    array8 = 64 * 9 * 1 * 2  # pixels x taps x ceil(16 / mac_cols) x ceil(32 / mac_rows)
    assert (cost8.cycles, cost16.cycles) == (CONFIG.command_overhead_cycles + array8,
                                             CONFIG.command_overhead_cycles + 2 * array8)
    assert cost8.macs == cost16.macs == 64 * 9 * 16 * 32
