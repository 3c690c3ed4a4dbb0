"""Calibration's fast paths against the exact ones they replace, value for value (bit for bit).

Calibration splits its numpy work between threads (npu_backend.quantization.parallel), observes a batch of
samples at once, reads accumulator extremes from the sums' extremes, computes unclamped elementwise layers with
numpy and runs the float model on a thread of its own: each must give exactly what the one-sample, one-thread,
TVM computation gives, or the chosen qparams would move.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import numpy as np
import pytest
import tvm
from tvm import relax

from float_models import float_cnn, float_conv_block, float_dense_chain
from npu_backend import NpuError, QConfig
from npu_backend.quantization import batched_float, calibrate, observers, parallel, steps
from npu_backend.quantization.calibrate import _float_accumulators
from npu_backend.quantization.layers import cut_layers
from npu_backend.quantization.observers import Batches, TensorStats
from npu_backend.quantization.rewrite import TensorQ
from npu_backend.quantization.steps import FloatLayers, ReferencePass, dequantize_host, quantize_host

RNG = np.random.default_rng(21)


def _fields(stats: TensorStats):
    return (stats.min, stats.max, stats.count, stats.zeros, stats.mean, stats.std, stats._range,
            stats._counts.tolist())


def _one_by_one(samples, bins=2048) -> TensorStats:
    stats = TensorStats(bins=bins)
    for sample in samples:
        stats.update(sample)
    return stats


# --- TensorStats.update_each: N updates in one call ----------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_update_each_is_one_update_per_sample(workers):
    # Growing ranges widen the histogram between samples; exact zeros come first (no grid yet); ints too.
    floats = np.clip(RNG.normal(0, 1, (9, 700)), 0, 6).astype(np.float32) * np.geomspace(0.1, 40, 9)[:, None]
    floats[:2] = 0.0
    ints = RNG.integers(-128, 128, (5, 300)).astype(np.int8)
    for samples, bins in ((floats.astype(np.float32), 2048), (floats.astype(np.float32), 8), (ints, 16)):
        with parallel.workers(workers):
            batched = TensorStats(bins=bins)
            batched.update_each(samples[:4])
            batched.update_samples(samples[4:])
        assert _fields(batched) == _fields(_one_by_one(samples, bins))


@pytest.mark.parametrize("block", [7, 1 << 17])
def test_histogram_blocks_count_what_one_pass_over_the_values_counts(block, monkeypatch):
    monkeypatch.setattr(observers, "HISTOGRAM_BLOCK", block)
    monkeypatch.setattr(observers, "_buffers", threading.local())
    values = RNG.normal(0, 1, 1000).astype(np.float32)
    values[:3] = [values.max() * -1.5, 0.0, values.max() * 1.5]  # the extremes land on the grid's ends
    stats = TensorStats(bins=64)
    stats.update(values)
    scale = 32 / stats._range
    want = np.bincount(np.clip(np.floor(values.astype(np.float64) * scale) + 32, 0, 63).astype(np.intp), minlength=64)
    assert stats._counts.tolist() == want.tolist()


def test_update_samples_takes_batches_arrays_and_iterables_alike():
    samples = RNG.normal(0, 2, (7, 50)).astype(np.float32)
    want = _fields(_one_by_one(samples))
    for form in (samples, Batches(lambda: iter([samples[:3], samples[3:]])), list(samples)):
        stats = TensorStats()
        stats.update_samples(form)
        assert _fields(stats) == want
    assert [s.tolist() for s in Batches(lambda: iter([samples[:3], samples[3:]]))] == samples.tolist()


def test_a_bad_sample_stops_update_each_where_separate_updates_stop():
    samples = RNG.normal(0, 1, (4, 20)).astype(np.float32)
    samples[2, 5] = np.nan
    stats = TensorStats()
    with pytest.raises(NpuError, match="NaN or infinite"):
        stats.update_each(samples)
    assert _fields(stats) == _fields(_one_by_one(samples[:2]))
    huge = np.array([[1e-300], [1e308], [-1e308]])
    stats = TensorStats()
    with pytest.raises(NpuError, match="overflow the histogram's range"):
        stats.update_each(huge)
    assert (stats.count, stats.max) == (1, 1e-300)  # the sample that could not widen the grid is not in


# --- float layers: chunks on threads, fused bias and clamp ----------------------------------------------------------

def _conv_layer(layout, kernel_layout, groups, shape, out, **kwargs):
    (layer,), folded = cut_layers(float_conv_block(RNG, layout, kernel_layout, groups, shape, out, **kwargs)["main"])
    return layer, folded


LAYERS = {
    "pointwise NCHW": ("NCHW", "OIHW", 1, (1, 16, 6, 5), 24, dict(k=1)),
    "strided NCHW (gathered taps)": ("NCHW", "OIHW", 1, (1, 3, 9, 8), 10, dict(strides=[2, 2], padding=[1, 1, 1, 1])),
    "depthwise NCHW": ("NCHW", "OIHW", 8, (1, 8, 7, 7), 8, dict(padding=[1, 1, 1, 1])),
    "NHWC": ("NHWC", "HWIO", 1, (1, 9, 8, 6), 10, dict(padding=[1, 1, 1, 1], dilation=[2, 2])),
    "NCHW, width = channels": ("NCHW", "OIHW", 1, (1, 3, 6, 8), 8, dict(padding=[1, 1, 1, 1])),
}


def test_per_channel_statistics_follow_the_layout_not_the_shape():
    # An NCHW output [1, 8, 6, 8] ends in 8 = its channel count: a guess from the shape would sum over channels.
    layer, _ = _conv_layer(*LAYERS["NCHW, width = channels"][:5], **dict(LAYERS["NCHW, width = channels"][5]))
    acc = RNG.normal(0, 1, (4, 1, 8, 6, 8)).astype(np.float32)
    assert layer.batch_reduction(acc.ndim) == (0, 1, 3, 4)
    summary = _float_accumulators(QConfig(), layer, acc)
    assert summary.totals.tobytes() == np.sum(acc, axis=(0, 1, 3, 4), dtype=np.float64).tobytes()
    assert summary.count == 4 * 6 * 8


@pytest.mark.parametrize("name", LAYERS)
def test_float_layers_are_the_same_on_any_number_of_threads(name, monkeypatch):
    layer, _ = _conv_layer(*LAYERS[name][:5], **dict(LAYERS[name][5]))
    plan = batched_float.plan_weighted(layer)
    assert plan is not None
    x = RNG.normal(0, 1, (7, *[int(d) for d in layer.inputs[0].ty.shape.values])).astype(np.float32)
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", x[0].size * 2)  # chunks of 2 samples, one of 1
    with parallel.workers(1):
        acc1, out1 = plan.finished(layer, x, layer.weight, layer.bias)
        sums1 = plan.sums(x, layer.weight)
    with parallel.workers(2):
        acc2, out2 = plan.finished(layer, x, layer.weight, layer.bias)
        sums2 = plan.sums(x, layer.weight)
    for a, b in ((acc1, acc2), (out1, out2), (sums1, sums2)):
        assert a.tobytes() == b.tobytes()
    # the fused finish is the unfused one: sums, plus the bias in its own shape, then the clamp, all float32 (none
    # of these layers is row-wise: those are finished block by block, test_a_row_wise_float_layer_is_finished...)
    bias = layer.bias.astype(np.float32).reshape(layer.bias_shape)
    assert acc1.tobytes() == (sums1 + bias).tobytes()
    assert out1.tobytes() == np.clip(sums1 + bias, np.float32(0), np.float32(6)).tobytes()


@pytest.mark.parametrize("name", LAYERS)
def test_the_reference_pass_keeps_the_accumulators_totals_and_the_same_outputs(name, monkeypatch):
    layer, _ = _conv_layer(*LAYERS[name][:5], **dict(LAYERS[name][5]))
    plan = batched_float.plan_weighted(layer)
    x = RNG.normal(0, 1, (5, *[int(d) for d in layer.inputs[0].ty.shape.values])).astype(np.float32)
    outputs = math.prod(int(d) for d in layer.output.ty.shape.values)
    # chunks of 2, 2 and 1 samples: a chunk holds so many of the inputs or of the outputs, whichever are more
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", max(x[0].size, outputs) * 2)
    acc, out = plan.finished(layer, x, layer.weight, layer.bias)
    totals, clamped = plan.finished(layer, x, layer.weight, layer.bias, totals_only=True)
    assert clamped.tobytes() == out.tobytes()  # clamped in place: the same float32 values
    others = layer.batch_reduction(acc.ndim)
    assert len(totals.parts) == 3 and totals.count == acc.size // acc.shape[1 + layer.output_axis]
    for part, rows in zip(totals.parts, (slice(0, 2), slice(2, 4), slice(4, 5))):
        assert part.tobytes() == np.sum(acc[rows], axis=others, dtype=np.float64).tobytes()
    np.testing.assert_allclose(totals.totals, np.sum(acc, axis=others, dtype=np.float64), rtol=1e-12)


@pytest.mark.parametrize("row_wise", ["pointwise channels last", "dense"])
@pytest.mark.parametrize("totals_only", [False, True])
def test_a_row_wise_float_layer_is_finished_block_by_block(row_wise, totals_only, monkeypatch):
    """A pointwise (channels last) or dense float layer forms its sums a block of rows at a time and adds its bias,
    totals its accumulators and clamps each block while it is in cache. Dyadic inputs and weights make every sum
    exact in any order, so the blocks must give the unblocked values bit for bit, one total per block."""
    if row_wise == "dense":
        (layer,), _ = cut_layers(float_dense_chain([RNG.integers(-16, 17, (24, 16)) / 16], relu=False)["main"])
        plan = batched_float.plan_weighted(layer)
        shape = (1, 24)
    else:
        layer, _ = _conv_layer(*LAYERS["pointwise NCHW"][:5], **dict(LAYERS["pointwise NCHW"][5]))
        layer.weight[...] = RNG.integers(-16, 17, layer.weight.shape) / 16
        plan = dataclasses.replace(batched_float.plan_weighted(layer), channels_first=False)
        shape = (1, 6, 5, 16)  # the NCHW layer's input, channels last
    bias = (RNG.integers(-64, 65, layer.bias.shape) / 4).astype(np.float32)
    x = (RNG.integers(-48, 49, (5, *shape)) / 8).astype(np.float32)
    outputs = x[0].size // shape[-1] * layer.weight.shape[layer.weight_axis]
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", max(x[0].size, outputs) * 2)  # chunks of 2, 2 and 1
    rows_per_block = 1 if row_wise == "dense" else 4  # a dense sample is one row
    monkeypatch.setattr(batched_float, "BLOCK_ELEMENTS", rows_per_block * layer.weight.shape[layer.weight_axis])
    blocks = []
    original = batched_float._row_blocks
    monkeypatch.setattr(batched_float, "_row_blocks", lambda *args: blocks.append(original(*args)) or blocks[-1])
    acc, out = plan.finished(layer, x, layer.weight, bias, totals_only)
    rows = x.reshape(-1, shape[-1]) @ plan._row_matrix(np.transpose(layer.weight, plan.weight_order)
                                                        if plan.conv is not None else layer.weight)
    want = (rows + bias.reshape(-1)).reshape(out.shape)
    clamped = want if layer.clamp is None else np.clip(want, np.float32(0), np.float32(6))
    assert len(blocks) == 3 and sum(len(b) for b in blocks) > 3  # every chunk, cut into blocks
    assert out.tobytes() == clamped.astype(np.float32).tobytes()
    if totals_only:
        assert len(acc.parts) == sum(len(b) for b in blocks) and acc.count == want.size // want.shape[-1]
        assert acc.totals.tobytes() == want.reshape(-1, want.shape[-1]).sum(axis=0, dtype=np.float64).tobytes()
    else:
        assert acc.tobytes() == want.astype(np.float32).tobytes()


@pytest.mark.parametrize("name", LAYERS)
def test_an_observation_reads_what_the_chunks_hold(name, monkeypatch):
    layer, _ = _conv_layer(*LAYERS[name][:5], **dict(LAYERS[name][5]))
    plan = batched_float.plan_weighted(layer)
    x = RNG.normal(0, 1, (5, *[int(d) for d in layer.inputs[0].ty.shape.values])).astype(np.float32)
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 1)  # one sample a chunk
    sums = batched_float.LayerSums(layer, plan.sums(x, layer.weight))
    bias = RNG.normal(0, 0.5, layer.bias.shape).astype(np.float32)
    observed = sums.observed(layer, bias)
    acc = sums.sums + bias.reshape(layer.bias_shape)
    axis = 2 if layer.bindings[0].value.attrs.data_layout == "NCHW" else acc.ndim - 1  # [N, 1, C, H, W] / [N, .., C]
    others = tuple(a for a in range(acc.ndim) if a != axis)
    low, high = observed.accumulator_extremes()  # from the sums' extremes: monotone float32 addition
    assert low.tobytes() == acc.min(axis=others).astype(np.float64).tobytes()
    assert high.tobytes() == acc.max(axis=others).astype(np.float64).tobytes()
    parts = observed.accumulator_sums()
    assert len(parts) == 5
    for n, part in enumerate(parts):
        assert part.tobytes() == np.sum(acc[n:n + 1], axis=others, dtype=np.float64).tobytes()
    batches = [b.copy() for b in observed.output_batches()]
    assert np.concatenate(batches).tobytes() == np.clip(acc, np.float32(0), np.float32(6)).tobytes()


def _elementwise_model(op):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((1, 4, 5, 6), "float32"))
    b = relax.Var("b", relax.TensorType((1, 1, 1, 6), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            y = bb.emit(op(a, b))
            y = bb.emit(relax.op.add(y, relax.const(RNG.normal(0, 1, (1, 1, 5, 1)).astype(np.float32))))
            result = bb.emit_output(y)
        bb.emit_func_output(result)
    return bb.get()["main"]


@pytest.mark.parametrize("op", [relax.op.add, relax.op.subtract, relax.op.multiply])
def test_numpy_elementwise_layers_equal_tvms(op):
    layers, folded = cut_layers(_elementwise_model(op))
    floats = FloatLayers(layers, folded)
    assert all(floats.elementwise[layer.index] is not None for layer in layers)
    tvm_layers = FloatLayers._compile(layers, folded)
    a = (RNG.normal(0, 1, (3, 1, 4, 5, 6)) * 10).astype(np.float32)
    b = RNG.normal(0, 1, (3, 1, 1, 1, 6)).astype(np.float32)
    with parallel.workers(2):
        _, first = floats.run_batch(layers[0], [a, b])
        constants = list(layers[1].constants.values())
        _, second = floats.run_batch(layers[1], [first], constants=constants)
    for n in range(3):
        want = tvm_layers[f"layer_{layers[0].index}"](tvm.runtime.tensor(a[n]), tvm.runtime.tensor(b[n])).numpy()
        assert first[n].tobytes() == want.tobytes()
        want = tvm_layers[f"layer_{layers[1].index}"](tvm.runtime.tensor(want),
                                                       tvm.runtime.tensor(constants[0])).numpy()
        assert second[n].tobytes() == want.tobytes()


def test_only_unclamped_binary_layers_leave_tvm():
    layers, folded = cut_layers(float_cnn()["main"])
    floats = FloatLayers(layers, folded)
    numpy_kinds = sorted(layer.kind.name for layer in layers if floats.elementwise[layer.index] is not None)
    assert numpy_kinds == ["add", "multiply"]  # the residual add and the squeeze-excite multiply
    assert all(floats.elementwise[layer.index] is None for layer in layers if layer.clamp is not None)


def test_host_quantize_split_between_threads_equals_one_pass(monkeypatch):
    x = (RNG.standard_normal((5, 3 * steps.HOST_BLOCK + 11)) * 6).astype(np.float32)
    q = TensorQ(0.047, -3)
    with parallel.workers(1):
        want_q, want_d = quantize_host(x, q), dequantize_host(x.astype(np.int8), q)
    monkeypatch.setattr(steps, "CHUNK_ELEMENTS", steps.HOST_BLOCK)
    with parallel.workers(2):
        assert len(steps._spans(x.size)) == 2
        assert quantize_host(x, q).tobytes() == want_q.tobytes()
        assert dequantize_host(x.astype(np.int8), q).tobytes() == want_d.tobytes()


# --- the float reference pass on its own thread ---------------------------------------------------------------------

def test_reference_pass_gives_each_layer_in_order_and_hands_over_errors():
    layers, folded = cut_layers(float_cnn()["main"])
    floats = FloatLayers(layers, folded)
    x = RNG.random((4, 1, 8, 8, 1)).astype(np.float32)
    param = float_cnn()["main"].params[0]
    (param,) = [v for v in layers[0].inputs]
    last_use = {v: layer.index for layer in layers for v in layer.inputs}
    values = {param: x}
    pending = ReferencePass(floats, layers, values, last_use, keep=())
    for layer in layers:
        got = pending.take(layer)
        want = floats.run_batch(layer, [values[v] for v in layer.inputs], layer.weight, layer.bias,
                                list(layer.constants.values()))
        values[layer.output] = want[1]
        assert got[1].tobytes() == want[1].tobytes()
        assert (got[0] is None) == (want[0] is None)
    broken = ReferencePass(floats, layers, {}, last_use, keep=())  # no input values: the first layer fails
    with pytest.raises(KeyError):
        broken.take(layers[0])


# --- the whole calibration ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [QConfig(), QConfig(calibration="kl", rounding="onnxruntime"),
                                    QConfig(accumulator_bits=16, avoid_overflow=True, calibration="mse"),
                                    QConfig(reference_samples=3)],
                         ids=["default", "kl", "acc16-mse", "reference-3"])
def test_calibration_is_the_same_on_one_thread_and_many(config, monkeypatch):
    calibration = RNG.random((10, 8, 8, 1)).astype(np.float32)
    # Small chunks, so that every batch is cut into several (a chunk's rows decide how BLAS sums, so both runs
    # cut alike); the many-thread run also splits every simulator batch (integers: exact however it is cut).
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 64)
    with parallel.workers(1):
        one = calibrate(float_cnn(), calibration, config)
    monkeypatch.setattr(steps, "NPU_SPLIT_ELEMENTS", 1)
    with parallel.workers(2):
        many = calibrate(float_cnn(), calibration, config)
    assert many.report.to_json() == one.report.to_json()
    assert {i: (w.weight.tobytes(), w.bias.tobytes() if w.bias is not None else None)
            for i, w in many._plan.weights.items()} == {
        i: (w.weight.tobytes(), w.bias.tobytes() if w.bias is not None else None) for i, w in one._plan.weights.items()}
    assert list(many._plan.tensors.values()) == list(one._plan.tensors.values())
    test = RNG.random((3, 8, 8, 1)).astype(np.float32)
    for a, b in zip(many.simulate(test), one.simulate(test)):
        assert a[0].tobytes() == b[0].tobytes()
    assert math.isfinite(one.report.output_sqnr_db)


def test_minmax_ranges_from_extremes_equal_the_observers_and_summaries_come_from_the_int8_values(monkeypatch):
    """With minmax, every tensor's range comes from its extremes alone (the model input, each layer's output
    whatever computes it): the qparams the full observer chose before, and the record's summary is the exact
    histogram of the int8 values the tensor quantizes to."""
    import importlib

    calibration = importlib.import_module("npu_backend.quantization.calibrate")  # the package's name is a function
    samples = RNG.random((6, 8, 8, 1)).astype(np.float32)
    observed = []
    update_samples = TensorStats.update_samples
    monkeypatch.setattr(TensorStats, "update_samples", lambda self, v: (observed.append(1), update_samples(self, v)))
    fast = calibrate(float_cnn(), samples, QConfig())
    only_output = len(observed)  # the model's output alone: its headroom is cross-validated on its samples
    monkeypatch.setattr(calibration, "_finite_extremes", lambda values: None)  # every range through _choose
    monkeypatch.setattr(calibration, "_output_extremes", lambda chunks: None)
    full = calibrate(float_cnn(), samples, QConfig())
    assert len(observed) - 2 * only_output >= 5  # the input and the layers' outputs observed in full
    assert list(fast._plan.tensors.values()) == list(full._plan.tensors.values())
    fast_entries = {t.name: t for t in fast.report.tensors}
    full_entries = {t.name: t for t in full.report.tensors}
    assert fast_entries.keys() == full_entries.keys() and len(fast_entries) > 5
    for name, entry in fast_entries.items():
        other = full_entries[name]
        assert (entry.min, entry.max, entry.scale, entry.zero_point, entry.method) == (
            other.min, other.max, other.scale, other.zero_point, other.method)
        assert entry.histogram["count"] == other.histogram["count"]
        # the summary's histogram is the int8 levels': each bin one level wide
        assert entry.histogram["mean"] == pytest.approx(other.histogram["mean"], abs=entry.scale)


def test_deferred_work_runs_beside_the_caller_in_order_and_hands_over_errors():
    results = []

    def task(k):
        results.append(k)
        if k == 3:
            raise ValueError("three")
        return k * k

    with parallel.workers(2):
        later = parallel.Deferred(limit=2)
        futures = [later.submit(task, k) for k in range(6)]
        later.close()
    assert results == list(range(6))  # one thread: in submission order
    assert [f.result() for f in futures if f is not futures[3]] == [0, 1, 4, 16, 25]
    with pytest.raises(ValueError, match="three"):
        futures[3].result()
    with parallel.workers(1):  # inline on the caller, no thread
        later = parallel.Deferred()
        future = later.submit(threading.current_thread)
        later.close()
    assert future.result() is threading.current_thread()


def test_extremes_of_batches_see_a_nan_in_any_batch():
    """min/max skip a NaN that numpy's own min or max returns for a whole batch; the range must not come from the
    other batches then: None, so that the full observer says what is wrong."""
    import importlib

    calibration = importlib.import_module("npu_backend.quantization.calibrate")

    def batches(*parts):
        return Batches(lambda: iter([np.array(p, np.float32) for p in parts]))

    assert calibration._finite_extremes(batches([[1.0, 2.0]], [[-3.0, 5.0]])) == (-3.0, 5.0)
    for parts in (([[1.0, 2.0]], [[np.nan, 5.0]]), ([[np.nan, 2.0]], [[1.0, 5.0]]), ([[1.0, np.inf]],)):
        assert calibration._finite_extremes(batches(*parts)) is None
    assert calibration._finite_extremes(np.array([[0.5, np.nan]], np.float32)) is None


def _on_the_pool() -> bool:
    return threading.current_thread().name.startswith("npu-quantize_")  # the pool's threads, not the deferred one


def test_run_all_does_not_wait_for_a_pool_thread_busy_with_another_caller():
    """Two callers share the pool (the walk and the float model's pass): while the pool thread is held by one,
    the other runs all its items itself and returns, its helper withdrawn rather than waited for."""
    release, blocked = threading.Event(), threading.Event()

    def held(k):
        if _on_the_pool():
            blocked.set()
            release.wait(10)
        else:
            blocked.wait(10)  # the caller's items wait until the pool's helper has taken one
        return k

    with parallel.workers(2):
        other = threading.Thread(target=lambda: parallel.run_all(held, range(40)))
        other.start()
        try:
            assert blocked.wait(10)  # the pool thread now holds an item of the other caller's
            started = time.perf_counter()
            assert parallel.run_all(lambda k: k * k, range(7)) == [k * k for k in range(7)]
            assert time.perf_counter() - started < 5 and not release.is_set()
        finally:
            release.set()
            other.join(10)
    assert not other.is_alive()


def test_a_pipeline_stage_shares_the_pool():
    """The float model's pass (a spawned stage) hands part of its items to the pool, in order either way."""
    names, pooled, done = [], threading.Event(), threading.Event()

    def task(k):
        names.append(threading.current_thread().name)
        if _on_the_pool():
            pooled.set()
        else:
            pooled.wait(10)  # the stage's own items wait until the pool has taken one
        return -k

    results = []
    with parallel.workers(2):
        parallel.spawn(lambda: (results.append(parallel.run_all(task, range(12))), done.set()), "stage")
        assert done.wait(30)
    assert results == [[-k for k in range(12)]]
    assert "stage" in names and any(n.startswith("npu-quantize_") for n in names)


@pytest.mark.parametrize("count, size, sizes", [
    (100, (1 << 20) // 83, [50, 50]),  # not 83 and 17
    (13, (1 << 20) // 3, [3, 3, 3, 2, 2]),  # not 3, 3, 3, 3, 1
    (100, (1 << 20) // 16, [15] * 2 + [14] * 5),  # not 16 x 6 and 4
    (10, (1 << 20) // 4, [4, 3, 3]), (7, 1 << 21, [1] * 7), (3, 5, [3]), (0, 9, [])])
def test_chunks_cover_the_batch_in_near_equal_parts_whatever_the_threads(count, size, sizes):
    """At most CHUNK_ELEMENTS values a chunk (or one sample), as few chunks as that allows, their sizes one
    sample apart at most and the larger first; the same on one thread or eight."""
    with parallel.workers(1):
        parts = batched_float.chunks(count, size)
    with parallel.workers(8):
        assert batched_float.chunks(count, size) == parts
    assert [p.stop - p.start for p in parts] == sizes
    assert [k for p in parts for k in range(p.start, p.stop)] == list(range(count))


def test_a_weighted_layer_is_chunked_by_its_inputs_or_outputs_whichever_are_more(monkeypatch):
    """A pointwise layer widening 16 channels to 24 is cut by its outputs' size, in its sums as in its finish."""
    layer, _ = _conv_layer(*LAYERS["pointwise NCHW"][:5], **dict(LAYERS["pointwise NCHW"][5]))
    plan = dataclasses.replace(batched_float.plan_weighted(layer), channels_first=False)
    x = RNG.normal(0, 1, (5, 1, 6, 5, 16)).astype(np.float32)
    seen = []
    original = batched_float.chunks
    monkeypatch.setattr(batched_float, "chunks", lambda count, size: seen.append(size) or original(count, size))
    plan.sums(x, layer.weight)
    plan.sums(np.zeros(x.shape, np.int8), layer.weight.astype(np.float32), then=lambda block: None, zero_point=3)
    plan.finished(layer, x, layer.weight, layer.bias)
    assert seen == [6 * 5 * 24] * 3


def test_run_all_on_a_stage_survives_the_thread_count_changing_on_another_thread():
    """The stage and the caller of workers() both reach the pool: a pool remade for another size must not be
    shut down under a submission (once 1,791 'cannot schedule new futures after shutdown' errors in 3 s)."""
    errors, stop = [], threading.Event()

    def stage():
        while not stop.is_set():
            try:
                assert parallel.run_all(lambda k: k + 1, range(6)) == list(range(1, 7))
            except BaseException as error:  # noqa: BLE001 - collected for the assertion below
                errors.append(error)

    with parallel.workers(2):
        thread = parallel.spawn(stage, "stage")
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            for count in (3, 1, 2):
                with parallel.workers(count):
                    time.sleep(0.001)
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and errors == []


def test_a_batch_given_whole_is_read_in_place_and_any_other_stacked():
    """Calibration data given as one batch is walked where it lies (no copy of the batch); samples from separate
    arrays, or not one after the other, are stacked; either way the walk gets the same values, read-only."""
    from npu_backend.quantization import calibration_samples
    from npu_backend.quantization.calibrate import batch_of

    batch = np.random.default_rng(0).normal(0, 1, (5, 1, 3, 4, 4)).astype(np.float32)[:, 0]
    param = relax.Var("x", relax.TensorType((1, 3, 4, 4), "float32"))
    whole = batch_of([s[0] for s in calibration_samples(batch, [param])])
    assert np.shares_memory(whole, batch) and not whole.flags.writeable
    np.testing.assert_array_equal(whole, batch[:, None])  # samples [1, 3, 4, 4], as np.stack gives them
    for samples in ([batch[k:k + 1].copy() for k in range(5)], [batch[k:k + 1] for k in (0, 2, 4)],
                    [batch[k:k + 1] for k in (1, 0)]):
        stacked = batch_of(samples)
        assert not np.shares_memory(stacked, batch) and not stacked.flags.writeable
        np.testing.assert_array_equal(stacked, np.stack(samples))


def test_samples_from_an_iterable_are_copied_as_they_are_read():
    """A loader that refills one buffer and yields it each time gives each sample its own values: what an
    iterable yields is copied (a batch given whole is read in place, above)."""
    from npu_backend.quantization import calibration_samples

    param = relax.Var("x", relax.TensorType((1, 3, 4, 4), "float32"))
    buffer = np.zeros((1, 3, 4, 4), np.float32)

    def refilled():
        for k in range(4):
            buffer[...] = k
            yield buffer

    samples = calibration_samples(refilled(), [param])
    assert [float(s[0].mean()) for s in samples] == [0.0, 1.0, 2.0, 3.0]
