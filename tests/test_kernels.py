"""Simulator kernels + codegen tiling against the slow per-element reference.

Small SRAM configurations force the planner to split output rows and output
channels, so DMA strides, halos and tile padding are exercised, not only the
single-tile path.
"""

import dataclasses
import zlib

import numpy as np
import pytest

from layer_streams import random_params, reference_layer, run_layer
from npu_backend.tiling import plan_layer
from npu_backend.params import NpuOp
from simulator import Opcode, get_config

BASE = get_config("npu-256")
TINY_SRAM = dataclasses.replace(BASE, name="sram-1k", sram_bytes=1024)

CASES = {
    "conv3x3_s1_same": dict(op=NpuOp.CONV2D, ifm_shape=(1, 9, 7, 5), out_channels=6),
    "conv3x3_s2_asym_pad": dict(op=NpuOp.CONV2D, ifm_shape=(1, 11, 13, 3), out_channels=4, strides=(2, 2),
                                padding=(0, 0, 1, 1), clamp=(-20, 127)),
    "conv5x5_dilated": dict(op=NpuOp.CONV2D, ifm_shape=(1, 12, 12, 4), out_channels=5, kernel=(5, 5),
                            dilation=(2, 2), padding=(4, 4, 4, 4)),
    "conv1x1_per_tensor": dict(op=NpuOp.CONV2D, ifm_shape=(1, 6, 6, 16), out_channels=24, kernel=(1, 1),
                               padding=(0, 0, 0, 0), per_channel=False),
    "depthwise_s1": dict(op=NpuOp.DEPTHWISE_CONV2D, ifm_shape=(1, 10, 10, 12), clamp=(-128, 40)),
    "depthwise_s2_valid": dict(op=NpuOp.DEPTHWISE_CONV2D, ifm_shape=(1, 9, 9, 8), strides=(2, 2),
                               padding=(0, 0, 0, 0)),
    "fully_connected": dict(op=NpuOp.FULLY_CONNECTED, ifm_shape=(3, 40), out_channels=12),
    "fully_connected_per_tensor": dict(op=NpuOp.FULLY_CONNECTED, ifm_shape=(1, 64), out_channels=10,
                                       per_channel=False),
}


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_reference(case, config):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    p = random_params(rng, **CASES[case])
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    np.testing.assert_array_equal(got, reference_layer(p, x))
    compute = [c for c in stats.commands if c.opcode != Opcode.DMA_COPY]
    assert sum(c.macs for c in compute) == stats.total_macs > 0
    if config is TINY_SRAM and case in ("conv3x3_s1_same", "depthwise_s1", "conv1x1_per_tensor"):
        assert len(compute) > 1, "small SRAM must force more than one tile"


def test_planner_splits_channels_when_rows_alone_do_not_fit():
    p = random_params(np.random.default_rng(0), NpuOp.CONV2D, (1, 8, 8, 8), out_channels=256)
    plan = plan_layer(p, TINY_SRAM)
    assert plan.channel_tile < 256 and plan.sram_used <= TINY_SRAM.sram_bytes


