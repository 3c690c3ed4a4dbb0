"""The prepared (fast) execution of a stream against the plain one, every opcode by its kernel: on values
chosen to break each fast path if it were wrong (extreme int8, zero points, ties of TFLite's double rounding,
sums past float32's 2**24, narrow accumulators that wrap or saturate), and run after run, since the expensive
preparations are made on a step's second run (:mod:`simulator.prepared`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import reference_kernels as ref
from layer_streams import layer_stream, random_params, weights_from_an_input
from npu_backend.params import ElementwiseParams, MeanParams, NpuOp, PoolParams
from simulator import BufferKind, CommandStream, Rounding, get_config, run_stream
from simulator.isa import Command, DmaCopy, MemorySpace, Opcode
from simulator.kernels import MachineState
from simulator.numerics import (float64_requantizer, float64_scale_requantizer, multiply_by_quantized_multiplier,
                                requantize_float)
from simulator.opcodes import opcode_def
from simulator.mac_plans import constant_operands
from simulator.prepared import PREPARE_ON_RUN, prepare_stream

BASE = get_config("npu-256")
WRAP14 = dataclasses.replace(BASE, name="npu-256-acc14", accumulator_bits=14)
SAT14 = dataclasses.replace(BASE, name="npu-256-acc14s", accumulator_bits=14, accumulator_overflow="saturate")
TILED = dataclasses.replace(BASE, name="sram-4k", sram_bytes=4096)


def kernels_run(stream: CommandStream, inputs: dict, config) -> tuple[dict, list[int]]:
    """The plain execution: every command by its opcode's kernel, in stream order, on fresh memories."""
    dram = []
    for buf in stream.buffers:
        if buf.kind == BufferKind.CONSTANT:
            dram.append(np.frombuffer(buf.data, np.uint8))
        elif buf.kind == BufferKind.INPUT:
            dram.append(np.ascontiguousarray(inputs[buf.name]).reshape(-1).view(np.uint8).copy())
        else:
            dram.append(np.zeros(buf.size, np.uint8))
    state = MachineState(sram=np.zeros(config.sram_bytes, np.uint8), dram=dram)
    counts = [opcode_def(c.opcode).execute(state, c.opcode, c.payload, config) for c in stream.commands]
    outputs = {buf.name: dram[i].view(buf.dtype).reshape(buf.shape) for i, buf in stream.buffers_of(BufferKind.OUTPUT)}
    return outputs, counts


def assert_runs_equal(stream: CommandStream, feeds: list[dict], config) -> None:
    """Each feed through one prepared stream equals the plain execution, outputs and overflow counts."""
    prepared = prepare_stream(stream, config)
    for feed in feeds:
        got, stats = prepared.run(feed)
        want, counts = kernels_run(stream, feed, config)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        assert [c.overflows for c in stats.commands] == counts
    return prepared


def _extremes(shape, rng, zero_point=0):
    """Full-scale inputs of both signs, the zero point itself, and random ones."""
    return [np.full(shape, 127, np.int8), np.full(shape, -128, np.int8), np.full(shape, zero_point, np.int8),
            rng.integers(-128, 128, shape).astype(np.int8), rng.choice(np.array([-128, 127], np.int8), shape)]


MAC_LAYERS = [
    (NpuOp.CONV2D, dict(ifm_shape=(1, 12, 10, 6), out_channels=20)),  # gathered taps
    (NpuOp.CONV2D, dict(ifm_shape=(1, 7, 6, 70), out_channels=9, strides=(2, 1), padding=(1, 0, 1, 2))),  # per tap
    (NpuOp.CONV2D, dict(ifm_shape=(1, 9, 8, 24), out_channels=16, kernel=(1, 1), padding=(0, 0, 0, 0))),
    (NpuOp.CONV2D, dict(ifm_shape=(1, 9, 8, 24), out_channels=16, kernel=(1, 1), padding=(0, 0, 0, 0),
                        clamp=(-128, -128 + 80))),
    (NpuOp.CONV2D, dict(ifm_shape=(1, 9, 8, 16), out_channels=40, kernel=(1, 1), padding=(0, 0, 0, 0), relu=True)),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 13, 11, 8), strides=(2, 2), padding=(1, 1, 1, 1), relu=True)),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 12, 10, 8), strides=(2, 2), multiplier=2)),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 11, 9, 16), dilation=(2, 2), padding=(2, 2, 2, 2))),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 13, 11, 8), strides=(2, 2), padding=(1, 1, 1, 1))),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 12, 13, 8), strides=(2, 3), dilation=(1, 2), padding=(2, 3, 1, 2))),
    (NpuOp.FULLY_CONNECTED, dict(ifm_shape=(3, 40), out_channels=7)),
]


