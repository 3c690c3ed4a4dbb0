"""Arm Vela's per-layer cycle estimates for Ethos-U55-256 and Ethos-U65-256, side by side with ours on npu-256.

Each model goes through ``ethos-u-vela`` (the ``bench`` extra) for both accelerators with
``--verbose-performance`` and Vela's default system configuration and memory mode for each (named in the
output), and through our compiler and simulator on ``npu-256``. Layers are matched in order by operator
(Vela splits MEAN in two rows, which are summed).

Columns (cycles at each accelerator's own clock):

* ``MACs``: the layer's, as Vela counts them (ours are equal, or more where cascaded stripes recompute
  their halo rows: marked ``*``; Vela counts MEAN's as the depthwise convolution it lowers it to).
* ``U55 npu`` / ``U65 npu``: Vela's ``NPU`` column, the MAC engine and output stage's time for the layer.
* ``ours``: our compute cycles for the layer, the sum of its compute commands
  (``CommandStats.engine == Engine.COMPUTE``), which is what Vela's ``NPU`` column estimates.
* ``U55 op`` / ``U65 op``: Vela's ``Op Cycles``, the layer's time once memory accesses are counted (the
  larger of the NPU time and each memory's access time).
* ``ours dma``: the cycles of the layer's DMA commands. Our stream's total is a makespan in which DMA and
  compute overlap (:mod:`simulator.timeline`); the totals line gives it next to Vela's ``cycles_total``.

docs/cycle_model.md explains the large differences.

    python bench/bench_vela.py [--model 0.35-96 --model 1.0-224] [--tf-python PY] [--preset npu-256]

The 1.0-224 model is built on first use by bench/mobilenet_v2_tflite.py under ``--tf-python`` (a Python with
TensorFlow) and cached; without it only the bundled 0.35-96 runs.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mobilenet_v2_tflite import cache_dir, cached_model  # noqa: E402

import npu_backend  # noqa: E402
from npu_backend.codegen.lower import lower_module  # noqa: E402
from simulator import BufferKind, run_stream  # noqa: E402
from simulator.config import resolve_config  # noqa: E402
from simulator.opcodes import Engine  # noqa: E402

ACCELERATORS = ("ethos-u55-256", "ethos-u65-256")

TFLITE_OPERATOR = {"conv2d": "Conv2D", "depthwise_conv2d": "DepthwiseConv2D", "fully_connected": "FullyConnected",
                   "add": "Add", "sub": "Sub", "mul": "Mul", "mean": "Mean", "avg_pool2d": "AveragePool2D",
                   "max_pool2d": "MaxPool2D", "softmax": "Softmax", "concat": "Concatenation"}
"""Our layer names' operator prefix -> the TFLite operator Vela reports as ``Original Operator``."""


@dataclass
class VelaLayer:
    operator: str
    op_cycles: int
    npu_cycles: int
    macs: int


@dataclass(frozen=True)
class OurLayer:
    name: str
    operator: str
    compute: int
    dma: int
    macs: int


def vela_layers(model: Path, accelerator: str, out: Path) -> tuple[list[VelaLayer], dict[str, str]]:
    """Vela's per-layer rows (an operator Vela lowers to several NPU operations summed into one row) and its
    network summary."""
    subprocess.run([sys.executable, "-m", "ethosu.vela", str(model), "--accelerator-config", accelerator,
                    "--verbose-performance", "--output-dir", str(out)], check=True, capture_output=True)
    layers: list[VelaLayer] = []
    with open(out / f"{model.stem}_per-layer.csv") as per_layer:
        for row in csv.DictReader(per_layer):
            if row["Target"] != "NPU":
                continue
            cycles, npu, macs = int(row["Op Cycles"]), int(row["NPU"]), int(row["MAC Count"])
            original, lowered = row["Original Operator"], row["NNG Operator"]
            if layers and layers[-1].operator == original and lowered != original:  # part of the same operator
                layers[-1].op_cycles += cycles
                layers[-1].npu_cycles += npu
                layers[-1].macs += macs
            else:
                layers.append(VelaLayer(original, cycles, npu, macs))
    (summary_file,) = out.glob(f"{model.stem}_summary_*.csv")
    with open(summary_file) as summary:
        (row,) = csv.DictReader(summary)
    return layers, row


