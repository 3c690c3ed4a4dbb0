"""The batched runner prepared once (:class:`simulator.batch.PreparedBatch`) against one run per sample, on the
paths it adds: a constant-weight MAC command requantized with its bias folded in (and the kernel where the
batch's bound leaves the requantizer's exact range or overflows the accumulator), elementwise commands through a
table of every input pair; and the one-variant lowering calibration uses, against the chosen stream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import npu_backend
from layer_streams import layer_stream, random_params
from npu_backend.codegen.lower import lower_module
from npu_backend.codegen.schedule import SCHEDULE_VARIANTS
from npu_backend.params import NpuOp
from simulator import get_config, run_stream
from simulator.batch import PreparedBatch, _BatchState, run_stream_batch
from simulator.isa import BufferKind, Opcode

BASE = get_config("npu-256")


def _per_sample(stream, name, batch, config=None):
    return [run_stream(stream, {name: x}, config) for x in batch]


@pytest.mark.parametrize("op,kwargs", [
    (NpuOp.CONV2D, dict(ifm_shape=(1, 9, 7, 5), out_channels=12, clamp=(-3, 127))),
    (NpuOp.CONV2D, dict(ifm_shape=(1, 6, 6, 16), out_channels=8, kernel=(1, 1), padding=(0, 0, 0, 0))),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 10, 8, 6), strides=(2, 2)))])
def test_a_prepared_batch_equals_one_run_per_sample_run_after_run(op, kwargs):
    rng = np.random.default_rng(11)
    params = random_params(rng, op, **kwargs)
    stream = layer_stream(params, BASE)
    prepared = PreparedBatch(stream, BASE)
    assert prepared.macs  # the constant-weight path is the one under test
    handed = []

    def dirty(shape, dtype):  # memory a caller reuses holds what it held before: the run must zero it itself
        handed.append(np.full(shape, 0x5A, np.uint8).view(dtype))
        return handed[-1]

    for seed in range(2):  # the same prepared stream, twice: nothing of one run leaks into the next
        batch = np.random.default_rng(seed).integers(-128, 128, (3, *params.ifm_shape)).astype(np.int8)
        singles = _per_sample(stream, "ifm", batch, BASE)
        for empty in (None, dirty):
            outputs, overflows = prepared.run({"ifm": batch}, empty=empty)
            for n, (single, stats) in enumerate(singles):
                np.testing.assert_array_equal(outputs["ofm"][n], single["ofm"])
            assert sum(overflows) == 0
    assert any(np.shares_memory(outputs["ofm"], memory) for memory in handed)  # outputs: views, not copies
    # before any command, the memories the caller handed out hold what one run's start with: zeros and the inputs
    state = _BatchState(stream, {"ifm": batch}, BASE, dirty)
    assert state.sram.shape == (3, BASE.sram_bytes) and not state.sram.any()
    for memory, buf in zip(state.dram, stream.buffers):
        if buf.kind == BufferKind.INPUT:
            assert memory.tobytes() == batch.tobytes()
        elif buf.kind != BufferKind.CONSTANT:
            assert memory.shape == (3, buf.size) and not memory.any()


def test_the_constant_mac_declines_where_the_accumulator_can_overflow_and_the_kernel_counts_it():
    config = dataclasses.replace(BASE, name="acc14", accumulator_bits=14)
    rng = np.random.default_rng(12)
    params = random_params(rng, NpuOp.CONV2D, ifm_shape=(1, 6, 6, 8), out_channels=6)
    stream = layer_stream(params, config)
    prepared = PreparedBatch(stream, config)
    (index, plan), *_ = prepared.macs.items()
    conv = stream.commands[index].payload
    full = np.full((2, conv.ifm.height, conv.ifm.width, conv.ifm.channels), 127, np.int8)
    assert plan(full) is None  # 14-bit accumulators cannot hold the full-scale sums
    small = np.full_like(full, conv.input_zero_point)
    assert plan(small) is not None  # centred zeros: every sum is 0
    batch = np.concatenate([np.full((1, *params.ifm_shape), 127, np.int8),
                            rng.integers(-128, 128, (2, *params.ifm_shape)).astype(np.int8)])
    outputs, overflows = prepared.run({"ifm": batch})
    singles = _per_sample(stream, "ifm", batch, config)
    for n, (single, _) in enumerate(singles):
        np.testing.assert_array_equal(outputs["ofm"][n], single["ofm"])
    assert sum(overflows) == sum(s.total_overflows for _, s in singles) > 0


@pytest.mark.parametrize("model", ["add_two_inputs", "sub_two_inputs", "mul_two_inputs"])
def test_elementwise_commands_through_their_pair_table_equal_one_run_per_sample(model):
    mod = npu_backend.load_model(f"tests/fixtures/tflite/{model}.tflite")
    (stream,) = lower_module(npu_backend.partition_for_npu(mod)).values()
    prepared = PreparedBatch(stream)
    assert {stream.commands[i].opcode for i in prepared.tables} & {Opcode.ADD, Opcode.SUB, Opcode.MUL}
    inputs = stream.buffers_of(BufferKind.INPUT)
    rng = np.random.default_rng(13)
    batch = {buf.name: rng.integers(-128, 128, (4, *buf.shape)).astype(buf.dtype) for _, buf in inputs}
    batch[inputs[0][1].name][0] = -128  # the corners of the table
    batch[inputs[1][1].name][0] = 127
    outputs, stats = run_stream_batch(stream, batch)
    for n in range(4):
        single, single_stats = run_stream(stream, {name: x[n] for name, x in batch.items()})
        for name, value in single.items():
            np.testing.assert_array_equal(outputs[name][n], value)
    assert [c.cycles for c in stats.commands] == [c.cycles for c in single_stats.commands]


def test_one_schedule_variant_computes_what_the_chosen_stream_computes():
    mod = npu_backend.load_model("tests/fixtures/tflite/mobilenet_v2_035_96.tflite")
    partitioned = npu_backend.partition_for_npu(mod)
    chosen = lower_module(partitioned)
    first = lower_module(partitioned, variants=SCHEDULE_VARIANTS[:1])
    assert chosen.keys() == first.keys()
    rng = np.random.default_rng(14)
    for symbol, stream in chosen.items():
        (_, buf), = stream.buffers_of(BufferKind.INPUT)
        batch = rng.integers(-128, 128, (2, *buf.shape)).astype(buf.dtype)
        a, _ = PreparedBatch(stream).run({buf.name: batch})
        b, _ = PreparedBatch(first[symbol]).run({buf.name: batch})
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def test_a_serial_stream_computes_what_the_overlapped_one_computes_and_missing_dependencies_are_still_refused():
    # Calibration lowers its streams serially (deps None: each command waits for the one before, as before format
    # 2.4), deriving no dependencies and no growing stripes (a choice of cycles only); the values are those of
    # the stream with them. A stream whose commands claim to wait for nothing (deps ()) while they share SRAM is
    # refused, prepared for a batch or not.
    from simulator.errors import StreamError
    from simulator.timeline import schedule

    mod = npu_backend.load_model("tests/fixtures/tflite/conv2d_3x3_s1_same.tflite")
    partitioned = npu_backend.partition_for_npu(mod)
    (stream,) = lower_module(partitioned, variants=SCHEDULE_VARIANTS[:1]).values()
    assert any(c.deps for c in stream.commands)
    (serial,) = lower_module(partitioned, variants=SCHEDULE_VARIANTS[:1], serial=True).values()
    assert serial.commands == tuple(dataclasses.replace(c, deps=None) for c in stream.commands)
    slots = schedule(serial, serial.config)  # nothing overlaps: each command starts when the one before ends
    assert all(later.start == earlier.end for earlier, later in zip(slots, slots[1:]))
    (_, buf), = stream.buffers_of(BufferKind.INPUT)
    batch = np.random.default_rng(15).integers(-128, 128, (3, *buf.shape)).astype(buf.dtype)
    want, _ = PreparedBatch(stream).run({buf.name: batch})
    got, _ = PreparedBatch(serial).run({buf.name: batch})
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    bare = dataclasses.replace(stream, commands=tuple(dataclasses.replace(c, deps=()) for c in stream.commands))
    with pytest.raises(StreamError, match="must depend on"):
        PreparedBatch(bare)


def test_a_serial_stream_leaves_out_growing_stripes_and_computes_the_same_values():
    # MobileNetV2's region streams its first layer from DRAM in stripes that start short and grow; the serial
    # stream calibration asks for has uniform stripes (fewer commands), and the same outputs.
    from npu_backend.codegen.schedule import ScheduleOptions

    partitioned = npu_backend.partition_for_npu(npu_backend.load_model(
        "tests/fixtures/tflite/mobilenet_v2_035_96.tflite"))
    (grown,) = lower_module(partitioned, variants=SCHEDULE_VARIANTS[:1]).values()
    uniform_options = dataclasses.replace(SCHEDULE_VARIANTS[0], growing_stripes=False)
    (uniform,) = lower_module(partitioned, variants=(uniform_options,), word_records=False).values()
    (serial,) = lower_module(partitioned, variants=SCHEDULE_VARIANTS[:1], serial=True).values()
    assert ScheduleOptions().growing_stripes
    first = grown.commands[0].layer

    def first_layer_computes(stream):
        return sum(c.layer == first and c.opcode != Opcode.DMA_COPY for c in stream.commands)

    # the first layer in fewer, taller stripes: as many as with growing stripes left out of every variant
    assert first_layer_computes(serial) == first_layer_computes(uniform) < first_layer_computes(grown)
    (_, buf), = grown.buffers_of(BufferKind.INPUT)
    batch = np.random.default_rng(16).integers(-128, 128, (2, *buf.shape)).astype(buf.dtype)
    want, _ = PreparedBatch(grown).run({buf.name: batch})
    got, _ = PreparedBatch(serial).run({buf.name: batch})
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
