"""Build and run a one-layer command stream from a record, and an independent reference for it (test helper)."""

from __future__ import annotations

import dataclasses

import numpy as np

from npu_backend.codegen.emit import StreamBuilder
from npu_backend.codegen.lower import lower_layer
from npu_backend.params import ConvParams, NpuOp
from simulator import BufferKind, CommandStream, Rounding, run_stream
from simulator.isa import Command, Convolution, DmaCopy, FeatureMap, MemorySpace, Opcode


def layer_stream(p, config) -> CommandStream:
    """The stream of one layer, lowered exactly as a region's layer is (rules checked, planned, prepared)."""
    sb = StreamBuilder(config)
    binary = hasattr(p, "input2_scale")
    shape_in = p.ifm_shape if hasattr(p, "ifm_shape") else p.shape
    shape_out = p.shape if not hasattr(p, "ofm_shape") else p.ofm_shape
    if hasattr(p, "ifm2_shape"):  # two computed operands of their own shapes (batch matmul)
        sources = [sb.add_buffer("ifm", BufferKind.INPUT, p.ifm_shape),
                   sb.add_buffer("ifm2", BufferKind.INPUT, p.ifm2_shape)]
    elif binary:
        sources = [sb.add_buffer("ifm", BufferKind.INPUT, p.shape),
                   None if p.input2_values.size else sb.add_buffer("ifm2", BufferKind.INPUT, p.shape)]
    else:
        sources = [sb.add_buffer("ifm", BufferKind.INPUT, shape_in)]
    dst = sb.add_buffer("ofm", BufferKind.OUTPUT, shape_out)
    lower_layer(sb, p, f"{p.op.value}_0", sources, dst)
    return CommandStream(name="layer", config=config, buffers=tuple(sb.buffers), commands=tuple(sb.commands))


def run_layer(p, config, x: np.ndarray, x2: np.ndarray | None = None):
    inputs = {"ifm": x} if x2 is None else {"ifm": x, "ifm2": x2}
    outputs, stats = run_stream(layer_stream(p, config), inputs, config)
    return outputs["ofm"], stats


def random_params(rng, op: NpuOp, ifm_shape, out_channels=None, kernel=(3, 3), strides=(1, 1),
                  dilation=(1, 1), padding=(1, 1, 1, 1), clamp=(-128, 127), per_channel=True,
                  multiplier=1) -> ConvParams:
    from simulator.isa import conv_output_size

    if op == NpuOp.FULLY_CONNECTED:
        batch, ic = ifm_shape
        oc = out_channels
        weights = rng.integers(-127, 128, (oc, ic), dtype=np.int8)
        ofm_shape, kernel, strides, dilation, padding = (batch, oc), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)
    else:
        _, h, w, ic = ifm_shape
        oc = ic * multiplier if op == NpuOp.DEPTHWISE_CONV2D else out_channels
        shape = (oc, *kernel) if op == NpuOp.DEPTHWISE_CONV2D else (oc, *kernel, ic)
        weights = rng.integers(-127, 128, shape, dtype=np.int8)
        oh = conv_output_size(h, kernel[0], strides[0], dilation[0], padding[0], padding[2])
        ow = conv_output_size(w, kernel[1], strides[1], dilation[1], padding[1], padding[3])
        ofm_shape = (1, oh, ow, oc)
    scales = rng.uniform(0.002, 0.02, oc if per_channel else 1).astype(np.float32)
    return ConvParams(
        op=op, ifm_shape=tuple(ifm_shape), ofm_shape=ofm_shape, input_scale=float(np.float32(0.05)),
        input_zero_point=int(rng.integers(-20, 20)), weight_scales=np.broadcast_to(scales, (oc,)).copy(),
        weight_zero_points=np.zeros(oc, np.int32), per_channel=per_channel, weights=weights,
        bias=rng.integers(-3000, 3000, oc).astype(np.int32), output_scale=float(np.float32(0.3)),
        output_zero_point=int(rng.integers(-10, 10)), clamp=clamp, kernel=kernel, strides=strides,
        dilation=dilation, padding=padding)