@pytest.mark.parametrize("config", [BASE, TILED, WRAP14, SAT14], ids=["npu-256", "tiled", "wrap14", "saturate14"])
@pytest.mark.parametrize("op,kwargs", MAC_LAYERS, ids=lambda v: getattr(v, "value", None) or "")
def test_mac_layers_run_prepared_as_by_their_kernels(config, op, kwargs):
    """``relu``: a clamp from the output zero point up (a fused ReLU6), the output stage's truncating path."""
    rng = np.random.default_rng(11)
    kwargs = dict(kwargs)
    relu = kwargs.pop("relu", False)
    params = random_params(rng, op, **kwargs)
    if relu:
        params = dataclasses.replace(params, clamp=(params.output_zero_point, params.output_zero_point + 100))
    stream = layer_stream(params, config)
    prepared = assert_runs_equal(stream, [{"ifm": x} for x in _extremes(params.ifm_shape, rng)], config)
    mac_steps = [s for s, c in zip(prepared.steps, stream.commands)
                 if c.opcode in (Opcode.CONV2D, Opcode.DEPTHWISE_CONV2D, Opcode.FULLY_CONNECTED)]
    assert mac_steps and all(s.fast is not None for s in mac_steps)  # the fast path ran, on every command


def test_the_per_channel_fully_connected_float64_rounding_runs_prepared():
    """TFLite's reference per-channel FULLY_CONNECTED rounds ``acc * scale`` in double (Rounding.FLOAT64)."""
    rng = np.random.default_rng(12)
    params = dataclasses.replace(random_params(rng, NpuOp.FULLY_CONNECTED, ifm_shape=(4, 300), out_channels=9),
                                 rounding=Rounding.FLOAT64)
    assert_runs_equal(layer_stream(params, BASE), [{"ifm": x} for x in _extremes(params.ifm_shape, rng)], BASE)


