"""Narrow accumulators: the register of ``accumulator_bits`` wraps or saturates the exact sum, every
overflowed output element is counted per command, and the count reaches the profile and the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
import reference_kernels as ref
from layer_streams import layer_stream, random_params, run_layer
from npu_backend.params import ConvParams, MeanParams, NpuOp, PoolParams
from relax_idioms import ConvIdiom
from simulator import FORMAT_VERSION, ConfigError, Opcode, StreamError, decode_stream, encode_stream, get_config, run_stream
from simulator.config import NpuConfig, load_config

BASE = get_config("npu-256")
WRAP14 = dataclasses.replace(BASE, name="npu-256-acc14", accumulator_bits=14)
SAT14 = dataclasses.replace(BASE, name="npu-256-acc14s", accumulator_bits=14, accumulator_overflow="saturate")
TINY_SRAM = dataclasses.replace(BASE, name="sram-1k", sram_bytes=1024)

# A fully connected layer whose exact accumulators probe the 14-bit range [-8192, 8191] at its edges and
# far past them. Scales make the requantization a division by 128 (0.125 * 0.0625 / 1.0 = 2**-7), and
# no result below is a rounding tie, so every expected value is round(acc / 128).
FC_X = np.array([[127, 127, 127, 127], [-128, -128, -128, -127]], np.int8)
FC_W = np.array([[16] * 4, [16] * 4, [127] * 4, [-127] * 4, [16] * 4, [16] * 4], np.int8)
FC_BIAS = np.array([63, 64, 0, 0, -16, -17], np.int32)
FC_EXACT = [[8191, 8192, 64516, -64516, 8112, 8111],      # row 0: 508 * w + bias (w = 16 or +-127)
            [-8113, -8112, -64897, 64897, -8192, -8193]]   # row 1: -511 * w + bias
FC_OVERFLOWS = 6  # 8192, +-64516, +-64897, -8193; 8191 and -8192 fit exactly
FC_EXPECTED = {
    # wrapped: 8192 -> -8192, 64516 -> -1020, -64516 -> 1020, -64897 -> 639, 64897 -> -639, -8193 -> 8191
    WRAP14: [[64, -64, -8, 8, 63, 63], [-63, -63, 5, -5, -64, 64]],
    # saturated to 8191 / -8192, then / 128
    SAT14: [[64, 64, 64, -64, 63, 63], [-63, -63, -64, 64, -64, -64]],
    # 32 bits: nothing overflows, the large sums clamp to int8 in the output stage
    BASE: [[64, 64, 127, -128, 63, 63], [-63, -63, -128, 127, -64, -64]],
}


def _fc_params() -> ConvParams:
    return ConvParams(op=NpuOp.FULLY_CONNECTED, ifm_shape=(2, 4), ofm_shape=(2, 6), input_scale=0.125,
                      input_zero_point=0, weight_scales=np.full(6, 0.0625, np.float32),
                      weight_zero_points=np.zeros(6, np.int32), per_channel=True, weights=FC_W, bias=FC_BIAS,
                      output_scale=1.0, output_zero_point=0, clamp=(-128, 127))


def test_the_constructed_case_is_what_its_comments_say():
    exact = FC_X.astype(np.int64) @ FC_W.T.astype(np.int64) + FC_BIAS
    np.testing.assert_array_equal(exact, FC_EXACT)
    assert np.count_nonzero((exact < -8192) | (exact > 8191)) == FC_OVERFLOWS


@pytest.mark.parametrize("config", [WRAP14, SAT14, BASE], ids=["wrap14", "saturate14", "wrap32"])
def test_fully_connected_overflow_values_and_count(config):
    out, stats = run_layer(_fc_params(), config, FC_X)
    np.testing.assert_array_equal(out, np.array(FC_EXPECTED[config], np.int8))
    (fc,) = [c for c in stats.commands if c.opcode == Opcode.FULLY_CONNECTED]
    assert fc.overflows == stats.total_overflows == (0 if config is BASE else FC_OVERFLOWS)
    assert all(c.overflows == 0 for c in stats.commands if c.opcode == Opcode.DMA_COPY)
    assert stats.per_layer()[fc.layer]["overflows"] == fc.overflows


def _narrow(value: int, bits: int, overflow: str) -> int:
    half = 1 << (bits - 1)
    return ((value + half) % (2 * half)) - half if overflow == "wrap" else min(max(value, -half), half - 1)


@pytest.mark.parametrize("overflow", ["wrap", "saturate"])
def test_tiled_conv_matches_the_slow_reference_with_a_narrow_register(overflow):
    """A conv split into several commands (1 KiB SRAM): the counts over its tiles add up to the reference's
    number of out-of-range accumulators, and every output is the reference's narrowed value requantized."""
    config = dataclasses.replace(TINY_SRAM, name=f"sram-1k-acc16-{overflow}", accumulator_bits=16,
                                 accumulator_overflow=overflow)
    rng = np.random.default_rng(zlib.crc32(b"narrow conv"))
    p = random_params(rng, NpuOp.CONV2D, (1, 9, 7, 5), out_channels=6)
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    got, stats = run_layer(p, config, x)
    accs = ref._conv2d_accumulators(x[0].tolist(), p.weights.tolist(), p.bias.tolist(), p.input_zero_point,
                                    p.strides, p.dilation, p.padding, depthwise=False)
    mult, shift = ref.conv_multipliers(p.input_scale, [float(s) for s in p.weight_scales], p.output_scale)
    want = [[[min(max(ref.multiply_by_quantized_multiplier(_narrow(acc, 16, overflow), mult[oc], shift[oc])
                      + p.output_zero_point, p.clamp[0]), p.clamp[1]) for oc, acc in enumerate(pixel)]
             for pixel in row] for row in accs]
    overflowed = sum(not -(1 << 15) <= acc < (1 << 15) for row in accs for pixel in row for acc in pixel)
    assert overflowed > 0 and sum(c.opcode == Opcode.CONV2D for c in stats.commands) > 1
    assert stats.total_overflows == overflowed
    np.testing.assert_array_equal(got, np.array(want, np.int8)[None])


