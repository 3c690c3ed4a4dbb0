"""How long quantizing a float MobileNetV2-1.0-224 takes: ``npu_backend.quantize`` against onnxruntime's
``quantize_static``, in the same run.

The float model is built here (``bench/mobilenet_v2_onnx.py``: standard topology, seeded He-initialised weights,
no download, no TensorFlow) and written to a temporary directory; both quantizers get the same 100 seeded random
calibration inputs:

  - onnxruntime ``quantize_static`` (QDQ, per-channel, int8, MinMax), the inputs through a
    ``CalibrationDataReader``; it reads the model file and writes the quantized one;
  - ours: ``npu_backend.load_model`` (TVM's ONNX importer) then ``npu_backend.quantize`` with the default
    ``QConfig``, every layer calibrated on the simulated NPU's own integers (a convolution's or matmul's from its
    exact integer sums and the simulator's output stage, :mod:`npu_backend.quantization.integer_sums`; an add's
    from its command's table of input pairs; the other layers' from their lowered streams), the float model run
    beside it on the first 16 samples (``QConfig.reference_samples``) for bias correction and the report's SQNR;
  - ours doing quantize_static's work: ``QConfig(float_reference=False, bias_correction=False)``, the quantized
    model's integers alone (no float pass, no SQNR).

Both use every core: onnxruntime its intra-op thread pool, ours its calibration threads
(:mod:`npu_backend.quantization.parallel`: the float model on a thread of its own, each layer's numpy work and
simulator batch shared between the threads; ``--threads`` sets how many). The three alternate ``--rounds``
times (the order reversed every other round), so that a busy machine slows all alike; the best round of each is
reported, with its ratio to onnxruntime's. Then ours once more (``--phases-of``: the default configuration or the
ranges-only one) with every phase timed: exclusive CPU time per phase (a phase called inside another is not counted
twice), on the main thread and on the others, how many layers calibration read from their integer sums and the
commands of the streams it lowered for the others (by what they do: a DMA through a DRAM scratch buffer is a spill
or a layout change), and the walk's wall time per layer kind.

    python bench/bench_quantize_speed.py [--samples 100] [--rounds 3] [--threads N] [--skip-ort] [--no-phases]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mobilenet_v2_onnx import calibration_inputs, write_mobilenet_v2  # noqa: E402


def ort_quantize(model: Path, inputs: np.ndarray, out: Path) -> None:
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter({"input": x} for x in inputs)

        def get_next(self):
            return next(self.items, None)

    quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)


def ours(model: Path, inputs: np.ndarray, progress=None, config=None):
    import npu_backend

    start = time.perf_counter()
    mod = npu_backend.load_model(model)
    imported = time.perf_counter() - start
    qmod = npu_backend.quantize(mod, inputs[:, 0], config, progress=progress)  # a batch on axis 0
    return imported, time.perf_counter() - start, qmod


def ranges_only():
    """Our QConfig doing what quantize_static does: ranges on the calibration set, nothing measured against the
    float model (no float pass, so no bias correction and no SQNR in the report)."""
    import npu_backend

    return npu_backend.QConfig(float_reference=False, bias_correction=False)


class Phases:
    """Exclusive CPU time of wrapped functions (the calling thread's, ``time.thread_time``), by phase name and by
    thread kind: on a machine shared with other work, CPU time says what each phase costs, wall time does not.

    Each thread keeps its own stack, so a phase called inside another on the same thread is not counted twice.
    Calibration runs on several threads (the float reference pass, and the worker threads that share each layer's
    numpy work); the main thread's column is its own CPU time, the others' runs beside it."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.other = defaultdict(float)
        self.calls = defaultdict(int)
        self._local = threading.local()
        self._undo = []
        self._main = threading.main_thread()

    def wrap(self, owner, attr: str, name: str) -> None:
        if isinstance(owner, dict):
            if attr not in owner:
                return
            original = owner[attr]
        else:
            if not hasattr(owner, attr):
                return  # the code moved on: the phase is left out rather than the bench broken
            original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            return self._timed(name, original, args, kwargs, True)

        self._replace(owner, attr, original, timed)

    def wrap_shared(self, owner, attr: str) -> None:
        """Charge the tasks a ``run_all`` shares out to the phase that shared them, whichever thread runs them."""
        if not hasattr(owner, attr):
            return
        original = getattr(owner, attr)

        @functools.wraps(original)
        def shared(task, items):
            stack = self._local.__dict__.setdefault("stack", [])
            name = stack[-1][0] if stack else "walk: everything else"
            return original(lambda item: self._timed(name, task, (item,), {}, False), items)

        self._replace(owner, attr, original, shared)

    def _timed(self, name, original, args, kwargs, count: bool):
        stack = self._local.__dict__.setdefault("stack", [])
        start = time.thread_time()
        stack.append([name, 0.0])
        try:
            return original(*args, **kwargs)
        finally:
            _, inner = stack.pop()
            total = time.thread_time() - start
            table = self.seconds if threading.current_thread() is self._main else self.other
            table[name] += total - inner
            self.calls[name] += count
            if stack:
                stack[-1][1] += total

    def _replace(self, owner, attr, original, replacement) -> None:
        if isinstance(owner, dict):
            owner[attr] = replacement
            self._undo.append(lambda: owner.__setitem__(attr, original))
        else:
            setattr(owner, attr, replacement)
            self._undo.append(lambda: setattr(owner, attr, original))

    def on_restore(self, undo) -> None:
        """Call ``undo`` when :meth:`restore` runs (a change made outside :meth:`wrap`)."""
        self._undo.append(undo)

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def instrument() -> Phases:
    import tvm

    import npu_backend
    import npu_backend.codegen as codegen
    import npu_backend.partition as partition
    import npu_backend.quantization as quantization
    import simulator.batch as batch
    from npu_backend.quantization import batched_float, integer_sums, kernels, observers, parallel, predicted, steps

    calibrate = sys.modules["npu_backend.quantization.calibrate"]  # the package's calibrate() shadows it
    from simulator.isa import Opcode

    simulated = "simulator: elementwise commands (batched)"
    timed = [  # (where, what, phase): a function each phase's CPU time is charged to
        (npu_backend.frontend.LOADERS, ".onnx", "import (TVM's ONNX importer)"),
        (quantization, "cut_layers", "layer cut"),
        (batched_float.WeightedPlan, "_sums_into", "conv/matmul sums, float and integer"),
        (batched_float, "_row_blocks", "conv/matmul sums, float and integer"),  # row-wise sums, blocked
        (integer_sums, "_channel_extremes", "integer sums: channel statistics"),
        (integer_sums, "channel_totals", "integer sums: channel statistics"),
        (batched_float, "finish_into", "float bias, clamp"),
        (kernels, "finish_rows", "float bias, clamp"),  # the float pass's fused finish (bias, totals, clamp)
        (steps.ElementwiseLayer, "run", "float elementwise layers (numpy)"),
        (steps.FloatLayers, "run", "float layers on TVM, per sample"),
        (steps._ReferenceState, "take", "walk: waiting for the float reference"),
        (tvm, "compile", "tvm.compile"),
        (partition, "partition_for_npu", "NPU layer: partition_for_npu"),
        (codegen, "lower_module", "NPU layer: lower to a stream"),
        (steps.NpuLayer, "_build", "NPU layer: lower to a stream"),
        (steps.NpuLayer, "__init__", "NPU layer: emit QDQ"),
        (steps, "layer_module", "NPU layer: emit QDQ"),
        (calibrate, "built_records", "NPU layer: check predicted records (batched builds)"),
        (calibrate, "predict", "NPU layer: predict a MAC record"),
        (steps, "run_stream_batch", "simulator: other (command loop, outputs)"),
        (batch, "mac_output", "simulator: MAC commands (batched)"),
        (batch, "_constant_mac", "simulator: MAC commands (batched)"),
        (batch, "_table_elementwise", simulated),
        (batch.PreparedBatch, "__init__", "simulator: prepare a stream (plans, tables)"),
        (batch.BATCHED, Opcode.DMA_COPY, "simulator: DMA commands (batched)"),
        (batch, "_fused_dma", "simulator: DMA layout transposes (fused)"),
        (batch.BATCHED, Opcode.ADD, simulated), (batch.BATCHED, Opcode.SUB, simulated),
        (batch.BATCHED, Opcode.MUL, simulated),
        (batch, "validate_stream", "simulator: validate"),
        (batch, "_BatchState", "simulator: load inputs, allocate memories"),
        (batch, "_per_sample", "simulator: other commands (per sample)"),
        (observers.TensorStats, "update_each", "observers: merge per-sample statistics"),
        (observers, "_moments", "observers: extremes and moments"),
        (observers, "_sample_counts", "observers: histograms"),
        (calibrate, "int8_summary", "observers: int8 output histograms"),
        (calibrate, "choose_range", "observers: choose_range"),
        (integer_sums.IntegerSums, "__init__", "integer sums: channel statistics"),
        (integer_sums.IntegerSums, "npu_outputs", "NPU output stage (from the sums)"),
        (integer_sums, "to_channels_first", "NPU output stage: int8 to channels first"),
        (calibrate, "centre_host", "centre int8 inputs (to channels last)"),
        (batched_float.LayerSums, "channel_extremes", "accumulator peaks"),
        (calibrate, "_accumulator_peaks", "accumulator peaks"),
        (batched_float.Observation, "accumulator_sums", "bias correction"),
        (calibrate, "_bias_shift", "bias correction"),
        (calibrate, "_energies", "SQNR energies"),
        (calibrate, "_quantized_energies", "SQNR energies"),
        (steps, "quantize_host", "quantize/dequantize on the host"),
        (steps, "dequantize_host", "quantize/dequantize on the host"),
        (calibrate, "quantize_host", "quantize/dequantize on the host"),
        (calibrate, "dequantize_host", "quantize/dequantize on the host"),
    ]
    phases = Phases()
    for owner, attr, name in timed:
        phases.wrap(owner, attr, name)
    for module in (batched_float, integer_sums, observers, steps, calibrate):
        phases.wrap_shared(module, "run_all")
    phases.wrap(quantization, "walk", "walk: everything else")
    phases.wrap(quantization, "emit_module", "emit the QDQ module")
    phases.wrap(quantization, "calibrate", "quantize: everything else")
    phases.workers = parallel.WORKERS
    phases.streams = count_streams(phases, steps.NpuLayer, predicted.PredictedLayer)
    return phases


def count_streams(phases: Phases, layer_class, predicted_class) -> Counter:
    """Commands of every stream calibration lowers for a layer, by what they do, and the layers that needed none
    (a MAC layer's outputs come from its integer sums, through its record as built or as predicted): wraps the
    classes' ``__init__`` and ``_build`` (outside the phase timer, :meth:`Phases.restore` puts them back)."""
    tally = Counter()
    init, build = layer_class.__init__, layer_class._build
    predicted_init = predicted_class.__init__

    @functools.wraps(predicted_init)
    def counted_predicted(self, *args, **kwargs):
        predicted_init(self, *args, **kwargs)
        tally["layers"] += 1
        if self.mac is not None:
            tally["MAC layers (no stream needed)"] += 1
            tally["of them predicted (built beside the walk)"] += 1
        else:
            tally["elementwise layers read from their predicted tables"] += 1

    @functools.wraps(init)
    def counted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tally["layers"] += 1
        tally["MAC layers (no stream needed)"] += self.mac is not None

    @functools.wraps(build)
    def counted_build(self):
        build(self)
        if self.stream is None:
            return
        tally["streams"] += 1
        for command in self.stream.commands:
            tally[command_kind(self.stream, command)] += 1

    layer_class.__init__, layer_class._build = counted_init, counted_build
    predicted_class.__init__ = counted_predicted
    phases.on_restore(lambda: (setattr(layer_class, "__init__", init), setattr(layer_class, "_build", build),
                               setattr(predicted_class, "__init__", predicted_init)))
    return tally


def command_kind(stream, command) -> str:
    """A DMA by the DRAM buffer it reads or writes (a scratch buffer: a spill, or a layout change through DRAM: an
    NCHW region transposes its input and output there one channel per command), or compute."""
    from simulator.isa import MemorySpace, Opcode

    if command.opcode != Opcode.DMA_COPY:
        return "compute"
    p = command.payload
    if MemorySpace.DRAM not in (p.src_space, p.dst_space):
        return "DMA within SRAM"
    dram, way = (p.src_buffer, "from") if p.src_space == MemorySpace.DRAM else (p.dst_buffer, "to")
    return f"DMA {way} {stream.buffers[dram].kind.name.lower()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="calibration threads (default: every core)")
    parser.add_argument("--skip-ort", action="store_true", help="time ours only")
    parser.add_argument("--no-phases", action="store_true", help="no instrumented run")
    parser.add_argument("--phases-of", choices=["default", "ranges"], default="default",
                        help="the configuration the instrumented run times (default: the default QConfig)")
    args = parser.parse_args()
    from npu_backend.quantization import parallel

    if args.threads:
        parallel.WORKERS = args.threads

    tmp = Path(tempfile.mkdtemp())
    model = write_mobilenet_v2(tmp / "mobilenet_v2_1.0_224.onnx", seed=0)
    inputs = calibration_inputs(args.samples, seed=1)
    print(f"MobileNetV2-1.0-224 float ONNX, seeded random weights ({model.stat().st_size / 1e6:.1f} MB, "
          f"{tmp}), {args.samples} seeded random calibration inputs")
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's pre-processing advice
    times = defaultdict(list)
    contenders = ("ours", "ranges", "ort")
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for who in order:
            if who == "ort" and args.skip_ort:
                continue
            start = time.perf_counter()
            if who == "ort":
                ort_quantize(model, inputs, tmp / "ort_qdq.onnx")
                times["ort"].append(time.perf_counter() - start)
            else:
                imported, total, _ = ours(model, inputs, config=ranges_only() if who == "ranges" else None)
                times[who].append(total)
                times[f"{who}: import"].append(imported)
            print(f"  round {r + 1}: {who:<6} {time.perf_counter() - start:7.2f} s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"\nbest of {args.rounds} rounds, wall time:" if best else "")
    print(f"  onnxruntime quantize_static (QDQ, per-channel, MinMax):          {best.get('ort', float('nan')):7.2f} s")
    labels = {"ours": "ours: load_model + quantize (default QConfig)",
              "ranges": "ours, ranges only (float_reference=False, no bias correction)"}
    for who, label in labels.items():
        if who in best:
            ratio = f"; ratio to onnxruntime {best[who] / best['ort']:.2f}" if "ort" in best else ""
            print(f"  {label + ':':<64} {best[who]:7.2f} s (import {best[who + ': import']:.2f} s{ratio})")

    if args.no_phases:
        return 0
    import npu_backend
    from npu_backend.quantization.layers import cut_layers

    layers, _ = cut_layers(npu_backend.load_model(model)["main"])
    per_kind = defaultdict(float)
    count = defaultdict(int)
    clock = [None]

    def progress(done, total):
        now = time.perf_counter()
        layer = layers[done - 1]
        per_kind[layer.kind.name] += now - clock[0]
        count[layer.kind.name] += 1
        clock[0] = now

    phases = instrument()
    start, cpu_start = time.perf_counter(), time.process_time()
    with contextlib.ExitStack() as stack:
        stack.callback(phases.restore)
        import npu_backend.quantization as quantization

        original_walk = quantization.walk

        def walk(*a, **k):
            clock[0] = time.perf_counter()
            return original_walk(*a, **k)

        quantization.walk = walk
        stack.callback(lambda: setattr(quantization, "walk", original_walk))
        ours(model, inputs, progress=progress, config=ranges_only() if args.phases_of == "ranges" else None)
    total = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    print(f"\nours, instrumented run: {total:.2f} s wall, {cpu:.2f} s CPU, {phases.workers} worker thread(s); "
          "exclusive CPU time per phase, on the main thread (share of all CPU time) and on the others (the float "
          "reference pass and the pool threads):")
    names = sorted(set(phases.seconds) | set(phases.other), key=lambda n: -(phases.seconds[n] + phases.other[n]))
    for name in names:
        seconds, other = phases.seconds[name], phases.other[name]
        print(f"  {name:<44} {seconds:7.2f} s  {other:6.2f} s  {100 * (seconds + other) / cpu:5.1f}%  "
              f"({phases.calls[name]} calls)")
    streams = phases.streams
    mac, guessed = "MAC layers (no stream needed)", "of them predicted (built beside the walk)"
    tables = "elementwise layers read from their predicted tables"
    kinds = sorted((k for k in streams if k not in ("streams", "layers", mac, guessed, tables)),
                   key=lambda k: -streams[k])
    print(f"calibration's NPU layers: {streams['layers']}, of which {streams[mac]} MAC layers read from their "
          f"integer sums ({streams[guessed]} through their predicted records) and {streams[tables]} elementwise "
          f"layers from their predicted commands' tables of input pairs, all checked against their builds beside "
          f"the walk; {streams['streams']} streams lowered, {sum(streams[k] for k in kinds):,} commands: "
          + ", ".join(f"{k} {streams[k]:,}" for k in kinds))
    print("calibration walk per layer kind (float, observers, simulator, NPU build):")
    for kind, seconds in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<12} {count[kind]:3d} layers {seconds:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