@pytest.mark.parametrize("channels", [514, 515, 4099])
def test_long_reductions_past_the_float32_limit_run_prepared(channels):
    """255 * 128 * 514 < 2**24 <= 255 * 128 * 515: full-scale terms of one sign past float32's exact range,
    where the prepared plan must take float64 (its bound from the weights and the input type)."""
    rng = np.random.default_rng(13)
    params = random_params(rng, NpuOp.FULLY_CONNECTED, ifm_shape=(2, channels), out_channels=4)
    weights = np.full((4, channels), -128, np.int8)
    weights[1] = 127
    weights[2, ::2] = 127
    weights[3, -1] = 1
    params = dataclasses.replace(params, weights=weights, input_zero_point=127, bias=np.array([5, -5, 1, 0], np.int32))
    feeds = [{"ifm": np.full((2, channels), -128, np.int8)}, {"ifm": np.full((2, channels), 127, np.int8)}]
    prepared = assert_runs_equal(layer_stream(params, BASE), feeds * 2, BASE)
    (plan,) = [step.plan for step in prepared.steps if getattr(step, "plan", None) is not None]
    # Past 514 channels the sums are float32 products over at most 514 channels each (255 * 128 * 514 < 2**24),
    # added in float64.
    assert plan.chunks is None if channels == 514 else [c.stop - c.start for c in plan.chunks] == [
        514] * (channels // 514) + ([channels % 514] if channels % 514 else [])


def _elementwise(op, rounding=Rounding.TFLITE_DOUBLE, clamp=(-128, 127)):
    return ElementwiseParams(op=op, shape=(1, 9, 11, 7), input_scale=float(np.float32(0.031)), input_zero_point=-7,
                             input2_scale=float(np.float32(0.047)), input2_zero_point=12,
                             output_scale=float(np.float32(0.06 if op != NpuOp.MULTIPLY else 0.9)),
                             output_zero_point=3, clamp=clamp, rounding=rounding)


@pytest.mark.parametrize("op", [NpuOp.ADD, NpuOp.SUBTRACT, NpuOp.MULTIPLY])
@pytest.mark.parametrize("rounding", [Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE, Rounding.ONNXRUNTIME])
def test_elementwise_tables_equal_the_kernel_on_every_input_pair(op, rounding):
    params = _elementwise(op, rounding, clamp=(-100, 90))
    stream = layer_stream(params, BASE)
    rng = np.random.default_rng(14)
    pairs = np.stack(np.meshgrid(np.arange(-128, 128), np.arange(-128, 128)), -1).reshape(-1, 2).astype(np.int8)
    first = np.resize(pairs[:, 0], (4, *params.shape))  # every pair appears somewhere in the four feeds
    second = np.resize(pairs[:, 1], (4, *params.shape))
    feeds = [{"ifm": first[n], "ifm2": second[n]} for n in range(4)]
    feeds += [{"ifm": rng.integers(-128, 128, params.shape).astype(np.int8),
               "ifm2": rng.integers(-128, 128, params.shape).astype(np.int8)}]
    prepared = assert_runs_equal(stream, feeds, BASE)
    assert any(getattr(s, "fast", None) is not None for s in prepared.steps)


@pytest.mark.parametrize("params", [
    MeanParams(NpuOp.MEAN, (1, 12, 12, 5), (1, 1, 1, 5), 0.05, 3, 0.02, -4),
    PoolParams(NpuOp.AVG_POOL2D, (1, 9, 8, 6), (1, 5, 4, 6), (3, 3), (2, 2), (1, 1, 1, 1)),
    PoolParams(NpuOp.MAX_POOL2D, (1, 9, 8, 6), (1, 4, 4, 6), (2, 2), (2, 2), (0, 0, 0, 0), clamp=(-5, 100)),
], ids=["mean", "avg_pool", "max_pool"])
@pytest.mark.parametrize("config", [BASE, WRAP14], ids=["npu-256", "wrap14"])
def test_other_opcodes_run_their_kernels_in_a_prepared_stream(params, config):
    """Pooling runs its kernel; MEAN is prepared where no sum can overflow (not in 14 bits: 144 * 255 > 8191)."""
    rng = np.random.default_rng(15)
    prepared = assert_runs_equal(layer_stream(params, config),
                                 [{"ifm": x} for x in _extremes(params.ifm_shape, rng, 3)], config)
    fast = [getattr(step, "fast", None) is not None for step in prepared.steps]
    assert any(fast) == (params.op == NpuOp.MEAN and config is BASE)


def test_weights_that_change_between_runs_are_never_prepared():
    rng = np.random.default_rng(16)
    stream, dma_index = weights_from_an_input(rng, BASE)
    fc_index = next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.FULLY_CONNECTED)
    assert fc_index not in constant_operands(stream, BASE)
    original = layer_stream(random_params(np.random.default_rng(16), NpuOp.FULLY_CONNECTED, ifm_shape=(2, 16),
                                          out_channels=4), BASE)
    assert fc_index in constant_operands(original, BASE)  # the same stream with constant weights is
    x = rng.integers(-128, 128, (2, 16)).astype(np.int8)
    feeds = [{"ifm": x, "w": rng.integers(-127, 128, (4, 16)).astype(np.int8)} for _ in range(4)]
    prepared = assert_runs_equal(stream, feeds, BASE)
    assert prepared.steps[fc_index].fast is None
    outs = [prepared.run(f)[0]["ofm"] for f in feeds[:2]]
    assert not np.array_equal(*outs)  # the weights really differ from run to run