def test_float64_rounding_fully_connected_matches_reference():
    """Per-channel FC requantizes in double (TFLite's reference kernel), one tile and tiled."""
    import reference_kernels as ref
    from simulator.numerics import Rounding

    rng = np.random.default_rng(11)
    p = dataclasses.replace(random_params(rng, NpuOp.FULLY_CONNECTED, (4, 48), out_channels=20),
                            rounding=Rounding.FLOAT64)
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    want = ref.fully_connected_float(x.tolist(), p.weights.tolist(), p.bias.tolist(), p.input_scale,
                                     [float(s) for s in p.weight_scales], p.output_scale,
                                     p.input_zero_point, p.output_zero_point, p.clamp)
    for config in (BASE, TINY_SRAM):
        got, _ = run_layer(p, config, x)
        np.testing.assert_array_equal(got, np.array(want, dtype=np.int8))


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
def test_add_matches_reference(config):
    import reference_kernels as ref
    from npu_backend.params import ElementwiseParams

    rng = np.random.default_rng(5)
    p = ElementwiseParams(op=NpuOp.ADD, shape=(1, 9, 11, 7), input_scale=float(np.float32(0.031)), input_zero_point=-7,
                  input2_scale=float(np.float32(0.017)), input2_zero_point=12,
                  output_scale=float(np.float32(0.04)), output_zero_point=3, clamp=(-100, 127))
    x1, x2 = (rng.integers(-128, 128, p.shape, dtype=np.int8) for _ in range(2))
    got, stats = run_layer(p, config, x1, x2)
    want = ref.add(x1.ravel().tolist(), x2.ravel().tolist(), p.input_scale, -7, p.input2_scale, 12,
                   p.output_scale, 3, p.clamp)
    np.testing.assert_array_equal(got.ravel(), np.array(want, dtype=np.int8))
    assert sum(c.opcode == Opcode.ADD for c in stats.commands) == (1 if config is BASE else 3)


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
def test_mean_matches_reference(config):
    import reference_kernels as ref
    from npu_backend.params import MeanParams

    rng = np.random.default_rng(6)
    p = MeanParams(op=NpuOp.MEAN, ifm_shape=(1, 7, 5, 40), ofm_shape=(1, 40),
                   input_scale=float(np.float32(0.02)), input_zero_point=-9,
                   output_scale=float(np.float32(0.011)), output_zero_point=4)
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    want = ref.mean_hw(x[0].tolist(), p.input_scale, -9, p.output_scale, 4)
    np.testing.assert_array_equal(got.ravel(), np.array(want, dtype=np.int8))
    assert sum(c.opcode == Opcode.MEAN for c in stats.commands) == (1 if config is BASE else 2)


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_matches_reference(kind, config):
    import reference_kernels as ref
    from npu_backend.params import PoolParams

    rng = np.random.default_rng(8)
    p = PoolParams(op=NpuOp.MAX_POOL2D if kind == "max" else NpuOp.AVG_POOL2D, ifm_shape=(1, 11, 10, 24),
                   ofm_shape=(1, 6, 5, 24), kernel=(3, 3), strides=(2, 2), padding=(1, 0, 1, 1), clamp=(-100, 110))
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    want = ref.pool(x[0].tolist(), kind, p.kernel, p.strides, p.padding, p.clamp)
    np.testing.assert_array_equal(got, np.array(want, dtype=np.int8)[None])
    assert (len(stats.commands) > 3) == (config is TINY_SRAM)


def _one_command_run(opcode, make_payload, inputs: dict, out_shape, config=BASE):
    """Run one compute command on DRAM inputs: DMA each input into SRAM back to back, then the command, then
    the output back. ``make_payload`` gets the SRAM FeatureMaps (inputs in order, then the output)."""
    from simulator import Buffer, BufferKind, Command, CommandStream, DmaCopy, FeatureMap, MemorySpace, run_stream

    buffers, commands, fmaps, address = [], [], [], 0
    for index, (name, value) in enumerate(inputs.items()):
        buffers.append(Buffer(name, BufferKind.INPUT, value.size, shape=value.shape))
        commands.append(Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.DRAM, index, 0, MemorySpace.SRAM, -1, address,
                                                         value.size)))
        fmaps.append(FeatureMap(address, *value.shape[-3:]))
        address += value.size
    out_size = int(np.prod(out_shape))
    buffers.append(Buffer("ofm", BufferKind.OUTPUT, out_size, shape=tuple(out_shape)))
    fmaps.append(FeatureMap(address, *out_shape[-3:]))
    commands.append(Command(opcode, make_payload(*fmaps)))
    commands.append(Command(Opcode.DMA_COPY, DmaCopy(MemorySpace.SRAM, -1, address, MemorySpace.DRAM, len(inputs), 0,
                                                     out_size)))
    stream = CommandStream("one_command", config.name, tuple(buffers), tuple(commands))
    outputs, stats = run_stream(stream, inputs, config)
    return outputs["ofm"], stats


