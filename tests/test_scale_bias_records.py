"""The scale/bias record (format 2.5): 9 packed bytes per output channel for TFLite's roundings, 12 (three int32
words) where the last two hold a float64 scale, and what every older stream holds. The region scheduler packs
them; the layer-by-layer lowering keeps 12 bytes, which every format reads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layer_streams import check_format_gate, random_params
from npu_backend.codegen.graph import GraphLayer, RegionGraph, Tensor, lower_graph
from npu_backend.codegen.schedule import ScheduleOptions
from npu_backend.params import NpuOp
from simulator import BufferKind, Opcode, Rounding, StreamError, get_config, run_stream
from simulator.isa import (FeatureMap, Convolution, pack_scale_bias, scale_bias_bytes, scale_bias_record,
                           scale_bias_words)
from simulator.timeline import schedule
from simulator.validate import validate_stream

CONFIG = get_config("npu-256")


def test_a_packed_record_is_bias_multiplier_and_shift_little_endian_with_no_padding():
    words = np.array([[-5, 1 << 30, -3], [7, (1 << 31) - 1, 7]], np.int32)
    packed = pack_scale_bias(words, 9)
    assert packed == (b"\xfb\xff\xff\xff" + (1 << 30).to_bytes(4, "little") + b"\xfd"
                      + b"\x07\x00\x00\x00" + ((1 << 31) - 1).to_bytes(4, "little") + b"\x07")
    np.testing.assert_array_equal(scale_bias_words(np.frombuffer(packed, np.uint8), _conv(2, 9)), words)
    assert pack_scale_bias(words, 12) == words.astype("<i4").tobytes()
    np.testing.assert_array_equal(scale_bias_words(np.frombuffer(words.tobytes(), np.uint8), _conv(2, 12)), words)
    with pytest.raises(StreamError, match="a shift does not fit the packed record's byte"):
        pack_scale_bias(np.array([[0, 1 << 30, 200]], np.int32), 9)


def _region(rng, rounding=Rounding.TFLITE_DOUBLE):
    """A region of two convolutions (8 -> 24 -> 16 channels on a 6x6 map)."""
    x = Tensor("x", (1, 6, 6, 8))
    first = dataclasses.replace(random_params(rng, NpuOp.CONV2D, x.shape, out_channels=24), rounding=rounding)
    mid = Tensor("conv_0.ofm", first.ofm_shape)
    second = dataclasses.replace(random_params(rng, NpuOp.CONV2D, mid.shape, out_channels=16), rounding=rounding)
    out = Tensor("conv_1.ofm", second.ofm_shape)
    return RegionGraph((x,), (out,), (GraphLayer("conv_0", first, mid, (x,)), GraphLayer("conv_1", second, out, (mid,))))


def _scheduled(graph, packed: bool):
    return lower_graph(graph, CONFIG, "region", variants=(ScheduleOptions(packed_records=packed),),
                       word_records=False)


def test_the_scheduler_packs_records_for_tflite_roundings_and_keeps_three_words_for_float_scales():
    """Same region, same inputs: with packed records its constants move 3 bytes fewer per output channel and it
    computes what the 12-byte layout computes, which is the layer-by-layer lowering's (every format reads its
    12-byte records); a float64 scale keeps 12 bytes, packed or not."""
    rng = np.random.default_rng(3)
    graph = _region(rng)
    assert scale_bias_record(Rounding.TFLITE_DOUBLE) == 9 and scale_bias_record(Rounding.FLOAT64) == 12
    packed, words = _scheduled(graph, True), _scheduled(graph, False)
    reference = lower_graph(graph, CONFIG, "region", scheduled=False)
    records = lambda s: [c.payload.scale_bias_record for c in s.commands if c.opcode == Opcode.CONV2D]  # noqa: E731
    assert set(records(packed)) == {9} and set(records(words)) == set(records(reference)) == {12}
    conv = next(c.payload for c in packed.commands if c.opcode == Opcode.CONV2D)
    assert scale_bias_bytes(conv) == 9 * conv.ofm.channels
    moved = lambda s: sum(c.payload.bytes_moved for c in s.commands  # noqa: E731
                          if c.opcode == Opcode.DMA_COPY and s.buffers[c.payload.src_buffer].kind == BufferKind.CONSTANT
                          and c.payload.src_space == 0)
    # 3x3 weights (24 x 72 and 16 x 216 bytes), then each table, aligned to 16 bytes
    assert moved(words) == 1728 + 24 * 12 + 3456 + 16 * 12
    assert moved(packed) == 1728 + 224 + 3456 + 16 * 9  # 216 bytes of records rounded up to 224
    x = rng.integers(-128, 128, (1, 6, 6, 8)).astype(np.int8)
    outputs = [run_stream(s, {"x": x})[0] for s in (packed, words, reference)]
    for got in outputs[:2]:
        np.testing.assert_array_equal(got["output0"], outputs[2]["output0"])
    floats = _scheduled(_region(np.random.default_rng(3), Rounding.FLOAT64), True)
    assert set(records(floats)) == {12}


def test_the_lowering_keeps_packed_records_only_where_they_shorten_the_makespan():
    """The winning variant is tried with 12-byte records too, and the shorter stream kept: never longer than
    either alone."""
    graph = _region(np.random.default_rng(4))
    cycles = lambda s: max(slot.end for slot in schedule(s, CONFIG))  # noqa: E731
    options = (ScheduleOptions(packed_records=True),)
    chosen = lower_graph(graph, CONFIG, "region", variants=options)
    assert cycles(chosen) == min(cycles(_scheduled(graph, True)), cycles(_scheduled(graph, False)))


def test_packed_records_round_trip_in_format_2_5_and_older_formats_cannot_carry_them(monkeypatch):
    stream = _scheduled(_region(np.random.default_rng(4)), True)
    index = next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.CONV2D)
    check_format_gate(monkeypatch, stream, "RECORD_SINCE", (2, 4),
                      rf"format 2.4 cannot carry the packed scale/bias records of command {index} \(CONV2D\) "
                      r"\(added in 2.5\)",
                      rf"command {index} \(CONV2D\): scale/bias records other than 12 bytes are not defined in "
                      r"format 2.4")


@pytest.mark.parametrize("record, rounding, message", [
    (10, Rounding.TFLITE_DOUBLE, r"scale/bias records of 10 bytes; a record takes 12 \(three int32 words\) or 9 "),
    (9, Rounding.FLOAT64, r"rounding FLOAT64 keeps a float64 scale per channel, which needs 12-byte scale/bias "
                          r"records, not 9"),
    (9, Rounding.ONNXRUNTIME, r"rounding ONNXRUNTIME keeps a float64 scale"),
])
def test_a_record_size_or_rounding_the_output_stage_cannot_read_is_rejected(record, rounding, message):
    stream = _scheduled(_region(np.random.default_rng(5)), True)
    bad = dataclasses.replace(stream, commands=tuple(
        dataclasses.replace(c, payload=dataclasses.replace(c.payload, scale_bias_record=record, rounding=rounding))
        if c.opcode == Opcode.CONV2D else c for c in stream.commands))
    with pytest.raises(StreamError, match=message):
        validate_stream(bad, CONFIG)


def _conv(channels: int, record: int) -> Convolution:
    return Convolution(FeatureMap(0, 1, 1, 4), FeatureMap(64, 1, 1, channels), 128, 256, scale_bias_record=record)


