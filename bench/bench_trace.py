"""The profile views on real and hand-built streams: traces to open in Perfetto, and what they cost.

Writes, into ``--out`` (default ./trace_bench):
  * ``two_layers.json``: tests/test_timeline.py's hand-built two-layer stream with its dependencies: conv1
    runs on the compute track while the DMA track prefetches conv2's weights;
  * ``model.json`` / ``model.png``: every NPU region of a model (default: the bundled MobileNetV2-0.35-96)
    as the codegen emits it, its trace and its roofline plot.
and prints, per profile, cycles, busy cycles per engine and the cycles both ran, the last measured twice:
by the profile (``Profile.overlap_cycles``) and from the written trace file alone (the nanoseconds in which a
``dma`` slice and a ``compute`` slice are both open), which must agree; then the wall-clock of the views
against the simulation itself (best of ``--runs``).

    python bench/bench_trace.py [--model PATH] [--preset npu-256] [--out DIR] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import npu_backend
from npu_backend.codegen.lower import lower_module
from npu_backend.profiling import Profile
from simulator import BufferKind, run_stream
from simulator.hazards import dependencies
from simulator.opcodes import Engine

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "tflite" / "mobilenet_v2_035_96.tflite"


def _best_of(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _overlap_in_trace(path: Path) -> int:
    """Nanoseconds in which a dma slice and a compute slice of the trace file are both open."""
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    edges = []
    for e in events:
        if e["ph"] == "X" and tracks[e["tid"]] in ("dma", "compute"):
            start, end = round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)
            edges += [(start, 1), (end, -1)]
    both, open_, last = 0, 0, 0
    for t, step in sorted(edges):
        if open_ == 2:
            both += t - last
        open_, last = open_ + step, t
    return both


def _report(label: str, prof: Profile, trace: Path) -> bool:
    total = prof.total_cycles
    busy = {engine: prof.busy_cycles(engine) for engine in Engine}
    clock = prof.runs[0][1].config.clock_mhz
    in_trace = _overlap_in_trace(trace)
    print(f"{label:<20} {total:>9} cycles  dma busy {busy[Engine.DMA]:>9}  compute busy {busy[Engine.COMPUTE]:>9}  "
          f"both {prof.overlap_cycles:>8} ({prof.overlap_cycles / total:.1%}); in the trace file: {in_trace} ns "
          f"= {in_trace * clock / 1000:.0f} cycles at {clock} MHz")
    return in_trace * clock == prof.overlap_cycles * 1000


def _random_inputs(stream, rng) -> dict:
    inputs = {}
    for _, buf in stream.buffers_of(BufferKind.INPUT):
        info = np.iinfo(buf.dtype)
        inputs[buf.name] = rng.integers(info.min, info.max + 1, buf.shape).astype(buf.dtype)
    return inputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--preset", default="npu-256")
    parser.add_argument("--out", type=Path, default=Path("trace_bench"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT / "tests"))
    from test_timeline import CONFIG, _stream, two_layers

    _, stats = run_stream(_stream(dependencies(two_layers(), CONFIG)), {"x": np.ones((1, 4, 4, 16), np.int8)})
    hand = Profile([("two_layers", stats)])
    hand.to_chrome_trace(args.out / "two_layers.json")
    agree = _report("two_layers", hand, args.out / "two_layers.json")

    partitioned = npu_backend.partition_for_npu(npu_backend.load_model(str(args.model)), args.preset)
    streams = lower_module(partitioned)
    rng = np.random.default_rng(0)
    inputs = {symbol: _random_inputs(stream, rng) for symbol, stream in streams.items()}
    prof = Profile([(symbol, run_stream(stream, inputs[symbol])[1]) for symbol, stream in streams.items()])
    prof.to_chrome_trace(args.out / "model.json")
    prof.plot(args.out / "model.png")
    agree &= _report(args.model.stem, prof, args.out / "model.json")
    print(f"overlap from the profile and from the trace file agree: {agree}")

    def simulate():
        for symbol, stream in streams.items():
            run_stream(stream, inputs[symbol])

    simulate_ms = _best_of(simulate, args.runs)
    trace_ms = _best_of(lambda: prof.to_chrome_trace(args.out / "timing.json"), args.runs)
    table_ms = _best_of(prof.summary, args.runs)
    plot_ms = _best_of(lambda: prof.plot(args.out / "timing.png"), args.runs)
    commands = sum(len(s.commands) for s in streams.values())
    print(f"{args.model.name} on {args.preset}, {commands} commands: simulate {simulate_ms:.1f} ms, "
          f"trace {trace_ms:.1f} ms ({trace_ms / simulate_ms:.2f}x), summary {table_ms:.1f} ms "
          f"({table_ms / simulate_ms:.2f}x), plot {plot_ms:.1f} ms ({plot_ms / simulate_ms:.2f}x)")
    print(f"traces and plots in {args.out}/ (open the .json files in https://ui.perfetto.dev)")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
