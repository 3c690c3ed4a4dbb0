"""``npu_backend.sweep``: every model x hardware preset x quantization setting, compiled and timed.

Each combination is one task: quantize the float model with the setting (calibrated on the preset's own
accumulators), partition and build it for the preset, run one seeded input under the profiler. Its row holds
the simulator's totals (cycles, MACs, DRAM bytes, overflows), the MAC array's utilisation (MACs over cycles x
MAC units), the highest SRAM byte its command streams address, where the operators ran, and the wall time of
calibration and of compilation (the only figures that differ between two runs).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from simulator.config import NpuConfig
from simulator.isa import CommandStream, DmaCopy, FeatureMap, MemorySpace

from ..errors import ConfigError, NpuError
from .dataset import InputSpec, read_arrays
from .executor import plan_placement, run_tasks
from .grid import Grid, quantization_setting, resolve_preset
from .model_files import ModelFile
from .shards import ShardStore

COLUMNS = ("model", "preset", "quantization", "mac_units", "sram_bytes", "clock_mhz", "npu_ops", "ops", "cycles",
           "latency_us", "macs", "mac_utilisation", "dram_bytes", "peak_sram_bytes", "overflows",
           "calibrate_seconds", "compile_seconds", "pareto", "error")
TIMINGS = ("calibrate_seconds", "compile_seconds")
AXES = {"macs": ("mac_units", "MAC units (rows x columns)"), "sram": ("peak_sram_bytes", "peak SRAM (bytes)")}
"""Pareto x-axes: the cost each point's cycles are traded against."""


def peak_sram_bytes(stream: CommandStream) -> int:
    """One past the highest SRAM byte any command of ``stream`` reads or writes (every byte in SRAM arrives by a
    DMA or as a compute command's output feature map, so these two cover it)."""
    peak = 0
    for command in stream.commands:
        payload = command.payload
        if isinstance(payload, DmaCopy):
            for space, offset, stride in ((payload.src_space, payload.src_offset, payload.src_stride),
                                          (payload.dst_space, payload.dst_offset, payload.dst_stride)):
                if space == MemorySpace.SRAM:
                    peak = max(peak, offset + (payload.rows - 1) * stride + payload.row_bytes)
            continue
        for value in vars(payload).values():
            if isinstance(value, FeatureMap):  # bytes: int16 tiles take two per element
                peak = max(peak, value.address + getattr(value, "nbytes", value.size))
    return peak


def sample_inputs(specs: tuple[InputSpec, ...], seed: int, calibration) -> list[np.ndarray]:
    """The input a combination is timed on: a float model's first calibration sample, else seeded random values
    over the input's whole range (integers) or a standard normal (floats)."""
    rng = np.random.default_rng(seed)
    values = []
    for spec in specs:
        sample = _calibration_sample(calibration, spec) if calibration is not None else None
        if sample is not None:
            values.append(sample)
        elif np.issubdtype(np.dtype(spec.dtype), np.integer):
            info = np.iinfo(spec.dtype)
            values.append(rng.integers(info.min, info.max + 1, spec.shape).astype(spec.dtype))
        else:
            values.append(rng.standard_normal(spec.shape).astype(spec.dtype))
    return values


def _calibration_sample(calibration, spec: InputSpec):
    array = calibration.get(spec.name) if isinstance(calibration, dict) else calibration
    if array is None:
        return None
    return np.asarray(array[:1] if array.ndim == len(spec.shape) else array[0]).reshape(spec.shape).astype(spec.dtype)


@dataclass(frozen=True)
class SweepPoint:
    index: int
    model: int
    preset: NpuConfig
    quantization: str | None
    units: int = 1


