"""Resize on the NPU: nearest neighbour by DMA, bilinear on the pooling unit as TFLite's integer kernel.

What the patterns match and extract (exact records), what stays on the host and why, the kernels against
the loop-per-element reference of ``ResizeBilinearInteger`` (tiles forced by small SRAMs), the RESIZE_BILINEAR
command's validation at its limits, its cost, and its place in the stream format (2.2). The TFLite fixtures
(bit-exact with BUILTIN_REF) are in test_tflite_golden.py.
"""

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
import reference_kernels as ref
from layer_streams import run_layer
from relax_idioms import f32, i32
from test_patterns import composites
from npu_backend.params import NpuOp, ResizeBilinearParams, ResizeNearestParams
from simulator import (Buffer, BufferKind, Command, CommandStream, FeatureMap, Opcode, Rounding, StreamError,
                       decode_stream, encode_stream, get_config, run_stream, validate_stream)
from simulator.isa import Resize

BASE = get_config("npu-256")
TINY = dataclasses.replace(BASE, name="sram-512", sram_bytes=512)


def _module(shape, size, method, mode="asymmetric", rounding="", dtype="int8", q_in=None, q_out=None):
    """resize2d as TVM's TFLite importer writes it: on int8 data (nearest) or between QDQ (``q_in``/``q_out``)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            data = bb.emit(relax.op.dequantize(x, f32(q_in[0]), i32(q_in[1]), axis=0)) if q_in else x
            resized = relax.op.image.resize2d(data, size, layout="NHWC", method=method,
                                              coordinate_transformation_mode=mode, rounding_method=rounding)
            if q_out:
                resized = relax.op.quantize(bb.emit(resized), f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8")
            gv = bb.emit_output(resized)
        bb.emit_func_output(gv)
    return bb.get()


def _run(mod, *inputs):
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    with npu_backend.profile() as prof:
        out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    assert prof.runs, "nothing ran on the NPU"
    return out


def _host_reason(mod) -> str:
    (op,) = [o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.image.resize2d"]
    return op.reason


# -- nearest ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, rounding, size, factors", [("asymmetric", "", (12, 10), (3, 2)),
                                                            ("half_pixel", "round_prefer_ceil", (12, 10), (3, 2)),
                                                            ("align_corners", "", (8, 10), (2, 2))])
def test_nearest_whole_factor_upscale_is_a_dma_copy(mode, rounding, size, factors):
    """TFLite's three spellings of a whole-factor upscale (align_corners too where its rounding lands on
    repeats: 4 -> 8, 5 -> 10), tiled into stripes of two input rows (160 bytes of SRAM hold two widened
    80-byte rows): each stripe is f_w strided loads and f_h strided stores."""
    shape = (1, 4, 5, 8)
    two_rows = dataclasses.replace(BASE, name="sram-160", sram_bytes=160)
    mod = npu_backend.partition_for_npu(_module(shape, size, "nearest_neighbor", mode, rounding), two_rows)
    (name, p), = composites(mod)
    assert name == "npu.resize_nearest" and p == ResizeNearestParams(NpuOp.RESIZE_NEAREST, shape, (1, *size, 8))
    assert p.factors == factors
    (stream,) = npu_backend.codegen.lower_module(mod).values()
    repeat_h, repeat_w = factors
    assert [c.opcode for c in stream.commands] == [Opcode.DMA_COPY] * 2 * (repeat_h + repeat_w)
    x = np.random.default_rng(1).integers(-128, 128, shape, dtype=np.int8)
    np.testing.assert_array_equal(_run(mod, x), x.repeat(repeat_h, axis=1).repeat(repeat_w, axis=2))


def test_nearest_of_a_batch_stacks_its_images():
    mod = npu_backend.partition_for_npu(_module((3, 2, 3, 4), (4, 3), "nearest_neighbor"))
    x = np.random.default_rng(2).integers(-128, 128, (3, 2, 3, 4), dtype=np.int8)
    np.testing.assert_array_equal(_run(mod, x), x.repeat(2, axis=1))


@pytest.mark.parametrize("shape, size, mode, rounding", [
    ((1, 8, 8, 4), (12, 16), "asymmetric", ""),
    ((1, 4, 4, 4), (12, 12), "align_corners", ""),
    ((1, 8, 8, 4), (4, 4), "asymmetric", ""),
])
def test_nearest_that_is_no_repeat_stays_on_host(shape, size, mode, rounding):
    mod = npu_backend.partition_for_npu(_module(shape, size, "nearest_neighbor", mode, rounding))
    assert _host_reason(mod) == (
        f"npu.resize_nearest: nearest resize {shape[1]}x{shape[2]} -> {size[0]}x{size[1]} ({mode}) does not repeat "
        "each pixel a whole number of times, the only upscale the NPU's DMA does")


def test_nearest_of_float_data_stays_on_host():
    mod = npu_backend.partition_for_npu(_module((1, 4, 4, 2), (8, 8), "nearest_neighbor", dtype="float32"))
    assert _host_reason(mod) == "npu.resize_nearest: nearest resize of float32 data is not an int8 tensor move"


def test_nearest_upscale_that_does_not_fit_sram_stays_on_host():
    """A stripe holds one upscaled row: 2 x 16 pixels x 16 channels = 512 bytes fit, 511 do not."""
    mod = _module((1, 2, 16, 16), (4, 32), "nearest_neighbor")
    assert composites(npu_backend.partition_for_npu(mod, dataclasses.replace(TINY, name="s512", sram_align=1)))
    short = dataclasses.replace(TINY, name="s511", sram_bytes=511, sram_align=1)
    assert _host_reason(npu_backend.partition_for_npu(mod, short)) == (
        "npu.resize_nearest: a 512-byte upscaled row does not fit the 511-byte SRAM")


# -- bilinear -----------------------------------------------------------------------------------------------------

Q = (float(np.float32(0.0078125)), -3)


@pytest.mark.parametrize("mode, align_corners, half_pixel", [("half_pixel", False, True), ("asymmetric", False, False),
                                                             ("align_corners", True, False)])
def test_bilinear_carries_tflites_options_and_equals_the_reference(mode, align_corners, half_pixel):
    """Up along the height, down along the width (5x7 -> 9x4), on an SRAM small enough for channel and row
    tiles: every element equals ResizeBilinearInteger restated element by element."""
    small = dataclasses.replace(BASE, name="sram-256", sram_bytes=256)
    mod = npu_backend.partition_for_npu(_module((1, 5, 7, 6), (9, 4), "linear", mode, q_in=Q, q_out=Q), small)
    (name, p), = composites(mod)
    assert name == "npu.resize_bilinear" and p == ResizeBilinearParams(
        NpuOp.RESIZE_BILINEAR, (1, 5, 7, 6), (1, 9, 4, 6), align_corners=align_corners, half_pixel_centers=half_pixel,
        input_scale=0.0078125, input_zero_point=-3, output_scale=0.0078125, output_zero_point=-3,
        rounding=Rounding.TFLITE_DOUBLE)
    (stream,) = npu_backend.codegen.lower_module(mod).values()
    assert sum(c.opcode == Opcode.RESIZE_BILINEAR for c in stream.commands) > 1  # tiled
    x = np.random.default_rng(3).integers(-128, 128, (1, 5, 7, 6), dtype=np.int8)
    want = ref.resize_bilinear(x[0].tolist(), 9, 4, align_corners, half_pixel)
    np.testing.assert_array_equal(_run(mod, x), np.array(want, dtype=np.int8)[None])


@pytest.mark.parametrize("config", [BASE, TINY], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("rounding", [Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE])
def test_bilinear_kernel_matches_the_reference_per_image(config, rounding):
    """A batch of two images, 2x up with half-pixel centres, in both of TFLite's builds (which differ here)."""
    p = ResizeBilinearParams(NpuOp.RESIZE_BILINEAR, (2, 6, 5, 8), (2, 12, 10, 8), False, True, *Q, *Q, rounding)
    x = np.random.default_rng(4).integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    single = rounding == Rounding.TFLITE_SINGLE
    want = np.array([ref.resize_bilinear(image.tolist(), 12, 10, False, True, single) for image in x], np.int8)
    other = np.array([ref.resize_bilinear(image.tolist(), 12, 10, False, True, not single) for image in x], np.int8)
    np.testing.assert_array_equal(got, want)
    assert np.any(want != other)  # the two roundings are told apart by this input
    resizes = [c for c in stats.commands if c.opcode == Opcode.RESIZE_BILINEAR]
    assert (len(resizes) > 2) == (config is TINY)