def test_mean_accumulator_wraps_saturates_and_counts():
    """MEAN sums height * width inputs in the MAC array's accumulator: 144 x 127 = 18288 and
    144 x -128 = -18432 overflow 14 bits, 144 x 56 = 8064 fits."""
    p = MeanParams(op=NpuOp.MEAN, ifm_shape=(1, 12, 12, 4), ofm_shape=(1, 1, 1, 4), input_scale=0.05,
                   input_zero_point=0, output_scale=0.05, output_zero_point=0)
    x = np.broadcast_to(np.array([127, 0, -128, 56], np.int8), p.ifm_shape).copy()
    # wrap: 18288 -> 1904 (/144 = 13.2), -18432 -> -2048 (-14.2); saturate: 8191 (56.9), -8192 (-56.9)
    for config, want, count in ((WRAP14, [13, 0, -14, 56], 2), (SAT14, [57, 0, -57, 56], 2),
                                (BASE, [127, 0, -128, 56], 0)):
        out, stats = run_layer(p, config, x)
        assert out.reshape(-1).tolist() == want
        assert [c.overflows for c in stats.commands if c.opcode == Opcode.MEAN] == [count]


def test_avg_pool_window_sum_wraps_saturates_and_counts():
    """AVG_POOL2D holds its window sum in a register too: a 16 x 16 window of 127 sums to 32512 and of
    -128 to -32768, both past 14 bits; of 31 to 7936, which fits."""
    p = PoolParams(op=NpuOp.AVG_POOL2D, ifm_shape=(1, 16, 16, 3), ofm_shape=(1, 1, 1, 3), kernel=(16, 16),
                   strides=(1, 1), padding=(0, 0, 0, 0))
    x = np.broadcast_to(np.array([127, -128, 31], np.int8), p.ifm_shape).copy()
    # wrap: 32512 -> -256 (/256 = -1), -32768 -> 0; saturate: 8191 (32.0 after rounding), -8192 (-32)
    for config, want, count in ((WRAP14, [-1, 0, 31], 2), (SAT14, [32, -32, 31], 2), (BASE, [127, -128, 31], 0)):
        out, stats = run_layer(p, config, x)
        assert out.reshape(-1).tolist() == want
        assert [c.overflows for c in stats.commands if c.opcode == Opcode.AVG_POOL2D] == [count]


@pytest.mark.parametrize("field, value, message", [
    ("accumulator_bits", 13, r"accumulator_bits must be in \[14, 32\], got 13"),
    ("accumulator_bits", 33, r"accumulator_bits must be in \[14, 32\], got 33"),
    ("accumulator_overflow", "clip", "accumulator_overflow must be one of 'wrap', 'saturate', got 'clip'"),
    ("accumulator_overflow", 1, "accumulator_overflow must be a string, got 1"),
])
def test_invalid_accumulator_settings_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(BASE, **{field: value})


def test_the_limits_themselves_are_valid():
    assert dataclasses.replace(BASE, accumulator_bits=14).accumulator_bits == 14
    assert dataclasses.replace(BASE, accumulator_bits=32).accumulator_bits == 32


def test_overflow_mode_is_part_of_the_hardware():
    assert SAT14.values()["accumulator_overflow"] == "saturate"
    assert SAT14.fingerprint != dataclasses.replace(SAT14, accumulator_overflow="wrap").fingerprint
    assert SAT14.differences(WRAP14) == ["accumulator_overflow: saturate != wrap"]