def test_a_compute_command_overwriting_constant_weights_makes_them_unknown():
    """The constant replay forgets bytes a compute command writes: weights loaded, then partly overwritten by an
    ADD's output, then read by a MAC command, are not prepared, and every run still equals the kernels'."""
    from simulator.elementwise import elementwise_fields
    from simulator.isa import Elementwise

    rng = np.random.default_rng(17)
    params = random_params(rng, NpuOp.FULLY_CONNECTED, ifm_shape=(2, 16), out_channels=4)
    stream = layer_stream(params, BASE)
    fc_index = next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.FULLY_CONNECTED)
    fc = stream.commands[fc_index].payload
    add = Elementwise(fc.ifm, fc.ifm, dataclasses.replace(fc.ifm, address=fc.weights_address), 0, 0, 0,
                      **elementwise_fields(Opcode.ADD, 0.05, 0.05, 0.1, Rounding.TFLITE_DOUBLE))
    commands = (*stream.commands[:fc_index], Command(Opcode.ADD, add, layer="clobber"), *stream.commands[fc_index:])
    clobbered = dataclasses.replace(stream, commands=commands)
    assert fc_index in constant_operands(stream, BASE) and fc_index + 1 not in constant_operands(clobbered, BASE)
    assert_runs_equal(clobbered, [{"ifm": rng.integers(-128, 128, (2, 16)).astype(np.int8)} for _ in range(3)], BASE)


def test_contiguous_strided_and_broadcast_dmas_copy_as_the_kernel_does():
    from simulator.isa import Buffer

    buffers = (Buffer("x", BufferKind.INPUT, 64, "int8", (8, 8)), Buffer("y", BufferKind.OUTPUT, 96, "int8", (6, 16)),
               Buffer("c", BufferKind.CONSTANT, 32, data=bytes(range(100, 132))))
    dma = lambda *a: Command(Opcode.DMA_COPY, DmaCopy(*a))
    commands = (dma(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, 0, 0, 16),  # contiguous
                dma(MemorySpace.DRAM, 0, 8, MemorySpace.SRAM, 0, 16, 8, 2, 0, 16),  # one row broadcast twice
                dma(MemorySpace.DRAM, 0, 1, MemorySpace.SRAM, 0, 24, 5, 4, 16, 16),  # strided both sides
                dma(MemorySpace.DRAM, 2, 0, MemorySpace.SRAM, 0, 80, 16, 2, 16, 16),  # rows one after another
                dma(MemorySpace.SRAM, 0, 0, MemorySpace.DRAM, 1, 0, 96),
                dma(MemorySpace.SRAM, 0, 30, MemorySpace.DRAM, 1, 3, 4, 3, 5, 20))
    stream = CommandStream("dmas", BASE, buffers, commands)
    rng = np.random.default_rng(18)
    assert_runs_equal(stream, [{"x": rng.integers(-128, 128, (8, 8)).astype(np.int8)} for _ in range(3)], BASE)


def test_run_stream_prepares_a_stream_object_once_and_equals_the_kernels():
    rng = np.random.default_rng(19)
    params = random_params(rng, NpuOp.CONV2D, ifm_shape=(1, 8, 8, 8), out_channels=8)
    stream = layer_stream(params, BASE)
    for _ in range(PREPARE_ON_RUN + 1):
        x = rng.integers(-128, 128, params.ifm_shape).astype(np.int8)
        got, stats = run_stream(stream, {"ifm": x})
        np.testing.assert_array_equal(got["ofm"], kernels_run(stream, {"ifm": x}, BASE)[0]["ofm"])
    kept = got["ofm"].copy()
    got["ofm"][...] = 0  # the outputs are the caller's: a later run is not affected
    np.testing.assert_array_equal(run_stream(stream, {"ifm": x})[0]["ofm"], kept)