def reference_layer(p: ConvParams, x: np.ndarray) -> np.ndarray:
    """The layer computed element by element from the TFLite spec, with its own multipliers: nothing here
    comes from the code under test but the record's fields."""
    import reference_kernels as ref

    fully_connected = p.op == NpuOp.FULLY_CONNECTED
    scales = [float(s) for s in p.weight_scales]
    if p.rounding == Rounding.FLOAT64:
        assert fully_connected, "TFLite requantizes in double only in per-channel FULLY_CONNECTED"
        out = ref.fully_connected_float(x.tolist(), p.weights.tolist(), p.bias.tolist(), p.input_scale, scales,
                                        p.output_scale, p.input_zero_point, p.output_zero_point, p.clamp)
        return np.array(out, dtype=np.int8)
    assert p.rounding == Rounding.TFLITE_DOUBLE, f"no reference for {p.rounding.name} here"
    mult, shift = ref.conv_multipliers(p.input_scale, scales, p.output_scale,
                                       per_tensor_fully_connected=fully_connected and not p.per_channel)
    args = (p.bias.tolist(), mult, shift, p.input_zero_point, p.output_zero_point, p.clamp)
    if fully_connected:
        return np.array(ref.fully_connected(x.tolist(), p.weights.tolist(), *args), dtype=np.int8)
    out = ref.conv2d(x[0].tolist(), p.weights.tolist(), *args, stride=p.strides, dilation=p.dilation,
                     padding=p.padding, depthwise=p.op == NpuOp.DEPTHWISE_CONV2D)
    return np.array(out, dtype=np.int8)[None]


def weights_from_an_input(rng, config) -> tuple[CommandStream, int]:
    """A fully connected layer's stream (4 x 16 weights, input ``ifm`` of 2 x 16) whose weights are DMA'd from an
    INPUT buffer ``w`` instead of its constants: not the same in every run. Returns it and that DMA's index."""
    params = random_params(rng, NpuOp.FULLY_CONNECTED, ifm_shape=(2, 16), out_channels=4)
    stream = layer_stream(params, config)
    index = next(i for i, c in enumerate(stream.commands) if c.opcode == Opcode.DMA_COPY
                 and stream.buffers[c.payload.src_buffer].kind == BufferKind.CONSTANT
                 and c.payload.bytes_moved == params.weights.size)
    dma = stream.commands[index].payload
    buffers = [*stream.buffers, dataclasses.replace(stream.buffers[0], name="w", kind=BufferKind.INPUT, shape=(4, 16),
                                                    dtype="int8", size=64, data=b"")]
    moved = dataclasses.replace(dma, src_space=MemorySpace.DRAM, src_buffer=len(buffers) - 1, src_offset=0)
    commands = list(stream.commands)
    commands[index] = dataclasses.replace(commands[index], payload=moved)
    return CommandStream(name="w", config=config, buffers=tuple(buffers), commands=tuple(commands)), index


def dma_command(buffer: int, sram: int, size: int, to_sram: bool = True) -> Command:
    """One contiguous DMA between DRAM buffer ``buffer`` (from offset 0) and SRAM address ``sram``."""
    dram, sram_side = (MemorySpace.DRAM, buffer, 0), (MemorySpace.SRAM, -1, sram)
    (ss, sb, so), (ds, db, do) = (dram, sram_side) if to_sram else (sram_side, dram)
    return Command(Opcode.DMA_COPY, DmaCopy(ss, sb, so, ds, db, do, size), "dma")


def conv_1x1_4x4(ifm: int, weights: int, table: int, ofm: int, layer: str, channels: int = 16) -> Command:
    """A 1x1 convolution of ``channels`` -> ``channels`` over 4x4 pixels at the given SRAM addresses (64 cycles
    on npu-256 at 16 channels: 32 of issue + 256 outputs / 8 lanes)."""
    return Command(Opcode.CONV2D, Convolution(
        ifm=FeatureMap(ifm, 4, 4, channels), ofm=FeatureMap(ofm, 4, 4, channels), weights_address=weights,
        scale_bias_address=table), layer)


def conv_constants(channels: int = 16, count: int = 2) -> tuple[bytes, list[bytes]]:
    """A scale/bias table (bias 0, multiplier 2**30, shift -8) and ``count`` sets of small seeded 1x1 weights."""
    rng = np.random.default_rng(0)
    table = np.stack([np.zeros(channels), np.full(channels, 1 << 30), np.full(channels, -8)], 1).astype("<i4")
    return table.tobytes(), [rng.integers(-3, 4, (channels, 1, 1, channels), dtype=np.int8).tobytes()
                             for _ in range(count)]


def check_format_gate(monkeypatch, stream: CommandStream, since: str, older: tuple[int, int], refused: str,
                      undefined: str) -> None:
    """A stream using what format ``simulator.stream.<since>`` added: it round-trips in the current format; the
    encoder refuses to write it as ``older`` (``refused``, a regex); and a stream a wrong writer forged in
    ``older`` anyway is refused by the decoder (``undefined``)."""
    import pytest

    import simulator.stream
    from simulator import StreamError
    from simulator.stream import decode_stream, encode_stream

    decoded = decode_stream(encode_stream(stream))
    assert decoded == stream and decoded.version >= getattr(simulator.stream, since)
    old = dataclasses.replace(stream, version=older)
    with pytest.raises(StreamError, match=refused):
        encode_stream(old)
    monkeypatch.setattr(simulator.stream, since, older)  # a writer that wrongly thought ``older`` had it
    forged = encode_stream(old)
    monkeypatch.undo()
    with pytest.raises(StreamError, match=undefined):
        decode_stream(forged)