@pytest.mark.parametrize("opcode", [Opcode.SUB, Opcode.MUL])
def test_sub_and_mul_kernels_match_reference(opcode):
    import reference_kernels as ref
    from simulator.isa import Elementwise
    from simulator.numerics import mul_multiplier, sub_multipliers

    rng = np.random.default_rng(int(opcode))
    shape = (1, 9, 11, 7)
    x1, x2 = (rng.integers(-128, 128, shape, dtype=np.int8) for _ in range(2))
    s1, s2, so = (float(np.float32(s)) for s in (0.031, 0.017, 0.012))
    zp1, zp2, zpo, clamp = -7, 12, 3, (-100, 120)
    if opcode == Opcode.SUB:
        m1, sh1, m2, sh2, mo, sho = sub_multipliers(s1, s2, so)
        left_shift = 20
        want = ref.sub(x1.ravel().tolist(), x2.ravel().tolist(), s1, zp1, s2, zp2, so, zpo, clamp)
    else:
        (mo, sho), (m1, sh1, m2, sh2, left_shift) = mul_multiplier(s1, s2, so), (0, 0, 0, 0, 0)
        want = ref.mul(x1.ravel().tolist(), x2.ravel().tolist(), s1, zp1, s2, zp2, so, zpo, clamp)

    def payload(ifm, ifm2, ofm):
        return Elementwise(ifm, ifm2, ofm, zp1, zp2, zpo, m1, sh1, m2, sh2, mo, sho, left_shift, *clamp)

    got, stats = _one_command_run(opcode, payload, {"ifm": x1, "ifm2": x2}, shape)
    np.testing.assert_array_equal(got.ravel(), np.array(want, dtype=np.int8))
    assert [c.opcode for c in stats.commands].count(opcode) == 1


def test_softmax_kernel_matches_reference_per_pixel():
    """Softmax runs over the channels of each pixel: 5 x 7 pixels are 35 independent rows of 13."""
    import reference_kernels as ref
    from simulator.isa import Softmax
    from simulator.softmax import softmax_params

    rng = np.random.default_rng(9)
    shape, scale = (1, 5, 7, 13), float(np.float32(0.09))
    x = rng.integers(-128, 128, shape, dtype=np.int8)
    params = softmax_params(scale)
    got, stats = _one_command_run(Opcode.SOFTMAX, lambda ifm, ofm: Softmax(ifm, ofm, *params), {"ifm": x}, shape)
    want = ref.softmax(x.reshape(-1, 13).tolist(), scale)
    np.testing.assert_array_equal(got.reshape(-1, 13), np.array(want, dtype=np.int8))
    (cost,) = [c for c in stats.commands if c.opcode == Opcode.SOFTMAX]
    assert cost.cycles > 35 * 3  # at least three passes over every row


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("multiplier, strides", [(2, (1, 1)), (3, (2, 2))])
def test_depthwise_channel_multiplier_equals_the_reference(config, multiplier, strides):
    """TFLite's depth multiplier: output channel o reads input channel o // m. Tiles hold whole groups of m
    outputs of one input channel; the 1 KiB SRAM splits the 48 output channels."""
    rng = np.random.default_rng(11 + multiplier)
    p = random_params(rng, NpuOp.DEPTHWISE_CONV2D, (1, 9, 7, 16), strides=strides, multiplier=multiplier)
    assert p.out_channels == 16 * multiplier
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    np.testing.assert_array_equal(got, reference_layer(p, x))
    if config is TINY_SRAM:
        tile = plan_layer(p, config).channel_tile
        assert tile < p.out_channels and tile % multiplier == 0
