"""Our compute cycles against SCALE-Sim's, layer by layer, on its 16x16 weight-stationary systolic array.

MobileNetV2-0.35-96 (the bundled fixture) is compiled for the ``scalesim-16x16`` preset and run by the
simulator; every convolution, depthwise and fully connected layer is also written as a row of a SCALE-Sim
topology and simulated by SCALE-Sim 3.0.0 with a matching configuration (array 16 x 16, dataflow ``ws``). The
table gives both per-layer compute cycles and their ratio, which the cycle model must keep within 10%.

* SCALE-Sim's compute cycles: its COMPUTE_REPORT's ``Total Cycles`` less ``Stall Cycles`` (stalls come from
  its memory model, which the comparison leaves out; in its bandwidth-estimating mode there are none).
* Ours: the cycles of the layer's compute commands (``CommandStats.engine == Engine.COMPUTE``), not the
  stream's makespan, where DMA overlaps. ``cmds`` is how many commands the layer ran as: each stripe of a
  layer pays the array's fill once per fold, where SCALE-Sim streams the whole layer.
* Depthwise: SCALE-Sim 3.x has no depthwise dataflow of its own; its topology reader splits a layer whose name
  contains ``DP`` into one single-channel, single-filter convolution per channel, each simulated on its own.
  Those layers are identical, so by default the bench simulates one (``DP`` with one channel) and multiplies by
  the channel count; ``--all-channels`` has SCALE-Sim expand and simulate every channel (slow: about 2,600
  layers).
* Identical rows (MobileNetV2 repeats its blocks) are simulated once.

SCALE-Sim 3.0.0 crashes with numpy >= 2.4, so it runs in a virtual environment of its own, created on first
use under the benchmarks' cache directory (``$NPU_BENCH_CACHE`` or ``~/.cache/npu-bench``) with pip from PyPI.

    python bench/bench_scalesim.py [--preset scalesim-16x16] [--all-channels]
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mobilenet_v2_tflite import BUNDLED, cache_dir  # noqa: E402

import npu_backend  # noqa: E402
from npu_backend.codegen.lower import lower_region, npu_regions, region_graph  # noqa: E402
from npu_backend.params import NpuOp  # noqa: E402
from simulator import BufferKind, run_stream  # noqa: E402
from simulator.config import NpuConfig, resolve_config  # noqa: E402
from simulator.opcodes import Engine  # noqa: E402

SCALESIM_REQUIREMENTS = ("scalesim==3.0.0", "numpy<2.4")
"""What the SCALE-Sim environment installs: the version measured, and the numpy it still runs with."""

COMPARED = {NpuOp.CONV2D: "conv", NpuOp.DEPTHWISE_CONV2D: "depthwise", NpuOp.FULLY_CONNECTED: "fc"}

TOLERANCE = 0.10

RUN_SCALESIM = """
import sys
from scalesim.scale_sim import scalesim
config, topology, layout, out = sys.argv[1:]
scalesim(save_disk_space=True, verbose=False, config=config, topology=topology, layout=layout).run_scale(top_path=out)
"""


@dataclass(frozen=True)
class Layer:
    """One compared layer: its shape as SCALE-Sim's topology states it, and our compute cycles."""

    name: str
    kind: str
    ofm: tuple[int, int, int]
    kernel: tuple[int, int]
    stride: int
    in_channels: int
    cycles: int
    commands: int

    def topology_row(self, all_channels: bool) -> tuple:
        """(name, ifmap h, ifmap w, filter h, filter w, channels, filters, stride) for SCALE-Sim. The ifmap is
        the padded input the output needs, (o - 1) * s + k, as SCALE-Sim computes o = (i - k + s) / s."""
        (oh, ow, n), (kh, kw), s = self.ofm, self.kernel, self.stride
        ih, iw = (oh - 1) * s + kh, (ow - 1) * s + kw
        if self.kind == "depthwise":
            return ("DP", ih, iw, kh, kw, n if all_channels else 1, 1, s)
        return ("layer", ih, iw, kh, kw, self.in_channels, n, s)


