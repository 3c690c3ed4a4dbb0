"""The views of a profile: the Chrome trace, the per-layer table with its bound rule, the roofline plot, and
``npu run|sim --trace --plot --repeat``.

The hand-built stream is tests/test_timeline.py's two-layer stream, whose schedule on npu-256 (500 MHz, so
2 ns a cycle) is worked out there: DMAs [0, 96), [96, 192), [192, 280); conv1 [280, 344) beside the DMA
[280, 376) that prefetches conv2's weights; DMA [376, 464); conv2 [464, 528); the store [528, 624).
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys

import numpy as np
import pytest

from npu_backend.chrome_trace import TRACKS, chrome_trace
from npu_backend.cli import main
from npu_backend.errors import NpuError
from npu_backend.profiling import LayerRow, Profile, overlap_cycles
from simulator import get_config, run_stream
from simulator.hazards import dependencies
from simulator.isa import Opcode
from simulator.machine import CommandStats, RunStats
from simulator.opcodes import Engine
from simulator.stream import encode_stream
from test_timeline import CONFIG, _stream, two_layers

X = np.ones((1, 4, 4, 16), np.int8)


def _overlapped() -> RunStats:
    return run_stream(_stream(dependencies(two_layers(), CONFIG)), {"x": X})[1]


def _serial() -> RunStats:
    """The same commands without dependencies: each waits for the previous one (688 cycles)."""
    return run_stream(_stream(two_layers()), {"x": X})[1]


def _dma(index, start, cycles, layer="dma", deps=()):
    return dict(index=index, opcode=Opcode.DMA_COPY, layer=layer, cycles=cycles, start=start, engine=Engine.DMA,
                deps=deps)


# The trace.

def _metadata() -> list[dict]:
    return [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "NPU npu-256 (500 MHz)"}},
            {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "calls"}},
            {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 1, "args": {"sort_index": 0}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "dma"}},
            {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 2, "args": {"sort_index": 1}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "compute"}},
            {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 3, "args": {"sort_index": 2}}]


def _command(tid, name, cat, ts, dur, index, layer, cycles, start, macs=0, read=0, write=0, deps=()):
    return {"name": name, "cat": cat, "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"call": 0, "index": index, "layer": layer, "cycles": cycles, "start_cycle": start,
                     "macs": macs, "dram_read_bytes": read, "dram_write_bytes": write, "deps": list(deps)}}


def test_the_trace_of_the_two_layer_stream_is_exact(tmp_path):
    path = tmp_path / "t.json"
    Profile([("overlapped", _overlapped())]).to_chrome_trace(path)
    trace = json.loads(path.read_text())
    assert list(trace) == ["traceEvents", "otherData"]  # no displayTimeUnit: Perfetto would read ts in it
    dma, compute = 2, 3
    assert trace["traceEvents"] == _metadata() + [
        {"name": "overlapped", "cat": "call", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1.248,
         "args": {"call": 0, "cycles": 624, "dma_busy": 560, "compute_busy": 128, "macs": 8192, "dram_bytes": 1408}},
        _command(dma, "DMA_COPY", "dma", 0.0, 0.192, 0, "dma", 96, 0, read=256),
        _command(dma, "DMA_COPY", "dma", 0.192, 0.192, 1, "dma", 96, 96, read=256),
        _command(dma, "DMA_COPY", "dma", 0.384, 0.176, 2, "dma", 88, 192, read=192),
        _command(compute, "CONV2D", "mac_array", 0.56, 0.128, 3, "conv1", 64, 280, macs=4096, deps=(2,)),
        _command(dma, "DMA_COPY", "dma", 0.56, 0.192, 4, "dma", 96, 280, read=256),  # beside conv1
        _command(dma, "DMA_COPY", "dma", 0.752, 0.176, 5, "dma", 88, 376, read=192),
        _command(compute, "CONV2D", "mac_array", 0.928, 0.128, 6, "conv2", 64, 464, macs=4096, deps=(5,)),
        _command(dma, "DMA_COPY", "dma", 1.056, 0.192, 7, "dma", 96, 528, write=256, deps=(6,)),
    ]


def test_calls_follow_one_another_and_a_stream_without_dependencies_waits_for_the_previous_command():
    events = chrome_trace([("overlapped", _overlapped()), ("serial", _serial())])["traceEvents"]
    second = [(e["tid"], e["ts"], e["dur"], e["args"]["deps"]) for e in events
              if e["ph"] == "X" and e["args"]["call"] == 1 and e["tid"] != 1]
    # The second call starts when the first ended (624 cycles = 1.248 us); it runs serially, to 688 cycles.
    assert second[:4] == [(2, 1.248, 0.192, []), (2, 1.44, 0.192, [0]), (2, 1.632, 0.176, [1]),
                          (3, 1.808, 0.128, [2])]
    calls = [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert calls == [("overlapped", 0.0, 1.248), ("serial", 1.248, 1.376)]


def test_one_process_per_configuration_with_thread_ids_unique_across_processes():
    tiny = get_config("npu-tiny")
    stats = RunStats("s", tiny, (CommandStats(**_dma(0, 0, 10), macs=0, dram_read_bytes=8, dram_write_bytes=0),))
    events = chrome_trace([("a", _overlapped()), ("b", stats), ("c", _overlapped())])["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e["name"] in ("process_name", "thread_name")}
    assert names == {(1, None): "NPU npu-256 (500 MHz)", (1, 1): "calls", (1, 2): "dma", (1, 3): "compute",
                     (2, None): "NPU npu-tiny (400 MHz)", (2, 4): "calls", (2, 5): "dma", (2, 6): "compute"}
    assert [(e["pid"], e["ts"]) for e in events if e["ph"] == "X" and e["tid"] in (1, 4)] == \
        [(1, 0.0), (2, 1.248), (1, 1.273)]  # 10 cycles at 400 MHz: 25 ns
    assert TRACKS == ("calls", "dma", "compute")


def test_boundaries_round_once_to_whole_nanoseconds_so_adjacent_commands_never_overlap():
    """At 400 MHz a cycle is 2.5 ns: a command's end and the next one's start are the same rounded value."""
    tiny = get_config("npu-tiny")
    cycles = [1, 1, 3, 1, 5]
    starts = np.concatenate([[0], np.cumsum(cycles)[:-1]]).tolist()
    stats = RunStats("s", tiny, tuple(CommandStats(**_dma(i, s, c), macs=0, dram_read_bytes=0, dram_write_bytes=0)
                                      for i, (s, c) in enumerate(zip(starts, cycles))))
    slices = [e for e in chrome_trace([("s", stats)])["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    ns = [(round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)) for e in slices]
    assert ns == [(0, 3), (3, 5), (5, 13), (13, 15), (15, 28)]  # 2.5 -> 3, 5, 12.5 -> 13, 15, 27.5 -> 28
    assert all(abs(e["ts"] * 1000 - round(e["ts"] * 1000)) < 1e-6 for e in slices)


# The per-layer table.

def test_the_layer_table_of_the_two_layer_stream():
    rows = {row.layer: row for row in Profile([("r", _overlapped())]).layer_table()}
    conv1 = rows["conv1"]
    assert (conv1.span, conv1.compute_busy, conv1.dma_busy, conv1.compute_fixed, conv1.macs) == (64, 64, 0, 32, 4096)
    assert conv1.utilisation == 4096 / (64 * 256) == 0.25
    assert (conv1.compute_floor, conv1.dma_floor, conv1.bound) == (16, 0, "compute")
    dma = rows["dma"]
    # Six DMAs of 64 cycles' latency each: 384 of the 560 busy cycles are fixed, so latency bounds the layer.
    assert (dma.span, dma.dma_busy, dma.dma_fixed, dma.dram_bytes, dma.dma_floor) == (624, 560, 384, 1408, 176)
    assert dma.bound == "overhead"


def _row(compute_busy=0, dma_busy=0, compute_fixed=0, dma_fixed=0, span=None, macs=0) -> LayerRow:
    span = max(compute_busy, dma_busy) if span is None else span
    return LayerRow("r", "l", CONFIG, 1, 2, span, compute_busy, dma_busy, compute_fixed, dma_fixed, macs, 0, 0)


@pytest.mark.parametrize("row, bound", [
    (_row(compute_busy=1000, compute_fixed=32, dma_busy=96, dma_fixed=64), "compute"),
    (_row(compute_busy=100, compute_fixed=32, dma_busy=1064, dma_fixed=64), "dma"),
    # The busiest engine is DMA, but four latencies (256 cycles) are most of its 280: overhead.
    (_row(compute_busy=40, compute_fixed=32, dma_busy=280, dma_fixed=256), "overhead"),
    (_row(compute_busy=40, compute_fixed=32), "overhead"),  # a tiny compute command: its issue overhead
    (_row(compute_busy=64, compute_fixed=32), "compute"),  # exactly half fixed: not more than half
    (_row(compute_busy=65, compute_fixed=33), "overhead"),
    (_row(compute_busy=500, compute_fixed=32, dma_busy=500, dma_fixed=448), "compute"),  # a tie goes to compute
])
def test_the_bound_is_the_busiest_engine_unless_fixed_costs_are_most_of_it(row, bound):
    assert row.bound == bound


def test_utilisation_and_floors_are_exact():
    row = _row(compute_busy=100, span=200, macs=256 * 150)
    assert row.utilisation == 0.75 and row.compute_floor == 150
    assert _row(macs=257, span=1).compute_floor == 2  # a partial pass of the array still takes a cycle
    assert dataclasses.replace(_row(), dram_bytes=17).dma_floor == 3  # 17 bytes at 8 per cycle
    assert _row(span=0).utilisation == 0.0


def test_every_engine_has_its_fixed_cost_per_command():
    stats = _overlapped().commands
    assert {c.engine for c in stats} == set(Engine)
    assert {(c.engine, c.fixed_cycles) for c in stats} == {(Engine.DMA, 64), (Engine.COMPUTE, 32)}


def test_calls_of_one_region_are_summed_or_kept_apart():
    prof = Profile([("r", _overlapped()), ("r", _overlapped())])
    merged = {row.layer: row for row in prof.layer_table()}
    assert (merged["conv1"].calls, merged["conv1"].span, merged["conv1"].macs) == (2, 128, 8192)
    assert merged["conv1"].utilisation == 0.25 and merged["conv1"].bound == "compute"
    assert [(row.layer, row.calls) for row in prof.layer_table(per_call=True)] == \
        [("dma", 1), ("conv1", 1), ("conv2", 1)] * 2


def test_overlap_cycles_are_the_intersection_of_the_engines_busy_time():
    assert overlap_cycles(_overlapped()) == 64  # conv1 [280, 344) inside the DMA [280, 376)
    assert overlap_cycles(_serial()) == 0


def test_the_summary_prints_the_table_and_the_engines_busy_line():
    lines = Profile([("overlapped", _overlapped()), ("serial", _serial())]).summary().splitlines()
    assert lines[0].split() == ["region", "layer", "cmds", "span", "compute", "dma", "MACs", "util", "DMA", "bytes",
                                "bound"]
    assert lines[2].split() == ["overlapped", "conv1", "1", "64", "64", "0", "4096", "25.0%", "0", "compute"]
    assert lines[4].split() == ["serial", "dma", "6", "688", "0", "560", "0", "0.0%", "1408", "overhead"]
    assert lines[-2] == "total: 2 NPU calls, 1312 cycles, 2.6 us at 500 MHz, 16384 MACs, 2816 DMA bytes"
    assert lines[-1] == "engines busy: dma 1120 (85%), compute 256 (20%), both at once 64 (5%) of the 1312 cycles"
    repeated = Profile([("r", _overlapped())] * 3).summary().splitlines()
    assert repeated[0].split()[2] == "calls" and repeated[2].split()[:3] == ["r", "conv1", "3"]


# The plot.

def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / "p.png"
    Profile([("overlapped", _overlapped()), ("serial", _serial())]).plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plotting_without_matplotlib_is_an_npu_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(NpuError, match=r"plotting needs matplotlib: pip install 'npu-backend\[plot\]'"):
        Profile([("r", _overlapped())]).plot(tmp_path / "p.png")
    with pytest.raises(NpuError, match="nothing to plot"):
        monkeypatch.delitem(sys.modules, "matplotlib")
        Profile().plot(tmp_path / "p.png")


# The command line.

def _two_layer_file(tmp_path):
    path = tmp_path / "two.npucmd"
    path.write_bytes(encode_stream(_stream(dependencies(two_layers(), CONFIG))))
    np.save(tmp_path / "x.npy", X)
    return [str(path), "--input", f"x={tmp_path / 'x.npy'}"]


def test_sim_writes_the_trace_and_the_plot_and_prints_where_commands_start(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    assert main(["sim", *_two_layer_file(tmp_path), "--repeat", "2", "--trace", str(trace), "--plot", str(plot)]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].split()[3:6] == ["engine", "start", "cycles"]
    assert lines[4].split()[:6] == ["3", "conv1", "CONV2D", "compute", "280", "64"]
    assert lines[5].split()[:6] == ["4", "dma", "DMA_COPY", "dma", "280", "96"]  # beside conv1
    assert "2 inferences (the table shows the first): 1248 cycles, 0 accumulator overflows" in lines
    assert f"plot written to {plot}" in lines and plot.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert [e["ts"] for e in events if e["ph"] == "X" and e["tid"] == 1] == [0.0, 1.248]
    assert out.err == ""  # no progress bar off a terminal


def test_a_progress_bar_follows_the_inferences_on_a_terminal(tmp_path, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["sim", *_two_layer_file(tmp_path), "--repeat", "3"]) == 0
    assert "running: 100%" in terminal.getvalue() and "3/3" in terminal.getvalue()


@pytest.mark.parametrize("extra, message", [(["--repeat", "0"], "--repeat takes a positive number"),
                                            (["--plot", "p.png"], "plotting needs matplotlib")])
def test_bad_view_options_fail_before_anything_runs(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["sim", *_two_layer_file(tmp_path), *extra]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"npu: error: {message}")


def test_run_writes_a_trace_of_every_inference(tmp_path, capsys, fixtures_dir):
    trace = tmp_path / "t.json"
    model = fixtures_dir / "tflite" / "conv2d_3x3_s2_same_relu.tflite"
    assert main(["run", str(model), "--repeat", "2", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "reference (TFLite BUILTIN_REF): MATCH" in out and out.rstrip().endswith("over 2 inferences")
    events = json.loads(trace.read_text())["traceEvents"]
    calls = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(calls) == 2 and calls[1]["ts"] == calls[0]["ts"] + calls[0]["dur"] > 0
    commands = [e for e in events if e["ph"] == "X" and e["tid"] != 1]
    assert {e["name"] for e in commands} >= {"CONV2D", "DMA_COPY"}
    for tid in (2, 3):  # an engine runs one command at a time: its slices never overlap
        spans = sorted((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)) for e in commands
                       if e["tid"] == tid)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