@dataclass(frozen=True)
class SweepJob:
    models: tuple[ModelFile, ...]
    quantizations: dict
    calibration: object = field(repr=False)
    seed: int = 0

    def run(self, point: SweepPoint) -> dict:
        model = self.models[point.model]
        config = point.preset
        row = {"model": model.name, "preset": config.name, "quantization": point.quantization or "-",
               "mac_units": config.mac_rows * config.mac_cols, "sram_bytes": config.sram_bytes,
               "clock_mhz": config.clock_mhz, "error": None}
        try:
            row.update(self._measure(model, point))
        except NpuError as exc:
            row["error"] = str(exc)
        return row

    def _measure(self, model: ModelFile, point: SweepPoint) -> dict:
        import tvm
        from tvm import relax

        from simulator.stream import encode_stream

        from ..codegen import build_partitioned, lower_module
        from ..partition import partition_for_npu
        from ..profiling import profile
        from ..quantization import QConfig, calibrate
        from ..report import partition_report

        module, hardware, calibration = model.load(), point.preset, None
        start = time.perf_counter()
        if point.quantization is not None:
            calibration = self.calibration
            setting = {"accumulator_bits": hardware.accumulator_bits,  # the preset's, unless the setting says
                       "accumulator_overflow": hardware.accumulator_overflow, **self.quantizations[point.quantization]}
            calibrated = calibrate(module, calibration, QConfig(preset=hardware, **setting))
            module, hardware = calibrated.module, calibrated.npu_config
        calibrated_at = time.perf_counter()
        partitioned = partition_for_npu(module, hardware)
        streams = lower_module(partitioned)  # lowered once: embedded in the build, and read for the peak SRAM
        executable = build_partitioned(partitioned, streams={s: encode_stream(c) for s, c in streams.items()})
        built_at = time.perf_counter()
        vm = relax.VirtualMachine(executable, tvm.cpu())
        inputs = sample_inputs(InputSpec.of(module), self.seed, calibration)
        with profile() as prof:
            vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
        report = partition_report(partitioned)
        units = hardware.mac_rows * hardware.mac_cols
        cycles = prof.total_cycles
        return {"npu_ops": len(report.npu_ops), "ops": len(report.ops), "cycles": cycles,
                "latency_us": cycles / hardware.clock_mhz, "macs": prof.total_macs,
                "mac_utilisation": prof.total_macs / (cycles * units) if cycles else 0.0,
                "dram_bytes": prof.total_dram_bytes,
                "peak_sram_bytes": max((peak_sram_bytes(s) for s in streams.values()), default=0),
                "overflows": prof.total_overflows, "calibrate_seconds": round(calibrated_at - start, 3),
                "compile_seconds": round(built_at - calibrated_at, 3)}

    def fingerprint(self) -> dict:
        return {"models": [m.sha256 for m in self.models], "quantizations": self.quantizations,
                "calibration": _digest(self.calibration), "seed": self.seed}


