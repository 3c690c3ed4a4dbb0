"""Dependencies between commands (format 2.4), the hazards they must order, and the engines' schedule.

The two-layer stream below is built by hand; its schedule is worked out by hand from npu-256's numbers
(DMA: 64 cycles of latency + bytes / 8; a 1x1 convolution of 16 -> 16 channels over 4x4 pixels: 32 cycles of
issue overhead + max(16 array cycles, 256 outputs / 8 lanes = 32) = 64 cycles).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from simulator import BufferKind, CommandStream, get_config, run_stream
from simulator.errors import StreamError
from simulator.hazards import check_dependencies, dependencies
from simulator.isa import Buffer, Command
from simulator.opcodes import Engine
from simulator.stream import decode_stream, encode_stream
from simulator.timeline import schedule

from layer_streams import conv_1x1_4x4, conv_constants
from layer_streams import dma_command as _dma

CONFIG = get_config("npu-256")
PIXELS, CHANNELS = 16, 16
FMAP_BYTES = PIXELS * CHANNELS  # 256
WEIGHT_BYTES = CHANNELS * CHANNELS  # 256
TABLE_BYTES = CHANNELS * 3 * 4  # 192


def _conv(ifm: int, weights: int, table: int, ofm: int, layer: str) -> Command:
    return conv_1x1_4x4(ifm, weights, table, ofm, layer, CHANNELS)


def _buffers() -> tuple[Buffer, ...]:
    table, weights = conv_constants(CHANNELS)
    return (Buffer("x", BufferKind.INPUT, FMAP_BYTES, shape=(1, 4, 4, CHANNELS)),
            Buffer("y", BufferKind.OUTPUT, FMAP_BYTES, shape=(1, 4, 4, CHANNELS)),
            Buffer("w1", BufferKind.CONSTANT, WEIGHT_BYTES, data=weights[0]),
            Buffer("w2", BufferKind.CONSTANT, WEIGHT_BYTES, data=weights[1]),
            Buffer("t", BufferKind.CONSTANT, TABLE_BYTES, data=table))


def two_layers() -> list[Command]:
    """Layer 2's constants are loaded into their own SRAM while layer 1 computes (a prefetch)."""
    return [_dma(0, 0, FMAP_BYTES), _dma(2, 256, WEIGHT_BYTES), _dma(4, 512, TABLE_BYTES),
            _conv(0, 256, 512, 1024, "conv1"),
            _dma(3, 2048, WEIGHT_BYTES), _dma(4, 2304, TABLE_BYTES),
            _conv(1024, 2048, 2304, 3072, "conv2"),
            _dma(1, 3072, FMAP_BYTES, to_sram=False)]


def _stream(commands) -> CommandStream:
    return CommandStream("two_layers", CONFIG, _buffers(), tuple(commands))


def test_dependencies_are_the_fewest_that_order_every_hazard():
    deps = [c.deps for c in dependencies(two_layers(), CONFIG)]
    # conv1 waits for its last load (the earlier loads precede it on the in-order DMA engine); the prefetches
    # touch nothing conv1 uses; conv2 waits for its table; the store waits for conv2.
    assert deps == [(), (), (), (2,), (), (), (5,), (6,)]


def test_two_layer_makespan_is_the_hand_computed_schedule():
    stream = _stream(dependencies(two_layers(), CONFIG))
    slots = schedule(stream, CONFIG)
    expected = [  # (engine, start, end)
        (Engine.DMA, 0, 96),        # x: 64 + 256 / 8
        (Engine.DMA, 96, 192),      # w1
        (Engine.DMA, 192, 280),     # table: 64 + 192 / 8
        (Engine.COMPUTE, 280, 344),  # conv1 after the table
        (Engine.DMA, 280, 376),     # w2 overlaps conv1
        (Engine.DMA, 376, 464),     # table again, for conv2
        (Engine.COMPUTE, 464, 528),  # conv2 waits for it (conv1 ended at 344)
        (Engine.DMA, 528, 624),     # y after conv2
    ]
    assert [(s.engine, s.start, s.end) for s in slots] == expected
    outputs, stats = run_stream(stream, {"x": np.ones((1, 4, 4, CHANNELS), np.int8)})
    assert stats.total_cycles == 624
    assert sum(c.cycles for c in stats.commands) == 688  # the same commands run serially
    assert stats.busy_cycles(Engine.DMA) == 560 and stats.busy_cycles(Engine.COMPUTE) == 128
    assert [(c.start, c.end) for c in stats.commands] == [(s, e) for _, s, e in expected]


def test_without_dependencies_a_stream_runs_serially():
    """An older stream (no ``deps``): every command waits for the previous one, whatever its engine."""
    slots = schedule(_stream(two_layers()), CONFIG)
    assert [s.start for s in slots] == [0, 96, 192, 280, 344, 440, 528, 592]
    assert slots[-1].end == 688


