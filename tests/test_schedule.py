"""The region scheduler: maps kept in SRAM, spills, cascades, allocation by liveness, prefetch.

Regions are built as :class:`RegionGraph` values from random layer records, lowered through the scheduler
and, as the reference, layer by layer through DRAM (every layer's own tile program); both streams run on
the simulator and must agree on every output element.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layer_streams import random_params
from npu_backend.codegen.allocate import SramBuffer, allocate
from npu_backend.codegen.graph import GraphLayer, RegionGraph, Tensor, lower_graph
from npu_backend.params import ElementwiseParams, NpuOp
from simulator import BufferKind, Opcode, get_config, run_stream
from simulator.hazards import accesses, dependencies

NPU_256 = get_config("npu-256")


def _chain(rng, shapes_and_ops, x_shape):
    """A region: ``x`` -> each (op, kwargs) in turn -> the last result as its output."""
    x = Tensor("x", x_shape)
    layers, current = [], x
    for k, (op, kwargs) in enumerate(shapes_and_ops):
        p = random_params(rng, op, current.shape, **kwargs)
        result = Tensor(f"{op.value}_{k}.ofm", p.ofm_shape)
        layers.append(GraphLayer(f"{op.value}_{k}", p, result, (current,)))
        current = result
    return RegionGraph((x,), (current,), tuple(layers))


def _add(rng, name: str, a: Tensor, b: Tensor) -> GraphLayer:
    p = ElementwiseParams(op=NpuOp.ADD, shape=a.shape, input_scale=0.3, input_zero_point=int(rng.integers(-5, 5)),
                          input2_scale=0.3, input2_zero_point=int(rng.integers(-5, 5)), output_scale=0.5,
                          output_zero_point=int(rng.integers(-5, 5)), clamp=(-128, 127))
    return GraphLayer(name, p, Tensor(f"{name}.ofm", a.shape), (a, b))


def _run_both(graph: RegionGraph, config, seed: int = 0):
    """(scheduled stream, its run statistics); asserts it equals the layer-by-layer lowering exactly."""
    scheduled = lower_graph(graph, config, "region")
    reference = lower_graph(graph, config, "region", scheduled=False)
    rng = np.random.default_rng(seed)
    inputs = {t.name: rng.integers(-128, 128, t.shape).astype(np.int8) for t in graph.inputs}
    got, stats = run_stream(scheduled, inputs)
    expected, _ = run_stream(reference, inputs)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
    return scheduled, stats


def _dram_bytes(stream, kind: BufferKind, direction: str) -> int:
    """Bytes the stream's DMA commands read from (``"read"``) or write to (``"write"``) buffers of ``kind``."""
    total = 0
    for command in stream.commands:
        if command.opcode != Opcode.DMA_COPY:
            continue
        p = command.payload
        buffer = p.src_buffer if direction == "read" else p.dst_buffer
        space = p.src_space if direction == "read" else p.dst_space
        if space == 0 and stream.buffers[buffer].kind == kind:
            total += p.bytes_moved
    return total


SMALL_CHAIN = [(NpuOp.CONV2D, dict(out_channels=16, kernel=(1, 1), padding=(0, 0, 0, 0))),
               (NpuOp.DEPTHWISE_CONV2D, {}), (NpuOp.CONV2D, dict(out_channels=8))]
"""1x1 first (its input rows are read once whatever the stripes), then two 3x3 layers."""