def _digest(calibration) -> str | None:
    if calibration is None:
        return None
    import hashlib

    h = hashlib.sha256()
    for name, array in sorted(calibration.items()) if isinstance(calibration, dict) else [("", calibration)]:
        h.update(f"{name}{array.dtype}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def pareto_flags(rows: list[dict], x: str) -> list[bool]:
    """Per row: no other row of its model and quantization has at most its ``x`` and cycles, one strictly less."""
    flags = []
    for row in rows:
        if row["error"] is not None:
            flags.append(False)
            continue
        peers = [r for r in rows if r["error"] is None and (r["model"], r["quantization"]) == (row["model"],
                                                                                              row["quantization"])]
        flags.append(not any(p[x] <= row[x] and p["cycles"] <= row["cycles"] and (p[x], p["cycles"]) != (
            row[x], row["cycles"]) for p in peers))
    return flags


@dataclass(frozen=True)
class Sweep:
    """Rows in the order models x presets x quantization settings; ``pareto`` against ``axis``."""

    rows: tuple[dict, ...]
    axis: str = "macs"

    def figures(self) -> list[dict]:
        """The rows without wall-clock timings: what two runs of the same sweep agree on exactly."""
        return [{k: v for k, v in row.items() if k not in TIMINGS} for row in self.rows]

    def to_json(self) -> str:
        return json.dumps({"pareto_axis": AXES[self.axis][0], "rows": list(self.rows)}, indent=1)

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in COLUMNS})
        return out.getvalue()

    def to_table(self) -> str:
        lines = [f"{'model':<24} {'preset':<14} {'quant':<10} {'NPU ops':>8} {'cycles':>10} {'MAC util':>8} "
                 f"{'DRAM bytes':>11} {'peak SRAM':>10} {'overflows':>9} {'compile s':>9}  pareto"]
        for r in self.rows:
            head = f"{r['model'][:24]:<24} {r['preset'][:14]:<14} {r['quantization'][:10]:<10}"
            if r["error"] is not None:
                lines.append(f"{head} error: {r['error']}")
                continue
            lines.append(f"{head} {r['npu_ops']:>3}/{r['ops']:<4} {r['cycles']:>10} "
                         f"{100 * r['mac_utilisation']:>7.1f}% {r['dram_bytes']:>11} {r['peak_sram_bytes']:>10} "
                         f"{r['overflows']:>9} {r['compile_seconds']:>9.2f}  {'*' if r['pareto'] else ''}")
        return "\n".join(lines)

    def plot(self, path) -> None:
        """A PNG of cycles against the Pareto axis, one series per model and quantization, its front drawn."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise NpuError("the Pareto plot needs matplotlib: pip install 'npu-backend[plot]'") from None
        x, label = AXES[self.axis]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        groups: dict = {}
        for r in self.rows:
            if r["error"] is None:
                groups.setdefault((r["model"], r["quantization"]), []).append(r)
        for (model, quant), rows in groups.items():
            name = model if quant == "-" else f"{model} ({quant})"
            points = ax.scatter([r[x] for r in rows], [r["cycles"] for r in rows], label=name, alpha=0.8)
            front = sorted((r for r in rows if r["pareto"]), key=lambda r: r[x])
            ax.step([r[x] for r in front], [r["cycles"] for r in front], where="post",
                    color=points.get_facecolor()[0], linewidth=1)
            for r in rows:
                ax.annotate(r["preset"], (r[x], r["cycles"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("NPU cycles per inference")
        ax.set_title("npu sweep: cycles against hardware cost (lines: Pareto fronts)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _is_float_model(module) -> bool:
    from ..quantization.calibrate import check_float_module

    try:
        check_float_module(module["main"])
    except NpuError:
        return False
    return True


def plan_sweep(models, presets, grid: Grid | None = None, quantizations=None, calibration=None, seed=None):
    """(job, points): the combinations in order, every model, preset and setting checked first."""
    grid = grid or Grid()
    files = [ModelFile.read(m) for m in [*models, *grid.models]]
    configs = [resolve_preset(p, "presets") for p in presets] + list(grid.presets)
    settings = list(grid.quantizations) + [quantization_setting(n, dict(f), f"quantization {n!r}")
                                           for n, f in (quantizations or {}).items()]
    if not files:
        raise ConfigError("nothing to sweep: give models (--models, or 'models' in the grid)")
    if not configs:
        raise ConfigError("nothing to sweep: give presets (--presets, or 'presets' / [[preset]] in the grid)")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"two presets share a name ({', '.join(names)}): name each configuration differently")
    if calibration is None and grid.calibration is not None:
        arrays = read_arrays(grid.calibration.data)
        calibration = arrays[grid.calibration.key] if grid.calibration.key else (
            next(iter(arrays.values())) if len(arrays) == 1 else arrays)
        if grid.calibration.key and grid.calibration.key not in arrays:
            raise ConfigError(f"{grid.calibration.data} has no array {grid.calibration.key!r}")
        if grid.calibration.limit is not None:
            calibration = ({k: v[:grid.calibration.limit] for k, v in calibration.items()}
                           if isinstance(calibration, dict) else calibration[:grid.calibration.limit])
    points = []
    for m, file in enumerate(files):
        floating = _is_float_model(file.load())
        if floating and not settings:
            raise ConfigError(f"{file.name} is a float model: give [[quantization]] settings (and [calibration]) in "
                              "the grid to sweep it quantized")
        if floating and calibration is None:
            raise ConfigError(f"{file.name} is a float model: its quantization needs [calibration] data in the grid")
        for config in configs:
            for name in ([n for n, _ in settings] if floating else [None]):
                points.append(SweepPoint(len(points), m, config, name))
    job = SweepJob(tuple(files), dict(settings), calibration, grid.seed if seed is None else seed)
    return job, points


def sweep(models=(), presets=(), *, grid: Grid | str | None = None, quantizations: dict | None = None,
          calibration=None, seed: int | None = None, axis: str = "macs", workers: int | None = None,
          address: str | None = None, resume=None, progress=None, notify=None) -> Sweep:
    """Compile and time every model on every preset (x every quantization setting for float models).

    Parameters
    ----------
    models : paths
        ``.tflite``, ``.onnx`` or ``.npuq`` files; float models need ``quantizations`` and ``calibration``.
    presets : names, files or NpuConfig
    grid : Grid or path, optional
        More models, presets, settings and the calibration data (:mod:`npu_backend.distributed.grid`).
    quantizations : dict, optional
        ``{name: {QConfig field: value}}``.
    calibration : array or dict, optional
        Calibration samples for float models (else the grid's).
    axis : str
        ``macs`` or ``sram``: what cycles are traded against in the ``pareto`` column and the plot.
    workers, address, resume, progress, notify :
        As for :func:`npu_backend.evaluate`; each combination is one task.
    """
    from .evaluation import warn
    from .grid import load_grid

    if axis not in AXES:
        raise NpuError(f"unknown Pareto axis {axis!r}; known: {', '.join(AXES)}")
    if isinstance(grid, (str, os.PathLike)):
        grid = load_grid(grid)
    models = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    presets = [presets] if isinstance(presets, (str, os.PathLike, NpuConfig)) else list(presets)
    job, points = plan_sweep(models, presets, grid, quantizations, calibration, seed)
    placement = plan_placement(workers, address)
    if placement.note:
        (notify or warn)(placement.note)
    store = None
    if resume is not None:
        store = ShardStore(resume, {**job.fingerprint(), "points": [[p.model, p.preset.fingerprint, p.quantization]
                                                                    for p in points]})
    rows = run_tasks(job, points, placement, store, progress)
    for row, flag in zip(rows, pareto_flags(rows, AXES[axis][0])):
        row["pareto"] = flag
    return Sweep(tuple({k: row.get(k) for k in COLUMNS} for row in rows), axis)
