"""The MAC array's dataflows, priced by hand (docs/cycle_model.md states every formula).

Symbols: R = mac_rows, C = mac_cols, L = output_lanes, O = command_overhead_cycles, F = fold_fill_cycles,
P = output pixels. A MAC-array command costs O + max(folds * max(P + F, C), ceil(outputs / L)).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layer_streams import random_params, run_layer
from npu_backend.params import NpuOp
from simulator import ConfigError, Opcode, decode_stream, encode_stream, get_config
from simulator.cycles import conv2d_cost, depthwise_cost, fully_connected_cost
from simulator.isa import Buffer, BufferKind, CommandStream, Convolution, FeatureMap

NPU256 = get_config("npu-256")  # R = C = 16, L = 8, O = 32, F = 0, depthwise R channels at a time
SCALESIM = get_config("scalesim-16x16")  # R = C = 16, L = 16, O = 0, F = 46, depthwise one channel at a time


def _conv(ifm: tuple[int, int, int], ofm: tuple[int, int, int], kernel=(1, 1), stride=(1, 1), padding=(0, 0, 0, 0)):
    return Convolution(FeatureMap(0, *ifm), FeatureMap(65536, *ofm), 131072, 196608, kernel=kernel, stride=stride,
                       padding=padding)


def test_the_presets_keep_their_hardware_and_fingerprints():
    """The new fields sit at their defaults on the existing presets, which keep the fingerprints their streams
    carry (the values before the fields existed)."""
    assert {name: get_config(name).fingerprint for name in ("npu-256", "npu-1024", "npu-tiny")} == {
        "npu-256": "1f821e8639b70474", "npu-1024": "be43b99d0bc10901", "npu-tiny": "04508db69e9bfd8b"}
    assert all((get_config(n).fold_fill_cycles, get_config(n).parallel_depthwise) == (0, True)
               for n in ("npu-256", "npu-1024", "npu-tiny"))
    assert SCALESIM.fold_fill_cycles == 2 * SCALESIM.mac_cols + SCALESIM.mac_rows - 2 == 46


def test_depthwise_spreads_the_kernel_taps_across_the_columns():
    """8x8x20, 3x3: 9 taps fit the 16 columns in one pass, 20 channels take two groups of 16 rows: the array
    needs 2 * 64 = 128 cycles, the output stage 64 * 20 / 8 = 160, which binds. 5x5: 25 taps take two
    passes, so 2 * 2 * 64 = 256 array cycles bind. (On one column, as before, the 5x5 cost 64 * 25 * 2.)"""
    three = _conv((8, 8, 20), (8, 8, 20), kernel=(3, 3), padding=(1, 1, 1, 1))
    five = _conv((8, 8, 20), (8, 8, 20), kernel=(5, 5), padding=(2, 2, 2, 2))
    assert depthwise_cost(Opcode.DEPTHWISE_CONV2D, three, NPU256).cycles == 32 + 160
    cost = depthwise_cost(Opcode.DEPTHWISE_CONV2D, five, NPU256)
    assert (cost.cycles, cost.macs) == (32 + 256, 64 * 25 * 20)


def test_a_three_channel_first_convolution_folds_the_taps_into_the_reduction():
    """16x16x3 -> 8x8x8, 3x3 stride 2: the window is 27 elements, ceil(27 / 16) = 2 column passes (not nine,
    one per tap with 3 of 16 columns busy), one row pass: 2 * 64 = 128 array cycles against 64 * 8 / 8 = 64
    for the output stage. Where K is a multiple of C the fold changes nothing: 16 channels, 3x3 is 9 passes."""
    first = _conv((16, 16, 3), (8, 8, 8), kernel=(3, 3), stride=(2, 2), padding=(0, 0, 1, 1))
    cost = conv2d_cost(Opcode.CONV2D, first, NPU256)
    assert (cost.cycles, cost.macs) == (32 + 128, 64 * 27 * 8)
    deep = _conv((8, 8, 16), (8, 8, 16), kernel=(3, 3), padding=(1, 1, 1, 1))
    assert conv2d_cost(Opcode.CONV2D, deep, NPU256).cycles == 32 + 9 * 64


def test_a_fold_lasts_at_least_the_load_of_its_weights():
    """A fully connected layer of one row uses each weight once: 1280 -> 1000 is ceil(1280 / 16) *
    ceil(1000 / 16) = 5040 folds, each bound by the 16 cycles its 256 weights take to enter the array (one per
    row per cycle), not by its one streamed row: 5040 * 16 = 80640 (the output stage needs 125). Four rows
    stream in 4 cycles, still under the load: the same 80640. (Before, 5040 and 20160 cycles: 256 weights
    a cycle.)"""
    one = _conv((1, 1, 1280), (1, 1, 1000))
    four = _conv((4, 1, 1280), (4, 1, 1000))
    assert fully_connected_cost(Opcode.FULLY_CONNECTED, one, NPU256).cycles == 32 + 80640
    assert fully_connected_cost(Opcode.FULLY_CONNECTED, four, NPU256).cycles == 32 + 80640


def test_the_scalesim_preset_pays_a_fill_per_fold_and_runs_depthwise_a_channel_at_a_time():
    """MobileNetV2-0.35-96's layers on SCALE-Sim's 16x16 weight-stationary array; each fold costs P + 46.
    SCALE-Sim 3.0.0 reports one cycle less per layer it simulates (it counts the last cycle's index):
    2349, 4699, 16 x 2349 and 236879 (bench/bench_scalesim.py)."""
    pointwise = _conv((48, 48, 16), (48, 48, 8))  # window 16: one fold of 2304 pixels
    first = _conv((97, 97, 3), (48, 48, 16), kernel=(3, 3), stride=(2, 2))  # window 27: two folds
    depthwise = _conv((50, 50, 16), (48, 48, 16), kernel=(3, 3))  # 16 channels, one fold each
    classifier = _conv((1, 1, 1280), (1, 1, 1000))  # ceil(1280 / 16) * ceil(1000 / 16) = 5040 folds of 1 row
    assert conv2d_cost(Opcode.CONV2D, pointwise, SCALESIM).cycles == 2304 + 46 == 2350
    assert conv2d_cost(Opcode.CONV2D, first, SCALESIM).cycles == 2 * (2304 + 46) == 4700
    assert depthwise_cost(Opcode.DEPTHWISE_CONV2D, depthwise, SCALESIM).cycles == 16 * (2304 + 46) == 37600
    assert fully_connected_cost(Opcode.FULLY_CONNECTED, classifier, SCALESIM).cycles == 5040 * 47 == 236880


def test_the_dataflow_changes_the_cycles_never_the_results():
    """One depthwise layer lowered and run on both arrays: equal outputs; compute cycles as priced by hand
    (12x12x20, 3x3: npu-256 is bound by its output stage, 32 + 144 * 20 / 8; the systolic array runs 20
    channels of one fold each, 20 * (144 + 46))."""
    rng = np.random.default_rng(3)
    p = random_params(rng, NpuOp.DEPTHWISE_CONV2D, (1, 12, 12, 20))
    x = rng.integers(-128, 128, (1, 12, 12, 20), dtype=np.int8)
    out256, stats256 = run_layer(p, NPU256, x)
    out_ss, stats_ss = run_layer(p, SCALESIM, x)
    np.testing.assert_array_equal(out256, out_ss)
    compute = {name: [c.cycles for c in stats.commands if c.opcode == Opcode.DEPTHWISE_CONV2D]
               for name, stats in (("npu-256", stats256), ("scalesim", stats_ss))}
    assert compute == {"npu-256": [32 + 360], "scalesim": [20 * (144 + 46)]}


def test_the_dataflow_fields_travel_in_the_stream_and_are_validated():
    stream = CommandStream("empty", SCALESIM, (Buffer("out", BufferKind.OUTPUT, 16, shape=(16,)),), ())
    decoded = decode_stream(encode_stream(stream))
    assert decoded.config == SCALESIM and decoded.config.fingerprint == SCALESIM.fingerprint
    assert decoded.config.differences(NPU256)[-2:] == ["fold_fill_cycles: 46 != 0", "parallel_depthwise: False != True"]
    with pytest.raises(ConfigError, match="latencies cannot be negative"):
        dataclasses.replace(NPU256, fold_fill_cycles=-1)
    with pytest.raises(ConfigError, match="parallel_depthwise must be true or false, got 0"):
        dataclasses.replace(NPU256, parallel_depthwise=0)