def our_layers(model: Path, config: NpuConfig) -> list[Layer]:
    """The conv, depthwise and FC layers of the model as compiled for ``config``: their shapes from the
    compiler's records (a layer may run as several commands, stripes of rows or groups of channels), their
    cycles summed over their compute commands."""
    mod = npu_backend.partition_for_npu(npu_backend.load_tflite(model), config)
    layers: list[Layer] = []
    for symbol, func in npu_regions(mod).items():
        stream = lower_region(func, symbol)
        inputs = {b.name: np.zeros(b.shape, b.dtype) for _, b in stream.buffers_of(BufferKind.INPUT)}
        _, stats = run_stream(stream, inputs)
        cycles: dict[str, list[int]] = {}
        for stat in stats.commands:
            if stat.engine == Engine.COMPUTE:
                cycles.setdefault(stat.layer, []).append(stat.cycles)
        for layer in region_graph(func, symbol).layers:
            p = layer.params
            if p.op not in COMPARED:
                continue
            if p.strides[0] != p.strides[1]:
                raise SystemExit(f"{layer.name}: SCALE-Sim takes one stride for both axes")
            if p.op == NpuOp.FULLY_CONNECTED:  # M rows of one pixel each
                (rows, depth), (_, n) = p.ifm_shape, p.ofm_shape
                ofm = (rows, 1, n)
            else:
                depth, ofm = p.ifm_shape[3], tuple(p.ofm_shape[1:])
            layers.append(Layer(layer.name, COMPARED[p.op], ofm, tuple(p.kernel), p.strides[0], depth,
                                sum(cycles[layer.name]), len(cycles[layer.name])))
    return layers