def test_bilinear_whose_qparams_change_stays_on_host():
    mod = npu_backend.partition_for_npu(_module((1, 4, 4, 2), (8, 8), "linear", "half_pixel", q_in=Q,
                                                q_out=(0.01, -3)))
    assert _host_reason(mod) == ("npu.resize_bilinear: TFLite's int8 RESIZE_BILINEAR interpolates the integers and "
                                 "keeps its input's qparams (0.0078125, -3), but the output's are (0.01, -3)")


def test_bilinear_with_onnxruntime_numerics_stays_on_host():
    mod = npu_backend.partition_for_npu(_module((1, 4, 4, 2), (8, 8), "linear", "half_pixel", q_in=Q, q_out=Q),
                                        reference="onnxruntime")
    assert _host_reason(mod) == ("npu.resize_bilinear: the NPU's resize_bilinear is TFLite's integer kernel; "
                                 "onnxruntime's float32 resize_bilinear of the dequantized input is not reproduced")


def test_bilinear_of_another_coordinate_transformation_stays_on_host():
    mod = npu_backend.partition_for_npu(_module((1, 4, 4, 2), (8, 8), "linear", "pytorch_half_pixel", q_in=Q,
                                                q_out=Q))
    assert _host_reason(mod) == ("npu.resize_bilinear: bilinear resize with coordinate_transformation_mode "
                                 "'pytorch_half_pixel' is not one of TFLite's (asymmetric, half_pixel, align_corners)")