def test_the_same_outputs_with_or_without_overlap():
    x = np.random.default_rng(1).integers(-128, 128, (1, 4, 4, CHANNELS), dtype=np.int8)
    serial, _ = run_stream(_stream(two_layers()), {"x": x})
    overlapped, _ = run_stream(_stream(dependencies(two_layers(), CONFIG)), {"x": x})
    assert np.array_equal(serial["y"], overlapped["y"])


def _drop(commands, index: int, dep: int):
    c = commands[index]
    return commands[:index] + (dataclasses.replace(c, deps=tuple(d for d in c.deps if d != dep)),) \
        + commands[index + 1:]


@pytest.mark.parametrize("index, dep, message", [
    # Without its one dependency conv1 is unordered with all three loads; its input is named first.
    (3, 2, "command 3 (CONV2D) reads SRAM [0, 256) while command 0 (DMA_COPY) may still be using it: "
           "it must depend on command 0"),
    # conv2's input comes from conv1 (the same in-order engine); its weights are the first unordered read.
    (6, 5, "command 6 (CONV2D) reads SRAM [2048, 2304) while command 4 (DMA_COPY) may still be using it"),
    (7, 6, "command 7 (DMA_COPY) reads SRAM [3072, 3328) while command 6 (CONV2D) may still be using it"),
])
def test_a_missing_dependency_is_rejected(index, dep, message):
    commands = _drop(dependencies(two_layers(), CONFIG), index, dep)
    with pytest.raises(StreamError, match=re.escape(message)):
        check_dependencies(_stream(commands), CONFIG)
    with pytest.raises(StreamError, match="must depend on"):
        run_stream(_stream(commands), {"x": np.zeros((1, 4, 4, CHANNELS), np.int8)})


def test_overwriting_what_a_running_command_reads_needs_a_dependency():
    """Write after read: a DMA may not load new data over conv1's input while conv1 may still read it."""
    commands = two_layers()[:4] + [_dma(0, 0, FMAP_BYTES)]
    derived = dependencies(commands, CONFIG)
    assert derived[4].deps == (3,)
    with pytest.raises(StreamError, match=r"command 4 \(DMA_COPY\) writes SRAM \[0, 256\) while command 3"):
        check_dependencies(_stream(_drop(derived, 4, 3)), CONFIG)


def test_a_dependency_through_a_chain_is_enough():
    """The store depends on conv2 only; conv2 depends on the table load, so the store is ordered after every
    load too, and no extra dependency is derived or required."""
    derived = dependencies(two_layers(), CONFIG)
    assert derived[7].deps == (6,)
    check_dependencies(_stream(derived), CONFIG)


@pytest.mark.parametrize("deps, message", [((3,), "depends on command 3, which does not come before it"),
                                           ((9,), "depends on command 9"), ((1, 1), "names a dependency twice")])
def test_malformed_dependency_lists_are_rejected(deps, message):
    commands = list(dependencies(two_layers(), CONFIG))
    commands[3] = dataclasses.replace(commands[3], deps=deps)
    with pytest.raises(StreamError, match=message):
        check_dependencies(_stream(commands), CONFIG)


def test_dependencies_round_trip_and_older_formats_refuse_them():
    stream = _stream(dependencies(two_layers(), CONFIG))
    decoded = decode_stream(encode_stream(stream))
    assert [c.deps for c in decoded.commands] == [c.deps for c in stream.commands]
    assert decoded == stream
    with pytest.raises(StreamError, match="format 2.3 cannot carry command dependencies"):
        encode_stream(dataclasses.replace(stream, version=(2, 3)))
    old = decode_stream(encode_stream(dataclasses.replace(_stream(two_layers()), version=(2, 3))))
    assert all(c.deps is None for c in old.commands)
    assert schedule(old, CONFIG)[-1].end == 688


def test_the_array_dataflow_fields_need_format_2_4():
    """SCALE-Sim's array (``fold_fill_cycles``, ``parallel_depthwise``) is timed otherwise: a 2.3 stream cannot
    say so, in either direction."""
    import simulator.stream

    scalesim = get_config("scalesim-16x16")
    stream = CommandStream("one", scalesim, _buffers(), tuple(two_layers()))
    assert decode_stream(encode_stream(stream)).config == scalesim
    older = dataclasses.replace(stream, version=(2, 3))
    with pytest.raises(StreamError, match=r"format 2.3 cannot carry fold_fill_cycles=46, parallel_depthwise=False"):
        encode_stream(older)
    with pytest.MonkeyPatch.context() as patch:  # a writer that wrongly thought 2.3 had them
        patch.setattr(simulator.stream, "ARRAY_FIELDS_SINCE", (2, 3))
        forged = encode_stream(older)
    with pytest.raises(StreamError, match=r"fold_fill_cycles=46, parallel_depthwise=False is not defined in "
                                          r"format 2.3"):
        decode_stream(forged)