# Accumulators that make the two roundings of TFLITE_DOUBLE tie (m = 2**30: the high multiply halves an odd
# accumulator exactly), around powers of two, and random ones; per-channel shifts from a left shift to the
# largest right shift the float64 path takes.
TIES = np.array([0, 1, -1, 2, -2, 3, -3, 5, -5, 7, -7, 255, -255, 257, -257, 1023, -1023, 1025, -1025, 4095, -4095,
                 4097, -4097, 2 ** 16 + 1, -(2 ** 16) - 1, 2 ** 19 - 1, -(2 ** 19) + 1])


@pytest.mark.parametrize("zero_point,clamp", [(0, (-128, 127)), (-128, (-128, 127)), (-7, (-7, 80)), (100, (-20, 127)),
                                              (5, (-128, 4))], ids=["symmetric", "relu-low", "relu", "high-zp",
                                                                    "clamp-below-zp"])
def test_the_float64_requantizer_equals_the_integer_reference(zero_point, clamp):
    rng = np.random.default_rng(20)
    shifts = np.array([3, 1, 0, -1, -2, -5, -9, -13, -17, -21])
    multipliers = np.array([2 ** 30, 2 ** 31 - 1, 1518500250, 1073741825, 2 ** 30 + 3, 1999999999, 2 ** 30, 0,
                            1200000001, 2 ** 31 - 2])
    bias = np.array([0, 17, -17, 1 << 20, -(1 << 20), 3, -3, 999, 0, -1])
    acc = np.concatenate([TIES, rng.integers(-2 ** 19, 2 ** 19, 400)])[:, None] + np.zeros((1, 10), np.int64)
    plan = float64_requantizer(multipliers, shifts, zero_point, *clamp, bias=bias)
    assert plan.limit >= 2 ** 19 + 1  # the whole test range is on the float64 path
    assert (plan.nudge is not None) == (clamp[0] < zero_point)
    want = np.clip(multiply_by_quantized_multiplier(acc + bias, multipliers, shifts) + zero_point, *clamp)
    for dtype in (np.float32, np.float64, np.int64):
        got = np.empty(acc.shape, np.int8)
        plan.apply(acc.astype(dtype), got)
        np.testing.assert_array_equal(got, want)
    # The int8 offset folded into the constant, on the channels whose folded limit covers the test range (the
    # right shifts of 17 and 21 leave no room for a nonzero one), and with the scale and constant already applied
    # (a product that folded them in): the same bytes.
    covered = np.flatnonzero(plan.folded_limits >= 2 ** 19 + 1)
    assert set(covered) >= set(range(8)) and ({8, 9} <= set(covered)) == (zero_point == -128)
    sub = float64_requantizer(multipliers[covered], shifts[covered], zero_point, *clamp, bias=bias[covered])
    got = np.empty((len(acc), len(covered)), np.int8)
    sub.bind(acc[:, covered].astype(np.float32), got, fold=True)()
    np.testing.assert_array_equal(got, want[:, covered])
    offset = zero_point + 128 if clamp[0] < zero_point else 0
    values = acc[:, covered] * sub.scale + (sub.constant + offset)
    got = np.empty((len(acc), len(covered)), np.int8)
    sub.bind(values, got, scaled=True, fold=True)()
    np.testing.assert_array_equal(got, want[:, covered])


def test_the_float64_requantizer_limit_is_where_its_products_stop_being_exact():
    """At the limit every value is exact (checked against the integer reference); one past it, some channel's
    terms would need a 54th bit or an int32 shift that wraps."""
    for multiplier, shift, bias in ((2 ** 31 - 1, -21, 0), (2 ** 31 - 1, -5, -(1 << 20)), (2 ** 30, 2, 7),
                                    (1518500250, -22, 3)):
        plan = float64_requantizer(multiplier, shift, 0, -128, 127, bias=bias)
        left, right = max(shift, 0), max(-shift, 0)
        units = lambda a: abs(a) * multiplier + abs(bias) * multiplier + (1 << (30 + right - left)) + (
            (1 << (30 - left)) + (1 << (31 - left)) if right else 0)
        assert units(plan.limit) < 2 ** 53 and ((plan.limit + abs(bias)) << left) <= 2 ** 31 - 1
        assert units(plan.limit + 1) >= 2 ** 53 or ((plan.limit + 1 + abs(bias)) << left) > 2 ** 31 - 1
        edge = np.array([plan.limit, -plan.limit, plan.limit - 1, -plan.limit + 1])
        got = np.empty(4, np.int8)
        plan.apply(edge.astype(np.float64), got)
        want = [min(max(ref.multiply_by_quantized_multiplier(int(a) + bias, multiplier, shift), -128), 127)
                for a in edge]
        np.testing.assert_array_equal(got, want)


