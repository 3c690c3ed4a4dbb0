"""Compute commands ready sooner moved ahead of one that waits (npu_backend.codegen.reorder.ready_first).

Two tiles of one 1x1 convolution (16 -> 16 channels over 4x4 pixels: 64 cycles each on npu-256), tile B's
weights loaded early, tile A's late behind a 2 KiB load (64 + 2048 / 8 = 320 cycles); B's output is stored
first. In program order A waits for its weights and B waits behind A; B moved first runs while A's
weights load. The schedules below are worked out by hand (DMA: 64 cycles of latency + bytes / 8).
"""

from __future__ import annotations

import numpy as np

from npu_backend.codegen.reorder import ready_first
from simulator import BufferKind, CommandStream, get_config, run_stream
from simulator.hazards import dependencies
from simulator.isa import Buffer, Command
from simulator.timeline import schedule

from layer_streams import conv_1x1_4x4, conv_constants
from layer_streams import dma_command as _dma

CONFIG = get_config("npu-256")
CHANNELS = 16
FMAP = WEIGHTS = 16 * CHANNELS  # 256 bytes each
TABLE = CHANNELS * 3 * 4
X, W_B, T, PAD, W_A, OFM_A, OFM_B = 0, 256, 512, 4096, 2048, 1024, 3072  # SRAM addresses


def _tile(ifm: int, weights: int, ofm: int) -> Command:
    return conv_1x1_4x4(ifm, weights, T, ofm, "tiles", CHANNELS)


def _buffers() -> tuple[Buffer, ...]:
    table, weights = conv_constants(CHANNELS)
    return (Buffer("x", BufferKind.INPUT, FMAP, shape=(1, 4, 4, CHANNELS)),
            Buffer("ya", BufferKind.OUTPUT, FMAP, shape=(1, 4, 4, CHANNELS)),
            Buffer("yb", BufferKind.OUTPUT, FMAP, shape=(1, 4, 4, CHANNELS)),
            Buffer("wa", BufferKind.CONSTANT, WEIGHTS, data=weights[0]),
            Buffer("wb", BufferKind.CONSTANT, WEIGHTS, data=weights[1]),
            Buffer("t", BufferKind.CONSTANT, TABLE, data=table),
            Buffer("pad", BufferKind.CONSTANT, 2048, data=bytes(2048)))


def _program(b_reads: int = X, stores_b_first: bool = True) -> list[Command]:
    stores = [_dma(2, OFM_B, FMAP, to_sram=False), _dma(1, OFM_A, FMAP, to_sram=False)]
    return [_dma(0, X, FMAP), _dma(4, W_B, WEIGHTS), _dma(5, T, TABLE), _dma(6, PAD, 2048), _dma(3, W_A, WEIGHTS),
            _tile(X, W_A, OFM_A), _tile(b_reads, W_B, OFM_B), *(stores if stores_b_first else stores[::-1])]


def _timed(commands) -> tuple[CommandStream, list[tuple[int, int]]]:
    stream = CommandStream("tiles", CONFIG, _buffers(), dependencies(commands, CONFIG))
    return stream, [(s.start, s.end) for s in schedule(stream, CONFIG)]


def test_a_ready_tile_runs_before_one_that_waits_for_its_weights():
    program = _program()
    _, before = _timed(program)
    assert before[5:] == [(696, 760), (760, 824), (824, 920), (920, 1016)]  # A after its weights, B behind A
    reordered = ready_first(program, CONFIG)
    assert reordered == program[:5] + [program[6], program[5]] + program[7:]
    stream, after = _timed(reordered)
    # B once the table has landed (280), A once its weights have (696); B's store while A computes
    assert after[5:] == [(280, 344), (696, 760), (696, 792), (792, 888)]
    x = np.random.default_rng(1).integers(-128, 128, (1, 4, 4, CHANNELS), dtype=np.int8)
    original, _ = run_stream(_timed(program)[0], {"x": x})
    moved, stats = run_stream(stream, {"x": x})
    assert stats.total_cycles == 888
    assert all(np.array_equal(original[name], moved[name]) for name in ("ya", "yb"))


def test_a_tile_that_reads_what_the_waiting_one_writes_stays_behind_it():
    program = _program(b_reads=OFM_A)  # B's input is A's output: B depends on A
    assert ready_first(program, CONFIG) == program


def test_a_move_that_does_not_shorten_the_makespan_is_not_made():
    # A's output is stored first, so the DMA engine ends with B's store whichever tile computes first
    program = _program(stores_b_first=False)
    _, before = _timed(program)
    assert before[-1] == (856, 952)
    assert ready_first(program, CONFIG) == program