def scalesim_python() -> Path:
    """The SCALE-Sim environment's interpreter, created and installed on first use."""
    venv = cache_dir() / "scalesim-venv"
    python = venv / "bin" / "python"
    ready = python.exists() and subprocess.run([str(python), "-c", "import scalesim.scale_sim"],
                                               capture_output=True).returncode == 0
    if not ready:
        print(f"creating the SCALE-Sim environment in {venv} ({', '.join(SCALESIM_REQUIREMENTS)})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *SCALESIM_REQUIREMENTS], check=True)
    return python


def scalesim_config(config: NpuConfig) -> str:
    """SCALE-Sim's .cfg for the preset's array: rows of SCALE-Sim's array (ArrayHeight) hold the reduction,
    our ``mac_cols``; its columns (ArrayWidth) the filters, our ``mac_rows``. The SRAM sizes only change its
    stall cycles, which are left out."""
    kib = config.sram_bytes // 3 // 1024
    return f"""[general]
run_name = npu_bench

[run_presets]
InterfaceBandwidth = CALC
UseRamulatorTrace = False

[architecture_presets]
ArrayHeight = {config.mac_cols}
ArrayWidth = {config.mac_rows}
IfmapSramSzkB = {kib}
FilterSramSzkB = {kib}
OfmapSramSzkB = {kib}
IfmapOffset = 0
FilterOffset = 10000000
OfmapOffset = 20000000
Dataflow = ws
ReadRequestBuffer = 32
WriteRequestBuffer = 32

[layout]
IfmapCustomLayout = False
FilterCustomLayout = False
IfmapSRAMBankBandwidth = 10
IfmapSRAMBankNum = 10
IfmapSRAMBankPort = 2
FilterSRAMBankBandwidth = 10
FilterSRAMBankNum = 10
FilterSRAMBankPort = 2

[sparsity]
SparsitySupport = false
SparseRep = ellpack_block
OptimizedMapping = false
BlockSize = 8
RandomNumberGeneratorSeed = 40
"""


def run_scalesim(python: Path, config: NpuConfig, rows: list[tuple]) -> list[int]:
    """SCALE-Sim's compute cycles of each topology row (a ``DP`` row: summed over the layers it expands to)."""
    with tempfile.TemporaryDirectory(prefix="scalesim-") as tmp:
        tmp = Path(tmp)
        (tmp / "scale.cfg").write_text(scalesim_config(config))
        lines = ["Layer name, IFMAP Height, IFMAP Width, Filter Height, Filter Width, Channels, Num Filter, Strides,"]
        expands = []
        for i, (kind, *numbers) in enumerate(rows):
            lines.append(", ".join([f"{kind}{i}", *map(str, numbers)]) + ",")
            expands.append(numbers[4] if kind == "DP" else 1)
        (tmp / "topology.csv").write_text("\n".join(lines) + "\n")
        (tmp / "layout.csv").write_text("Layer name,\n")  # read, unused without a custom layout
        subprocess.run([str(python), "-c", RUN_SCALESIM, str(tmp / "scale.cfg"), str(tmp / "topology.csv"),
                        str(tmp / "layout.csv"), str(tmp / "out")], check=True, cwd=tmp)
        with open(tmp / "out" / "npu_bench" / "COMPUTE_REPORT.csv") as report:
            compute = [int(r[" Total Cycles"]) - int(r[" Stall Cycles"]) for r in csv.DictReader(report)]
    if len(compute) != sum(expands):
        raise SystemExit(f"SCALE-Sim reported {len(compute)} layers for {sum(expands)} expected")
    cycles, at = [], 0
    for count in expands:
        cycles.append(sum(compute[at:at + count]))
        at += count
    return cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="scalesim-16x16")
    parser.add_argument("--model", type=Path, default=BUNDLED)
    parser.add_argument("--all-channels", action="store_true",
                        help="let SCALE-Sim expand every depthwise channel instead of simulating one")
    args = parser.parse_args()
    config = resolve_config(args.preset)

    layers = our_layers(args.model, config)
    rows = [layer.topology_row(args.all_channels) for layer in layers]
    distinct = list(dict.fromkeys(rows))
    python = scalesim_python()
    start = time.perf_counter()
    measured = dict(zip(distinct, run_scalesim(python, config, distinct)))
    seconds = time.perf_counter() - start

    print(f"{args.model.name} on {config.name} against SCALE-Sim 3.0.0 (ws, {config.mac_cols}x{config.mac_rows}); "
          f"{len(distinct)} distinct layers simulated in {seconds:.0f} s")
    print(f"{'layer':<22} {'kind':<9} {'ofm HxWxN':>12} {'k':>3} {'s':>2} {'K':>5} {'cmds':>4} {'SCALE-Sim':>10} "
          f"{'ours':>10} {'ours/SS':>8}")
    worst, totals = 0.0, {}
    for layer, row in zip(layers, rows):
        theirs = measured[row] * (layer.ofm[2] if layer.kind == "depthwise" and not args.all_channels else 1)
        ratio = layer.cycles / theirs
        worst = max(worst, abs(ratio - 1))
        mine, reference = totals.get(layer.kind, (0, 0))
        totals[layer.kind] = (mine + layer.cycles, reference + theirs)
        shape = "x".join(map(str, layer.ofm))
        print(f"{layer.name:<22} {layer.kind:<9} {shape:>12} {layer.kernel[0]:>3} {layer.stride:>2} "
              f"{layer.in_channels:>5} {layer.commands:>4} {theirs:>10} {layer.cycles:>10} {ratio:>8.4f}")
    for kind, (mine, reference) in totals.items():
        print(f"total {kind:<16} {'':<9} {'':>12} {'':>3} {'':>2} {'':>5} {'':>4} {reference:>10} {mine:>10} "
              f"{mine / reference:>8.4f}")
    verdict = "within" if worst <= TOLERANCE else "OUTSIDE"
    print(f"{len(layers)} layers, largest deviation {worst:.2%}: {verdict} +-{TOLERANCE:.0%}")
    if worst > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
