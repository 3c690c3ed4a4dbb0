"""``npu eval`` and ``npu sweep``: the command-line side of :func:`evaluate` and :func:`sweep`.

Notes (Ray missing, a reference runtime skipped) go to stderr as ``npu: note: ...`` before the work starts;
bad input raises ``NpuError``, which ``npu`` turns into one error line and exit status 2.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from ..progress import ProgressBar

WORKERS_HELP = ("Ray workers (default: one per CPU, on a local Ray started for the run; 0: in this process, "
                "without Ray)")


def _note(message: str) -> None:
    print(f"npu: note: {message}", file=sys.stderr)


def _placement(args) -> str:
    from .executor import plan_placement

    return plan_placement(args.workers, args.address).describe()


def cmd_eval(args) -> int:
    from .evaluation import evaluate

    progress = ProgressBar("evaluating", "sample")
    start = time.perf_counter()
    try:
        result = evaluate(args.model, args.data, key=args.key, labels=args.labels, reference=args.reference,
                          preset=args.preset, numerics=args.numerics, workers=args.workers, address=args.address,
                          shard_size=args.shard_size, limit=args.limit, resume=args.resume, progress=progress,
                          notify=_note)
    finally:
        progress.close()
    if args.json:
        print(result.to_json())
        return 0
    print(result.to_table())
    print(f"{'run':<10} {time.perf_counter() - start:.1f} s {_placement(args)}"
          + (f", finished shards kept in {args.resume}" if args.resume else ""))
    return 0


def cmd_sweep(args) -> int:
    from .sweep import sweep

    progress = ProgressBar("sweeping", "combination")
    try:
        result = sweep(args.models or (), args.presets or (), grid=args.grid, seed=args.seed, axis=args.pareto,
                       workers=args.workers, address=args.address, resume=args.resume, progress=progress,
                       notify=_note)
    finally:
        progress.close()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.csv").write_text(result.to_csv())
    (out / "sweep.json").write_text(result.to_json() + "\n")
    written = [out / "sweep.csv", out / "sweep.json"]
    if importlib.util.find_spec("matplotlib") is not None:
        result.plot(out / "pareto.png")
        written.append(out / "pareto.png")
    else:
        _note("no Pareto plot: it needs matplotlib (pip install 'npu-backend[plot]')")
    print(result.to_json() if args.json else result.to_table())
    print(f"written: {', '.join(map(str, written))} (pareto: cycles against "
          f"{'MAC units' if args.pareto == 'macs' else 'peak SRAM'})", file=sys.stderr if args.json else sys.stdout)
    return 0


def _placement_options(parser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, help=WORKERS_HELP)
    where.add_argument("--address", help="a running Ray cluster to use (e.g. ray://head:10001 or auto)")
    parser.add_argument("--resume", metavar="DIR", help="keep finished tasks in DIR; rerunning with it continues "
                                                       "where a killed run stopped")


def add_commands(sub, preset_help: str) -> None:
    """Add ``eval`` and ``sweep`` to the ``npu`` command's subparsers."""
    ev = sub.add_parser("eval", help="run a model over a data set on the NPU: top-1, agreement and SQNR against a "
                                     "reference, cycles per inference (parallel on Ray)")
    ev.add_argument("model")
    ev.add_argument("--data", required=True, help=".npz of inputs batched on axis 0 (one array per input, by name)")
    ev.add_argument("--key", help="which array of --data is the input (single-input models)")
    ev.add_argument("--labels", metavar="KEY", help="array of --data holding integer class labels (for top-1)")
    ev.add_argument("--reference", default="auto", choices=["auto", "tflite", "onnxruntime", "float", "none"],
                    help="what the NPU's outputs are compared with (default: the model file's runtime; float for "
                         ".npuq)")
    ev.add_argument("--numerics", default="auto", choices=["auto", "tflite", "onnxruntime"],
                    help="whose rounding the NPU reproduces (default: the model file's own runtime)")
    ev.add_argument("--preset", help=preset_help + " (default: npu-256, or a .npuq file's own)")
    ev.add_argument("--shard-size", type=int, default=16, help="samples per task (default: 16)")
    ev.add_argument("--limit", type=int, help="evaluate only the first N samples")
    ev.add_argument("--json", action="store_true", help="print the figures as JSON")
    _placement_options(ev)
    ev.set_defaults(func=cmd_eval)
    sw = sub.add_parser("sweep", help="design-space exploration: models x presets x quantization settings; CSV, "
                                      "JSON and a Pareto plot")
    sw.add_argument("--models", nargs="+", help="model files (.tflite, .onnx, .npuq)")
    sw.add_argument("--presets", nargs="+", help="preset names or .toml/.json configuration files")
    sw.add_argument("--grid", help="TOML grid: more models and presets, [[preset]] tables, [[quantization]] "
                                   "settings and [calibration] data for float models")
    sw.add_argument("-o", "--output", default="sweep", help="directory for sweep.csv, sweep.json and pareto.png "
                                                            "(default: ./sweep)")
    sw.add_argument("--pareto", default="macs", choices=["macs", "sram"],
                    help="cost axis of the Pareto front: MAC units or peak SRAM (default: macs)")
    sw.add_argument("--seed", type=int, help="seed of the input each combination is timed on (default: the grid's, "
                                             "else 0)")
    sw.add_argument("--json", action="store_true", help="print the rows as JSON")
    _placement_options(sw)
    sw.set_defaults(func=cmd_sweep)