# -- the RESIZE_BILINEAR command ----------------------------------------------------------------------------------

def _resize_stream(version=None, **changes) -> CommandStream:
    fields = dict(ifm=FeatureMap(0, 4, 4, 8), ofm=FeatureMap(128, 8, 8, 8), step_h=512, step_w=512, offset_h=-256,
                  offset_w=-256, rounding=Rounding.TFLITE_SINGLE)
    command = Command(Opcode.RESIZE_BILINEAR, Resize(**{**fields, **changes}), layer="resize")
    stream = CommandStream("resize", BASE, (Buffer("ofm", BufferKind.OUTPUT, 16, shape=(16,)),), (command,))
    return stream if version is None else dataclasses.replace(stream, version=version)


def test_resize_command_round_trips_and_costs_a_weighted_2x2_window_per_pixel():
    stream = _resize_stream()
    decoded = decode_stream(encode_stream(stream))
    assert decoded == stream and decoded.version >= (2, 2)
    _, stats = run_stream(decoded, {})
    (command,) = stats.commands
    lanes = -(-8 // BASE.output_lanes)
    assert command.cycles == BASE.command_overhead_cycles + 8 * 8 * 4 * lanes and command.macs == 0


def test_resize_command_needs_format_2_2(monkeypatch):
    """An older format cannot carry the opcode: the encoder refuses, and so does the decoder of a stream that
    claims an older format (written here with the opcode's record patched)."""
    with pytest.raises(StreamError, match=r"RESIZE_BILINEAR is not defined in format 2.1 \(added in 2.2\)"):
        encode_stream(_resize_stream(version=(2, 1)))
    from simulator.opcodes import OPCODES

    monkeypatch.setitem(OPCODES, Opcode.RESIZE_BILINEAR,
                        dataclasses.replace(OPCODES[Opcode.RESIZE_BILINEAR], since=None))
    data = encode_stream(_resize_stream(version=(2, 1)))
    monkeypatch.undo()
    with pytest.raises(StreamError, match=r"command 0: RESIZE_BILINEAR is not defined in format 2.1"):
        decode_stream(data)


@pytest.mark.parametrize("changes, message", [
    (dict(offset_h=-1023), None),
    (dict(offset_h=-1024), r"offset_h -1024 is not above -1024"),
    (dict(offset_w=511), None),  # the last of 8 columns samples 511 + 7 * 512 = 4095: the 4th pixel's last step
    (dict(offset_w=512), r"position 4096 \(1/1024 pixels\) of the last output along w lies past the ifm's 4 pixels"),
    (dict(step_h=621), None),  # -256 + 7 * 621 = 4091
    (dict(step_h=622), r"position 4098 \(1/1024 pixels\) of the last output along h lies past the ifm's 4 pixels"),
    (dict(step_h=-1), r"step_h -1 is negative"),
    (dict(ofm=FeatureMap(128, 8, 8, 4)), r"ofm has 4 channels, the ifm 8"),
    (dict(rounding=Rounding.ONNXRUNTIME), r"rounding ONNXRUNTIME is not one of TFLite's fixed-point builds"),
])
def test_resize_command_validation(changes, message):
    stream = _resize_stream(**changes)
    if message is None:
        validate_stream(stream, BASE)
    else:
        with pytest.raises(StreamError, match=message):
            validate_stream(stream, BASE)