def test_a_chain_of_small_layers_stays_in_sram():
    """Between the layers nothing goes through DRAM: the input is read once, each layer's constants once,
    the output written once."""
    graph = _chain(np.random.default_rng(1), SMALL_CHAIN, (1, 12, 12, 8))
    stream, stats = _run_both(graph, NPU_256)
    assert not [b for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    constants = sum(b.size for b in stream.buffers if b.kind == BufferKind.CONSTANT)
    assert _dram_bytes(stream, BufferKind.INPUT, "read") == 12 * 12 * 8
    assert _dram_bytes(stream, BufferKind.CONSTANT, "read") == constants
    assert _dram_bytes(stream, BufferKind.OUTPUT, "write") == 12 * 12 * 8
    assert stats.total_dram_bytes == 12 * 12 * 8 * 2 + constants
    layers = [c.layer for c in stream.commands if c.opcode != Opcode.DMA_COPY]
    assert sorted(set(layers), key=layers.index) == ["conv2d_0", "depthwise_conv2d_1", "conv2d_2"]
    assert layers.count("depthwise_conv2d_1") == 1  # between SRAM maps, one command does the whole layer


def test_the_layer_by_layer_lowering_moves_every_map_through_dram():
    """The same chain lowered without the scheduler: each intermediate map is written and read back."""
    graph = _chain(np.random.default_rng(1), SMALL_CHAIN, (1, 12, 12, 8))
    stream = lower_graph(graph, NPU_256, "region", scheduled=False)
    scratch = [b for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    assert [b.size for b in scratch] == [12 * 12 * 16, 12 * 12 * 16]
    assert _dram_bytes(stream, BufferKind.SCRATCH, "write") == 2 * 12 * 12 * 16


def _residual_block(rng, x_shape, expand: int):
    """in -> conv (X) -> 1x1 expand -> depthwise -> 1x1 project -> add(X, ...): X lives across the block."""
    x = Tensor("x", x_shape)
    channels = x_shape[-1]
    p0 = random_params(rng, NpuOp.CONV2D, x_shape, out_channels=channels)
    skip = Tensor("conv_0.ofm", p0.ofm_shape)
    p1 = random_params(rng, NpuOp.CONV2D, skip.shape, out_channels=expand, kernel=(1, 1), padding=(0, 0, 0, 0))
    wide = Tensor("conv_1.ofm", p1.ofm_shape)
    p2 = random_params(rng, NpuOp.DEPTHWISE_CONV2D, wide.shape)
    dw = Tensor("dw_2.ofm", p2.ofm_shape)
    p3 = random_params(rng, NpuOp.CONV2D, dw.shape, out_channels=channels, kernel=(1, 1), padding=(0, 0, 0, 0))
    narrow = Tensor("conv_3.ofm", p3.ofm_shape)
    add = _add(rng, "add_4", skip, narrow)
    layers = (GraphLayer("conv_0", p0, skip, (x,)), GraphLayer("conv_1", p1, wide, (skip,)),
              GraphLayer("dw_2", p2, dw, (wide,)), GraphLayer("conv_3", p3, narrow, (dw,)), add)
    return RegionGraph((x,), (add.result,), layers)


def test_a_residual_block_fits_and_keeps_its_skip_map():
    graph = _residual_block(np.random.default_rng(2), (1, 16, 16, 16), 64)
    stream, stats = _run_both(graph, NPU_256)
    assert not [b for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    assert _dram_bytes(stream, BufferKind.OUTPUT, "write") == 16 * 16 * 16


def test_a_map_too_large_for_sram_is_cascaded_by_stripes():
    """The 64-channel map (16 KiB) is over a third of a 32 KiB SRAM: expand, depthwise and project run
    stripe by stripe (rows shared by two stripes' windows recomputed) and the map never reaches DRAM."""
    tiny = get_config("npu-tiny")
    graph = _residual_block(np.random.default_rng(3), (1, 16, 16, 16), 64)
    stream, stats = _run_both(graph, tiny)
    names = [b.name for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    assert "conv_1.ofm" not in names and "dw_2.ofm" not in names
    per_layer = {}
    for c in stream.commands:
        if c.opcode != Opcode.DMA_COPY:
            per_layer[c.layer] = per_layer.get(c.layer, 0) + 1
    assert per_layer["conv_1"] > 1 and per_layer["dw_2"] == per_layer["conv_1"]
    expand_rows = sum(c.payload.ofm.height for c in stream.commands
                      if c.layer == "conv_1" and c.opcode == Opcode.CONV2D)
    assert expand_rows > 16  # halo rows recomputed
    assert sum(c.payload.ofm.height for c in stream.commands
               if c.layer == "dw_2" and c.opcode == Opcode.DEPTHWISE_CONV2D) == 16


def test_a_map_is_spilled_when_sram_is_too_small_to_keep_it():
    """On a 16 KiB SRAM the skip map (4 KiB) cannot stay whole across the block's stripes next to them: it
    is written to DRAM once and read back for the addition."""
    small = dataclasses.replace(get_config("npu-tiny"), name="npu-16k", sram_bytes=16 * 1024)
    graph = _residual_block(np.random.default_rng(4), (1, 16, 16, 16), 48)
    stream, _ = _run_both(graph, small)
    scratch = {b.name: i for i, b in enumerate(stream.buffers) if b.kind == BufferKind.SCRATCH}
    assert "conv_0.ofm" in scratch
    written = sum(c.payload.bytes_moved for c in stream.commands if c.opcode == Opcode.DMA_COPY
                  and c.payload.dst_space == 0 and c.payload.dst_buffer == scratch["conv_0.ofm"])
    assert written == 16 * 16 * 16
    on_256 = lower_graph(graph, NPU_256, "region")
    assert not [b for b in on_256.buffers if b.kind == BufferKind.SCRATCH]


def test_allocation_by_liveness_shares_addresses_between_disjoint_lifetimes():
    first, second, across = SramBuffer("a", 96, 0, 1), SramBuffer("b", 96, 2, 3), SramBuffer("c", 48, 1, 2)
    assert allocate([first, second, across], 256, 16) is None
    assert (first.address, second.address, across.address) == (0, 0, 96)
    crowd = SramBuffer("d", 128, 1, 1)  # at step 1: 96 + 48 + 128 bytes > 256
    assert allocate([first, second, across, crowd], 256, 16) is across  # the largest are placed first


def test_maps_with_disjoint_lifetimes_share_sram_in_a_region():
    """Five 1x1 layers on npu-tiny (32 KiB): their four intermediate maps of 10 KiB each (40 KiB together)
    all stay in SRAM, which only works if a map's bytes are reused once its last reader has run."""
    one_by_one = dict(out_channels=16, kernel=(1, 1), padding=(0, 0, 0, 0))
    graph = _chain(np.random.default_rng(5), [(NpuOp.CONV2D, one_by_one)] * 5, (1, 20, 32, 16))
    stream, _ = _run_both(graph, get_config("npu-tiny"))
    assert not [b for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    assert _dram_bytes(stream, BufferKind.OUTPUT, "write") == 20 * 32 * 16
    written = {}
    for c in stream.commands:
        if c.opcode == Opcode.CONV2D:
            ofm = c.payload.ofm
            written.setdefault(c.layer, set()).update(range(ofm.address, ofm.address + ofm.nbytes))
    middle = [written[f"conv2d_{k}"] for k in range(4)]
    assert all(len(m) == 20 * 32 * 16 for m in middle)
    assert any(middle[i] & middle[j] for i in range(4) for j in range(i + 2, 4))  # a dead map's bytes reused


def test_no_two_live_buffers_overlap_and_every_hazard_is_ordered():
    """The stream passes the simulator's dependency check, and no compute command writes bytes a command
    still waiting to run reads (the allocator's invariant, seen from the commands)."""
    from simulator.hazards import check_dependencies

    graph = _residual_block(np.random.default_rng(6), (1, 24, 24, 16), 96)
    for config in (NPU_256, get_config("npu-tiny")):
        stream, _ = _run_both(graph, config)
        check_dependencies(stream, config)
        for command in stream.commands:
            for access in accesses(command, config):
                assert 0 <= access.start < access.stop


def test_prefetch_overlaps_the_next_stripe_with_this_one():
    """With stripes, the DMA engine loads stripe k + 1 while stripe k computes: the makespan is below the
    sum of both engines' busy cycles, and each stripe's input load comes before the previous stripe's store."""
    from simulator.opcodes import Engine

    tiny = get_config("npu-tiny")
    graph = _chain(np.random.default_rng(7), [(NpuOp.CONV2D, dict(out_channels=32))], (1, 32, 32, 16))
    stream, stats = _run_both(graph, tiny)
    assert stats.total_cycles < stats.busy_cycles(Engine.DMA) + stats.busy_cycles(Engine.COMPUTE)
    kinds = []
    for c in stream.commands:
        if c.opcode == Opcode.DMA_COPY:
            kinds.append("load" if c.payload.dst_space == 1 and stream.buffers[c.payload.src_buffer].kind
                         == BufferKind.INPUT else "store" if c.payload.src_space == 1 else "constant")
        else:
            kinds.append("compute")
    first_store = kinds.index("store")
    assert kinds[:first_store].count("load") >= 2  # the second stripe's rows are loaded before the first is stored
    assert kinds.count("compute") > 1


def test_tiled_layer_feeds_its_depthwise_follower_from_sram():
    """A 1x1 convolution whose weights exceed a quarter of SRAM runs in output-channel tiles; the depthwise
    layer after it takes each tile from SRAM, so the wide map is never stored."""
    rng = np.random.default_rng(8)
    chain = [(NpuOp.CONV2D, dict(out_channels=256, kernel=(1, 1), padding=(0, 0, 0, 0))),
             (NpuOp.DEPTHWISE_CONV2D, {})]
    graph = _chain(rng, chain, (1, 7, 7, 64))  # 16 KiB of weights: over a quarter of npu-tiny's SRAM
    stream, _ = _run_both(graph, get_config("npu-tiny"))
    names = [b.name for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    assert "conv2d_0.ofm" not in names
    convs = [c for c in stream.commands if c.opcode == Opcode.CONV2D]
    depthwise = [c for c in stream.commands if c.opcode == Opcode.DEPTHWISE_CONV2D]
    assert sum(c.payload.ofm.height * c.payload.ofm.channels for c in convs) == 7 * 256  # each output once
    assert len(depthwise) > 1 and sum(c.payload.ofm.channels for c in depthwise) == 256
    assert len(convs) == len(depthwise) + 1  # the first tile in two row stripes: it starts on the first rows


@pytest.mark.parametrize("preset", ["npu-256", "npu-tiny"])
def test_mobilenet_v2_035_96_runs_bit_exact_on(preset):
    """TFLite's reference outputs, on the preset's SRAM: on npu-tiny (32 KiB) with maps spilled and layers
    in stripes."""
    import tvm
    from tvm import relax

    import npu_backend
    from conftest import FIXTURES
    from npu_backend.codegen.lower import lower_module

    model = FIXTURES / "tflite" / "mobilenet_v2_035_96.tflite"
    golden = np.load(model.with_suffix(".npz"))
    partitioned = npu_backend.partition_for_npu(npu_backend.load_tflite(model), preset=preset)
    (stream,) = lower_module(partitioned).values()
    computes = [c for c in stream.commands if c.opcode != Opcode.DMA_COPY]
    assert len(computes) > len({c.layer for c in computes})  # some layers run in stripes or tiles
    if preset == "npu-tiny":
        assert [b for b in stream.buffers if b.kind == BufferKind.SCRATCH]
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    for x, expected in list(zip(golden["inputs"], golden["outputs"]))[:2]:
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(got, expected)


def test_a_layer_bound_by_its_weight_traffic_streams_smaller_channel_tiles():
    """A fully connected layer at batch 1 moves 1280 weight bytes per output channel for 1280 MACs: it runs at
    the DMA's pace whatever its tiles. The streamed-tiles variant gives it tiles of at most a twelfth of SRAM
    (16 channels here, not 32), and leaves a convolution whose compute outlasts its weight traffic at a sixth;
    both streams equal the layer-by-layer lowering."""
    from npu_backend.codegen.schedule import ScheduleOptions

    rng = np.random.default_rng(12)
    fc = _chain(rng, [(NpuOp.FULLY_CONNECTED, dict(out_channels=200))], (1, 1280))
    conv = _chain(rng, [(NpuOp.CONV2D, dict(out_channels=256, kernel=(3, 3)))], (1, 14, 14, 64))
    reference = {id(graph): lower_graph(graph, NPU_256, "region", scheduled=False) for graph in (fc, conv)}

    def tile_channels(graph, streamed: bool) -> list[int]:
        stream = lower_graph(graph, NPU_256, "region",
                             variants=(ScheduleOptions("above", streamed_tiles=streamed),))
        inputs = {t.name: rng.integers(-128, 128, t.shape).astype(np.int8) for t in graph.inputs}
        got, _ = run_stream(stream, inputs)
        expected, _ = run_stream(reference[id(graph)], inputs)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
        opcode = graph.layers[0].params.op
        computes = [c for c in stream.commands if c.opcode != Opcode.DMA_COPY]
        assert {c.layer for c in computes} == {graph.layers[0].name}, opcode
        return [c.payload.ofm.channels for c in computes]

    assert tile_channels(fc, False) == [32] * 6 + [8]
    assert tile_channels(fc, True) == [16] * 12 + [8]
    weights = 3 * 3 * 64 * 256  # 147 KiB: over a quarter of SRAM, but 14x14 outputs take longer to compute
    assert weights > NPU_256.sram_bytes // 4
    conv_tiles = tile_channels(conv, True)
    assert conv_tiles == tile_channels(conv, False) and max(conv_tiles) == 64 and sum(conv_tiles) >= 256


def test_a_lone_layer_is_cut_into_stripes_only_when_the_dma_they_hide_outweighs_their_fixed_costs():
    """A 1x1 convolution reading and writing its maps in DRAM (12x12x96 -> 12x12x16, 16 KiB moved). On npu-256
    four stripes hide about 1,500 DMA cycles for 3 x 32 cycles of issue and 6 DMA latencies, so it is cut. On
    scalesim-16x16 the same bytes move in 1,008 cycles with no latency (756 of them hidden by four stripes),
    while each extra stripe refills the array for each of the layer's 6 folds (3 x 6 x 46 = 828 cycles): it
    runs whole."""
    rng = np.random.default_rng(13)
    graph = _chain(rng, [(NpuOp.CONV2D, dict(out_channels=16, kernel=(1, 1), padding=(0, 0, 0, 0)))], (1, 12, 12, 96))
    counts = {}
    for preset in ("npu-256", "scalesim-16x16"):
        stream, _ = _run_both(graph, get_config(preset))
        counts[preset] = [c.payload.ofm.height for c in stream.commands if c.opcode == Opcode.CONV2D]
    assert counts == {"npu-256": [3, 3, 3, 3], "scalesim-16x16": [12]}


def test_the_regions_first_layer_starts_with_a_short_stripe_and_grows_its_stripes():
    """MobileNetV2's first convolution (96x96x3 -> 48x48x16, stride 2) reads the region's input from DRAM in
    stripes, and nothing computes before its first stripe has loaded: that stripe is short, and each next one
    grows while its rows still load during the stripe before it: 6, 7, 8, 9, 11, 7 rows. Against four stripes
    of 12 rows, its first command starts at 668 cycles instead of 1,100 and the layer ends at 5,468 instead of
    5,836; both compute the same values."""
    from npu_backend.codegen import schedule as scheduling

    rng = np.random.default_rng(21)
    graph = _chain(rng, [(NpuOp.CONV2D, dict(out_channels=16, strides=(2, 2), padding=(0, 0, 1, 1))),
                         (NpuOp.DEPTHWISE_CONV2D, {})], (1, 96, 96, 3))

    def first_layer(stream, stats):
        convs = [(c.payload.ofm.height, s) for c, s in zip(stream.commands, stats.commands)
                 if c.opcode == Opcode.CONV2D]
        return [height for height, _ in convs], convs[0][1].start, convs[-1][1].start + convs[-1][1].cycles

    grown = first_layer(*_run_both(graph, NPU_256))
    uniform_stops = scheduling.RegionScheduler._stops
    try:
        scheduling.RegionScheduler._stops = lambda self, strategy, members: (
            list(range(12, 48, 12)) + [48] if members == [0] else uniform_stops(self, strategy, members))
        uniform = first_layer(*_run_both(graph, NPU_256))
    finally:
        scheduling.RegionScheduler._stops = uniform_stops
    heights, start, end = grown
    assert uniform[0] == [12, 12, 12, 12] and sum(heights) == 48
    assert heights[0] < 12 and heights[:-1] == sorted(heights[:-1]) and max(heights) <= 12
    assert (heights, start, end) == ([6, 7, 8, 9, 11, 7], 668, 5468) and uniform[1:] == (1100, 5836)


def test_the_tail_starts_where_compute_before_it_plus_its_constant_traffic_is_largest():
    """``tail_start`` by hand: compute per step and the DMA cycles of the constant loads issued at each."""
    from npu_backend.codegen.prefetch import tail_start

    # s = 0: 0 + 20; s = 1: 5 + 20; s = 2: 10 + 0
    assert tail_start([5, 5, 5], [0, 20, 0]) == 1
    # the classifier's weights dominate: compute 30 before step 3 plus its 40
    assert tail_start([10, 10, 10, 10], [5, 0, 0, 40]) == 3
    # no constants: every step ties at 0 + 0 only for s = 0, later steps add compute
    assert tail_start([0, 0], [0, 0]) == 0
    assert tail_start([1, 1, 1], [0, 0, 0]) == 2


def test_the_tail_policy_fills_sram_with_the_classifiers_weights_before_it_starts():
    """MobileNetV2-0.35-96 on npu-256 ends in layers whose weights take the DMA engine longer to move than
    they take to compute (the 1280 x 1001 classifier above all). The ``tail`` policy loads the earlier layers'
    constants just in time, above the maps, so that more of the tail's constants are in SRAM when its first
    layer starts than with ``above`` (which prefetches in order of use), and the stream ends earlier; both
    compute TFLite's outputs exactly. Constant buffers are named ``<layer>.constants`` by the emitter. Where the
    classifier streams its weights, ``tail`` moves runs of its tiles in one DMA command (one latency for all)."""
    import npu_backend
    from npu_backend.codegen.prefetch import RUN_TILES
    from conftest import FIXTURES
    from npu_backend.codegen.lower import npu_regions, region_graph
    from npu_backend.codegen.schedule import ScheduleOptions

    model = FIXTURES / "tflite" / "mobilenet_v2_035_96.tflite"
    golden = np.load(model.with_suffix(".npz"))
    ((symbol, function),) = npu_regions(npu_backend.partition_for_npu(npu_backend.load_tflite(model))).items()
    graph = region_graph(function, symbol)
    names = [layer.name for layer in graph.layers]
    tail = set(names[names.index("conv2d_47"):])  # the tightest suffix (bench/bench_tail_bound.py)

    def run(policy: str):
        stream = lower_graph(graph, NPU_256, symbol, variants=(ScheduleOptions(policy, streamed_tiles=True),),
                             word_records=False)
        (name,) = [t.name for t in graph.inputs]
        outputs, stats = run_stream(stream, {name: golden["inputs"][0]})
        np.testing.assert_array_equal(next(iter(outputs.values())).reshape(golden["outputs"][0].shape),
                                      golden["outputs"][0])
        start = min(s.start for c, s in zip(stream.commands, stats.commands)
                    if c.opcode != Opcode.DMA_COPY and c.layer in tail)
        loaded = sum(c.payload.bytes_moved for c, s in zip(stream.commands, stats.commands)
                     if c.opcode == Opcode.DMA_COPY and c.payload.src_space == 0
                     and stream.buffers[c.payload.src_buffer].name.removesuffix(".constants") in tail
                     and s.start + s.cycles <= start)
        classifier = [c.payload.row_bytes for c in stream.commands if c.opcode == Opcode.DMA_COPY
                      and c.payload.src_space == 0
                      and stream.buffers[c.payload.src_buffer].name == f"{names[-1]}.constants"]
        return stats.total_cycles, loaded, classifier

    tail_cycles, tail_loaded, tail_moves = run("tail")
    above_cycles, above_loaded, above_moves = run("above")
    # the classifier's 63 tiles of 16 channels (the last smaller): ``above`` moves each in a DMA command of its own
    # (or in pieces: npu_backend.codegen.split_copies); tail moves most of them in runs of RUN_TILES per command;
    # the runs shrink towards the end (their compute must hide under the loads still to come), and the last
    # load moves one tile, so that only one tile's compute follows it
    chunk = max(above_moves)
    assert len(above_moves) >= 63 and sum(above_moves) == sum(tail_moves)
    assert len(tail_moves) < 20 and max(tail_moves) == RUN_TILES * chunk
    assert tail_moves[-1] <= chunk and tail_moves[-3:] == sorted(tail_moves[-3:], reverse=True)
    assert tail_loaded > above_loaded, (tail_loaded, above_loaded)
    assert tail_loaded > 0.75 * NPU_256.sram_bytes
    assert tail_cycles < above_cycles, (tail_cycles, above_cycles)


def test_channel_tiles_lie_last_first_in_dram():
    """Tiles are packed in DRAM in reverse order (the policies fill SRAM from the top down, so a tile placed just
    below the one before it lies just below it in DRAM too); each tile's chunk holds its own channels' weights
    then their scale/bias records, the last tile padded to a whole chunk."""
    from npu_backend.codegen.programs import row_program
    from npu_backend.codegen.steps import constant_layout, packed_constants, tile_offset
    from npu_backend.legality import check
    from npu_backend.ops import op_def

    p = random_params(np.random.default_rng(8), NpuOp.FULLY_CONNECTED, (1, 40), out_channels=40)
    _, _, prepared = check(op_def(p.op), p, NPU_256)
    program = row_program(p, prepared, [None], packed=True)
    chunk = constant_layout(program, 16, NPU_256.sram_align)[1]
    data = packed_constants(program, 16, NPU_256.sram_align)
    assert len(data) == 3 * chunk
    assert [tile_offset(program, 16, c0, NPU_256.sram_align) for c0 in (0, 16, 32)] == [2 * chunk, chunk, 0]
    weights = np.asarray(p.weights, np.int8)
    for c0, count in ((0, 16), (16, 16), (32, 8)):
        at = tile_offset(program, 16, c0, NPU_256.sram_align)
        assert data[at:at + count * 40] == weights[c0:c0 + count].tobytes()
        records = program.constants[1].data[c0 * 9:(c0 + count) * 9]
        assert data[at + count * 40:at + count * 40 + count * 9] == records


def test_constant_loads_next_to_each_other_in_dram_and_sram_merge_into_one():
    from npu_backend.codegen.emitter import coalesced
    from npu_backend.codegen.steps import ConstantsOf, Load

    def load(key, offset, address, size=100):
        sram = SramBuffer(f"b{address}", size)
        sram.address = address
        return Load(key, offset, sram, 0, size)

    fc, other = ConstantsOf(3, 16), ConstantsOf(4, 16)
    below = coalesced([load(fc, 200, 1000), load(fc, 100, 900), load(fc, 0, 700)])  # the third is not next to it
    assert [(m.offset, m.sram.address, m.row_bytes) for m in below] == [(100, 900, 200), (0, 700, 100)]
    above = coalesced([load(fc, 0, 500), load(fc, 100, 600)])
    assert [(m.offset, m.sram.address, m.row_bytes) for m in above] == [(0, 500, 200)]
    apart = [load(fc, 200, 1000), load(other, 100, 900)], [load(fc, 200, 1000), load(fc, 100, 800)], \
        [load(5, 200, 1000), load(5, 100, 900)]  # another layer's tile; not next in SRAM; a map's rows
    for loads in apart:
        assert coalesced(loads) == loads


def test_a_load_splits_around_the_bytes_a_compute_command_still_reads():
    """``_pieces``: the destination ranges of a load (as offsets into it) clear of the busy ranges, and the rest."""
    from npu_backend.codegen.split_copies import _pieces
    from simulator.isa import DmaCopy, MemorySpace

    load = DmaCopy(MemorySpace.DRAM, 3, 500, MemorySpace.SRAM, -1, 1000, 4000)
    assert _pieces(load, [(2000, 2500)]) == ([(0, 1000), (1500, 4000)], [(1000, 1500)])
    assert _pieces(load, [(0, 1200), (4800, 9000)]) == ([(200, 3800)], [(0, 200), (3800, 4000)])
    assert _pieces(load, [(6000, 7000)]) == ([(0, 4000)], [])


def test_the_free_bytes_of_a_waiting_copy_move_first_on_mobilenet_v2():
    """On 0.35-96 a classifier tile lands where the layer before the suffix still reads its constants, and the
    output store waits for the classifier's last tile: without the pass the DMA engine idles until those end.
    Split, the pieces move exactly the bytes each copy moved, the free ones first (the output's last piece is
    the last tile's scores); the stream computes TFLite's outputs exactly and ends earlier."""
    import npu_backend
    from conftest import FIXTURES
    from npu_backend.codegen import graph as lowering
    from npu_backend.codegen.lower import npu_regions, region_graph

    model = FIXTURES / "tflite" / "mobilenet_v2_035_96.tflite"
    golden = np.load(model.with_suffix(".npz"))
    ((symbol, function),) = npu_regions(npu_backend.partition_for_npu(npu_backend.load_tflite(model))).items()
    graph = region_graph(function, symbol)
    split = lower_graph(graph, NPU_256, symbol)
    original = lowering.split_waiting_copies
    try:
        lowering.split_waiting_copies = dependencies  # what the pass returns when it splits nothing
        whole = lower_graph(graph, NPU_256, symbol)
    finally:
        lowering.split_waiting_copies = original

    def loads(stream):
        return {(c.payload.src_buffer, c.payload.src_offset, c.payload.dst_offset, c.payload.row_bytes)
                for c in stream.commands if c.opcode == Opcode.DMA_COPY and c.payload.src_space == 0}

    gone, pieces = loads(whole) - loads(split), loads(split) - loads(whole)
    assert gone and len(pieces) > len(gone)
    for buffer, src, dst, size in gone:  # every split load is covered by its pieces, byte for byte
        mine = sorted((s, d, n) for b, s, d, n in pieces if b == buffer and src <= s < src + size)
        assert mine[0][:2] == (src, dst) and sum(n for *_, n in mine) == size
        assert all(a[0] + a[2] == b[0] and a[1] + a[2] == b[1] for a, b in zip(mine, mine[1:]))
    (name,) = [t.name for t in graph.inputs]
    outputs, stats = run_stream(split, {name: golden["inputs"][0]})
    np.testing.assert_array_equal(next(iter(outputs.values())).reshape(golden["outputs"][0].shape),
                                  golden["outputs"][0])
    assert stats.total_cycles < run_stream(whole, {name: golden["inputs"][0]})[1].total_cycles
    stores = [c.payload.row_bytes for c in split.commands if c.opcode == Opcode.DMA_COPY and c.payload.dst_space == 0]
    assert sum(stores) == 1000 and stores[-1] <= 16 and len(stores) > 1