def our_layers(model: Path, preset: str) -> tuple[list[OurLayer], int]:
    """Per-layer compute and DMA cycles on ``preset``, and the makespan of the model's NPU regions."""
    mod = npu_backend.partition_for_npu(npu_backend.load_tflite(model), preset)
    layers, makespan = [], 0
    for stream in lower_module(mod).values():
        inputs = {b.name: np.zeros(b.shape, b.dtype) for _, b in stream.buffers_of(BufferKind.INPUT)}
        _, stats = run_stream(stream, inputs)
        makespan += stats.total_cycles
        rows: dict[str, dict[str, int]] = {}
        for c in stats.commands:
            row = rows.setdefault(c.layer, {"compute": 0, "dma": 0, "macs": 0})
            row["compute" if c.engine == Engine.COMPUTE else "dma"] += c.cycles
            row["macs"] += c.macs
        for name, row in rows.items():
            operator = TFLITE_OPERATOR.get(name.rsplit("_", 1)[0], name)
            layers.append(OurLayer(name, operator, row["compute"], row["dma"], row["macs"]))
    return layers, makespan


def compare(label: str, model: Path, preset: str) -> None:
    ours, makespan = our_layers(model, preset)
    vela, summaries = {}, {}
    with tempfile.TemporaryDirectory(prefix="vela-") as tmp:
        for accelerator in ACCELERATORS:
            vela[accelerator], summaries[accelerator] = vela_layers(model, accelerator, Path(tmp) / accelerator)
    u55, u65 = (vela[a] for a in ACCELERATORS)
    if [v.operator for v in u55] != [v.operator for v in u65] or \
            [v.operator for v in u55] != [o.operator for o in ours]:
        raise SystemExit(f"{label}: layers do not line up: Vela {[v.operator for v in u55]}, "
                         f"ours {[o.operator for o in ours]}")
    for mine, theirs in zip(ours, u65):
        if 0 < mine.macs < theirs.macs:  # more is recomputation (cascaded stripes redo their halo rows)
            raise SystemExit(f"{label}: {mine.name} has {mine.macs} MACs, fewer than Vela's layer ({theirs.macs})")

    print(f"\n{label} ({model.name}): ours on {preset}; Vela 5.2 on "
          + ", ".join(f"{a} ({summaries[a]['system_config']}, {summaries[a]['memory_mode']})" for a in ACCELERATORS))
    print(f"{'layer':<22} {'MACs':>10} {'U55 npu':>9} {'U65 npu':>9} {'ours':>9} {'ours/U65':>8} "
          f"{'U55 op':>9} {'U65 op':>9} {'ours dma':>9}")
    kinds: dict[str, list[int]] = {}
    for mine, a, b in zip(ours, u55, u65):
        ratio = f"{mine.compute / b.npu_cycles:8.2f}" if b.npu_cycles else f"{'-':>8}"
        macs = f"{b.macs}{'*' if mine.macs > b.macs > 0 else ' '}"
        print(f"{mine.name:<22} {macs:>10} {a.npu_cycles:>9} {b.npu_cycles:>9} {mine.compute:>9} {ratio} "
              f"{a.op_cycles:>9} {b.op_cycles:>9} {mine.dma:>9}")
        total = kinds.setdefault(mine.operator, [0] * 7)
        for i, value in enumerate((b.macs, a.npu_cycles, b.npu_cycles, mine.compute, a.op_cycles, b.op_cycles,
                                   mine.dma)):
            total[i] += value
    print("per operator:")
    for operator, (macs, a_npu, b_npu, compute, a_op, b_op, dma) in kinds.items():
        print(f"  {operator:<20} {macs:>10} {a_npu:>9} {b_npu:>9} {compute:>9} {compute / b_npu:8.2f} "
              f"{a_op:>9} {b_op:>9} {dma:>9}")
    redone = sum(o.macs - v.macs for o, v in zip(ours, u65) if o.macs > v.macs > 0)
    if redone:
        print(f"* our stripes of the layer recompute rows (cascading): {redone} MACs more in all")
    busy = sum(o.compute for o in ours)
    print(f"network: Vela cycles_npu U55 {summaries[ACCELERATORS[0]]['cycles_npu']}, "
          f"U65 {summaries[ACCELERATORS[1]]['cycles_npu']}; ours compute busy {busy}. "
          f"Vela cycles_total U55 {summaries[ACCELERATORS[0]]['cycles_total']}, "
          f"U65 {summaries[ACCELERATORS[1]]['cycles_total']}; ours makespan {makespan}")


MODELS = {"0.35-96": (0.35, 96), "1.0-224": (1.0, 224)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS),
                        help="MobileNetV2 width-resolution (default: both, 1.0-224 if it can be had)")
    parser.add_argument("--tf-python", default=None, help="a Python with TensorFlow, to build 1.0-224 once")
    parser.add_argument("--preset", default="npu-256")
    args = parser.parse_args()
    resolve_config(args.preset)
    for label in args.model or sorted(MODELS):
        alpha, resolution = MODELS[label]
        try:
            model = cached_model(alpha, resolution, args.tf_python)
        except SystemExit as missing:
            if args.model:
                raise
            print(f"\n{label}: skipped: {missing} (cache: {cache_dir()})")
            continue
        compare(label, model, args.preset)


if __name__ == "__main__":
    main()
