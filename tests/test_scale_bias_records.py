"""The scale/bias record: 9 packed bytes per output channel for TFLite's roundings (format 2.5), 8 (bias and float32
weight scale, the output stage forming the float64 scale) for the float64-scale roundings (format 2.6), and 12
(three int32 words) in every format. The region scheduler writes the short ones; the layer-by-layer lowering keeps
12 bytes, which every format reads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layer_streams import check_format_gate, random_params
from npu_backend.codegen.graph import GraphLayer, RegionGraph, Tensor, lower_graph
from npu_backend.codegen.schedule import ScheduleOptions
from npu_backend.params import NpuOp
from simulator import BufferKind, Opcode, Rounding, StreamError, get_config, run_stream
from simulator.isa import (FeatureMap, Convolution, pack_scale_bias, pack_scale_records, scale_bias_bytes,
                           scale_bias_record, scale_bias_words)
from simulator.numerics import float_scales
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


def test_an_8_byte_record_is_bias_and_float32_weight_scale_and_decodes_to_the_float64_scale_tflite_forms():
    """The output stage forms double(s_in) * double(s_w) / double(s_out), TFLite's order: the decoded words are
    exactly the 12-byte record's (bias, then the float64 scale's two halves)."""
    bias, weight_scales = np.array([-5, 7], np.int32), np.array([0.0123, 3.5e-4], np.float32)
    packed = pack_scale_records(bias, weight_scales)
    assert packed == (b"\xfb\xff\xff\xff" + np.float32(0.0123).tobytes() + b"\x07\x00\x00\x00"
                      + np.float32(3.5e-4).tobytes())
    conv = dataclasses.replace(_conv(2, 8), input_scale=0.05, output_scale=0.17)
    scales = float_scales(np.float32(0.05), weight_scales, np.float32(0.17))
    words = np.stack([bias, scales.view(np.int32)[0::2], scales.view(np.int32)[1::2]], axis=1)
    np.testing.assert_array_equal(scale_bias_words(np.frombuffer(packed, np.uint8), conv), words)
    assert scales[0] == float(np.float32(0.05)) * float(np.float32(0.0123)) / float(np.float32(0.17))
    assert conv.input_scale == float(np.float32(0.05))  # held as the float32 the stream stores


def _region(rng, rounding=Rounding.TFLITE_DOUBLE):
    """A region of two convolutions (8 -> 24 -> 16 channels on a 6x6 map)."""
    x = Tensor("x", (1, 6, 6, 8))
    first = dataclasses.replace(random_params(rng, NpuOp.CONV2D, x.shape, out_channels=24), rounding=rounding)
    mid = Tensor("conv_0.ofm", first.ofm_shape)
    second = dataclasses.replace(random_params(rng, NpuOp.CONV2D, mid.shape, out_channels=16), rounding=rounding)
    out = Tensor("conv_1.ofm", second.ofm_shape)
    return RegionGraph((x,), (out,),
                       (GraphLayer("conv_0", first, mid, (x,)), GraphLayer("conv_1", second, out, (mid,))))


def _scheduled(graph, packed: bool):
    return lower_graph(graph, CONFIG, "region", variants=(ScheduleOptions(packed_records=packed),),
                       word_records=False)


def test_the_scheduler_writes_short_records_that_compute_what_the_three_words_compute():
    """Same region, same inputs: with packed records its constants move 3 bytes fewer per output channel (4 for a
    float64 scale) and it computes what the 12-byte layout computes, which is the layer-by-layer lowering's (every
    format reads its 12-byte records)."""
    rng = np.random.default_rng(3)
    graph = _region(rng)
    assert scale_bias_record(Rounding.TFLITE_DOUBLE) == 9 and scale_bias_record(Rounding.FLOAT64) == 8
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
    for rounding in (Rounding.FLOAT64, Rounding.ONNXRUNTIME):
        graph = _region(np.random.default_rng(3), rounding)
        short, words = _scheduled(graph, True), _scheduled(graph, False)
        assert set(records(short)) == {8} and set(records(words)) == {12}
        assert moved(short) == 1728 + 24 * 8 + 3456 + 16 * 8
        conv = next(c.payload for c in short.commands if c.opcode == Opcode.CONV2D)
        assert (conv.input_scale, conv.output_scale) == (float(np.float32(graph.layers[0].params.input_scale)),
                                                         float(np.float32(graph.layers[0].params.output_scale)))
        reference = lower_graph(graph, CONFIG, "region", scheduled=False)
        outputs = [run_stream(s, {"x": x})[0]["output0"] for s in (short, words, reference)]
        np.testing.assert_array_equal(outputs[0], outputs[2])
        np.testing.assert_array_equal(outputs[1], outputs[2])


def test_the_lowering_keeps_packed_records_only_where_they_shorten_the_makespan():
    """The winning variant is tried with 12-byte records too, and the shorter stream kept: never longer than
    either alone."""
    graph = _region(np.random.default_rng(4))
    cycles = lambda s: max(slot.end for slot in schedule(s, CONFIG))  # noqa: E731
    options = (ScheduleOptions(packed_records=True),)
    chosen = lower_graph(graph, CONFIG, "region", variants=options)
    assert cycles(chosen) == min(cycles(_scheduled(graph, True)), cycles(_scheduled(graph, False)))


@pytest.mark.parametrize("rounding, since, older", [(Rounding.TFLITE_DOUBLE, "RECORD_SINCE", (2, 4)),
                                                    (Rounding.FLOAT64, "SCALE_RECORD_SINCE", (2, 5))])
def test_short_records_round_trip_and_older_formats_cannot_carry_them(monkeypatch, rounding, since, older):
    """9-byte records from format 2.5 on, 8-byte ones (and the two scales they need) from 2.6 on."""
    stream = _scheduled(_region(np.random.default_rng(4), rounding), True)
    index = next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.CONV2D)
    version = f"{older[0]}.{older[1]}"
    check_format_gate(monkeypatch, stream, since, older,
                      rf"format {version} cannot carry the scale/bias records of command {index} \(CONV2D\) "
                      r"\(9 bytes added in 2.5, 8 in 2.6\)",
                      rf"command {index} \(CONV2D\): its scale/bias records are not defined in format {version}")


@pytest.mark.parametrize("record, rounding, scales, message", [
    (10, Rounding.TFLITE_DOUBLE, (0.0, 0.0),
     r"scale/bias records of 10 bytes; a record takes 12 \(three int32 words\) or 9 \(.*\) or 8 \(int32 bias, "
     r"float32 weight scale\)"),
    (9, Rounding.FLOAT64, (0.5, 0.5), r"rounding FLOAT64 takes 12- or 8-byte scale/bias records, not 9"),
    (9, Rounding.ONNXRUNTIME, (0.5, 0.5), r"rounding ONNXRUNTIME takes 12- or 8-byte scale/bias records, not 9"),
    (8, Rounding.TFLITE_DOUBLE, (0.5, 0.5), r"rounding TFLITE_DOUBLE takes 12- or 9-byte scale/bias records, not 8"),
    (8, Rounding.FLOAT64, (0.0, 0.5), r"8-byte scale/bias records need positive finite input and output scales, "
                                      r"not 0.0 and 0.5"),
    (8, Rounding.FLOAT64, (0.5, float("inf")), r"need positive finite input and output scales, not 0.5 and inf"),
])
def test_a_record_size_or_rounding_the_output_stage_cannot_read_is_rejected(record, rounding, scales, message):
    stream = _scheduled(_region(np.random.default_rng(5)), True)
    bad = dataclasses.replace(stream, commands=tuple(
        dataclasses.replace(c, payload=dataclasses.replace(c.payload, scale_bias_record=record, rounding=rounding,
                                                           input_scale=scales[0], output_scale=scales[1]))
        if c.opcode == Opcode.CONV2D else c for c in stream.commands))
    with pytest.raises(StreamError, match=message):
        validate_stream(bad, CONFIG)


def _conv(channels: int, record: int) -> Convolution:
    return Convolution(FeatureMap(0, 1, 1, 4), FeatureMap(64, 1, 1, channels), 128, 256, scale_bias_record=record)