def test_the_float64_scale_requantizer_rounds_half_away_from_zero_as_requantize_float():
    scales = np.array([0.5, 0.25, 1 / 3, 2.0 ** -20, 0.0, 0.75])
    acc = np.array([0, 1, -1, 3, -3, 5, -5, 255, -255, 2 ** 20 + 1, -(2 ** 20) - 1, 2 ** 24 - 1, 12345, -12345],
                   np.int64)[:, None] + np.zeros((1, 6), np.int64)
    for zero_point, clamp in ((0, (-128, 127)), (-9, (-20, 100))):
        plan = float64_scale_requantizer(scales, zero_point, *clamp)
        got = np.empty(acc.shape, np.int8)
        plan.apply(acc.astype(np.float64), got)
        np.testing.assert_array_equal(got, requantize_float(acc, scales, zero_point, *clamp, Rounding.FLOAT64))


def test_a_model_whose_commands_share_inputs_runs_prepared_as_by_its_kernels():
    """MobileNetV2's last layers compute their output channels in several commands over one input tile (and its
    classifier in 16-channel slices): their sums are one shared product (:func:`simulator.prepared.shared_inputs`)."""
    import npu_backend
    from npu_backend.codegen.lower import lower_module
    from simulator.mac_plans import shared_inputs

    mod = npu_backend.load_tflite("tests/fixtures/tflite/mobilenet_v2_035_96.tflite")
    (stream,) = lower_module(npu_backend.partition_for_npu(mod)).values()
    runs = shared_inputs(stream, stream.config, constant_operands(stream, stream.config))
    assert runs and max(len(run) for run in runs) > 2
    (buf,) = [b for _, b in stream.buffers_of(BufferKind.INPUT)]
    rng = np.random.default_rng(21)
    feeds = [{buf.name: x} for x in (rng.integers(-128, 128, buf.shape).astype(np.int8) for _ in range(3))]
    prepared = assert_runs_equal(stream, feeds + [{buf.name: np.full(buf.shape, 127, np.int8)}], stream.config)
    plans = [getattr(step, "plan", None) for step in prepared.steps]
    assert sum(p is not None and p.shared is not None for p in plans) == sum(len(run) for run in runs)


def test_the_driver_prepares_each_region_once_and_bounds_what_it_keeps(tmp_path, monkeypatch):
    """The compiled library's driver (npu_backend.runtime) keeps each region's prepared stream by digest: the
    first call runs the kernels, later ones the prepared steps, with equal results; past its byte budget it keeps
    only the stream in use, and results do not change."""
    from collections import OrderedDict

    import tvm
    from tvm import relax

    import npu_backend
    from npu_backend import runtime
    from test_compiled import two_region_model

    mod = npu_backend.load_model(two_region_model(tmp_path / "two.onnx"))
    vm = relax.VirtualMachine(npu_backend.build(mod), tvm.cpu())
    monkeypatch.setattr(runtime, "_PREPARED", OrderedDict())
    rng = np.random.default_rng(22)
    xs = [rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32) for _ in range(3)]
    first = [vm["main"](tvm.runtime.tensor(x)).numpy() for x in xs]
    assert len(runtime._PREPARED) == 2  # two regions, one prepared stream each
    assert all(any(getattr(step, "fast", None) is not None for step in p.steps) for p in runtime._PREPARED.values())
    for x, want in zip(xs, first):  # now on the prepared steps
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)
    monkeypatch.setattr(runtime, "_PREPARED_BYTES", 1)
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(xs[0])).numpy(), first[0])
    assert len(runtime._PREPARED) == 1