def test_a_wrapping_configuration_keeps_its_fingerprint_from_before_the_field():
    """Streams written before format 2.1 carry fingerprints over the numbers without the new field (nor the
    cost-only fields added later, ``fold_fill_cycles`` and ``parallel_depthwise``, at their defaults)."""
    numbers = {k: v for k, v in BASE.values().items()
               if k not in ("accumulator_overflow", "fold_fill_cycles", "parallel_depthwise")}
    assert BASE.fingerprint == hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:16]


def test_json_and_toml_round_trip(tmp_path):
    assert NpuConfig.from_json(SAT14.to_json()) == SAT14
    toml = tmp_path / "narrow.toml"
    toml.write_text('base = "npu-256"\naccumulator_bits = 14\naccumulator_overflow = "saturate"\n')
    assert load_config(toml, register=False) == dataclasses.replace(SAT14, name="narrow")
    (tmp_path / "bad.toml").write_text('base = "npu-256"\naccumulator_overflow = "clip"\n')
    with pytest.raises(ConfigError, match="accumulator_overflow must be one of"):
        load_config(tmp_path / "bad.toml", register=False)


def test_the_stream_carries_the_mode_and_runs_only_on_it():
    stream = layer_stream(_fc_params(), SAT14)
    decoded = decode_stream(encode_stream(stream))
    assert decoded.config == SAT14 and decoded.version == FORMAT_VERSION >= (2, 1)
    out, _ = run_stream(decoded, {"ifm": FC_X})
    np.testing.assert_array_equal(out["ofm"], np.array(FC_EXPECTED[SAT14], np.int8))
    with pytest.raises(StreamError, match="accumulator_overflow: saturate != wrap"):
        run_stream(decoded, {"ifm": FC_X}, WRAP14)


@pytest.mark.parametrize("version", [(1, 3), (2, 0)])
def test_older_formats_mean_wrap_and_cannot_carry_saturate(version):
    old = dataclasses.replace(layer_stream(_fc_params(), WRAP14), version=version)
    decoded = decode_stream(encode_stream(old))
    assert decoded.config.accumulator_overflow == "wrap" and decoded == old
    with pytest.raises(StreamError, match=f"format {version[0]}.{version[1]} cannot carry accumulator_overflow"):
        encode_stream(dataclasses.replace(layer_stream(_fc_params(), SAT14), version=version))


def test_schema_enum_matches_the_modes():
    from simulator._generated.AccumulatorOverflow import AccumulatorOverflow
    from simulator.stream import OVERFLOW_CODES

    assert OVERFLOW_CODES == {"wrap": AccumulatorOverflow.WRAP, "saturate": AccumulatorOverflow.SATURATE} \
        == {"wrap": 0, "saturate": 1}


def test_the_compiler_accepts_a_narrow_configuration_and_the_profile_reports_overflows():
    idiom = ConvIdiom(x_shape=(1, 8, 8, 16), out_channels=8)
    partitioned = npu_backend.partition_for_npu(idiom.module(), preset=WRAP14)
    (stream,) = npu_backend.codegen.lower_module(partitioned).values()
    assert stream.config == WRAP14
    vm = relax.VirtualMachine(npu_backend.build(idiom.module(), preset=WRAP14), tvm.cpu())
    x = np.random.default_rng(0).integers(-128, 128, idiom.x_shape, dtype=np.int8)
    with npu_backend.profile() as prof:
        vm["main"](tvm.runtime.tensor(x))
    layers = prof.layers()
    assert prof.total_overflows == sum(row["overflows"] for _, _, row in layers) > 0
    summary = prof.summary().splitlines()
    assert summary[0].endswith("overflows")
    assert summary[-1] == f"accumulator overflows: {prof.total_overflows} (wrap, 14 bits)"
    with npu_backend.profile() as wide:
        relax.VirtualMachine(npu_backend.build(idiom.module()), tvm.cpu())["main"](tvm.runtime.tensor(x))
    assert wide.total_overflows == 0 and "overflow" not in wide.summary()


def test_cli_sim_prints_the_overflow_column_and_line(tmp_path, capsys):
    from npu_backend.cli import main

    path = tmp_path / "fc.npucmd"
    path.write_bytes(encode_stream(layer_stream(_fc_params(), SAT14)))
    np.save(tmp_path / "x.npy", FC_X)
    assert main(["sim", str(path), "--input", f"ifm={tmp_path / 'x.npy'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "overflows"
    fc = next(line for line in lines if "FULLY_CONNECTED" in line)
    assert fc.split()[-1] == str(FC_OVERFLOWS)
    assert lines[-1] == f"accumulator overflows: {FC_OVERFLOWS} (saturate, 14 bits)"
    path.write_bytes(encode_stream(layer_stream(_fc_params(), BASE)))
    assert main(["sim", str(path), "--input", f"ifm={tmp_path / 'x.npy'}"]) == 0
    assert "overflow" not in capsys.readouterr().out
