"""``npu_backend.evaluate``: a compiled model over a data set, on one process or many.

Every sample runs through the partitioned model (NPU regions on the simulator) and, when a reference is
chosen, through the reference runtime; what is kept per sample is small and exact (top-1 class of the first
output, cycles, accumulator overflows, the squared signal and error against the reference, bit-exact
elements, a digest of the outputs), so shards travel and rest on disk cheaply and the summary is computed
from them in sample order: the same numbers, bit for bit, however the samples were spread.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simulator.config import DEFAULT_PRESET, NpuConfig, resolve_config

from ..errors import NpuError
from .dataset import InputSpec, Shard, load_dataset
from .executor import plan_placement, run_tasks
from .model_files import ModelFile
from .references import reference_runner, resolve_reference
from .shards import ShardStore

FIELDS = ("top1", "ref_top1", "cycles", "overflows", "signal", "noise", "exact", "elements", "digest")
"""Per-sample record: top-1 of the first output (flattened argmax) on the NPU and on the reference (-1 without
one), NPU cycles and overflowed accumulators of the inference, squared reference and squared error summed
over every output element (dequantized when the outputs are integers with known qparams), outputs equal to
the reference's, output elements, and the first 16 hex digits of SHA-256 over the NPU's output bytes."""

SHARD_SIZE = 16
"""Samples per task by default: small enough to resume finely, large enough that Ray's per-task cost vanishes."""

_COMPILED: dict[tuple, "_Compiled"] = {}


@dataclass
class _Compiled:
    vm: object
    scales: list
    npu_ops: int
    ops: int


def _compile(model: ModelFile, preset: NpuConfig, numerics: str) -> _Compiled:
    """The model built for ``preset``, once per process (the Ray worker's first task pays for it)."""
    key = (model.sha256, preset.fingerprint, numerics)
    compiled = _COMPILED.get(key)
    if compiled is None:
        import tvm
        from tvm import relax

        from ..codegen import build_partitioned
        from ..compiled import TensorTable
        from ..partition import partition_for_npu
        from ..report import partition_report

        module = model.load()
        partitioned = partition_for_npu(module, preset, numerics)
        report = partition_report(partitioned)
        executable = build_partitioned(partitioned)
        main = module["main"]
        body = main.body.body
        table = TensorTable(main)
        scales = [(d["scale"], d["zero_point"]) for d in
                  (table.describe(o) for o in (body.fields if hasattr(body, "fields") else [body]))]
        compiled = _COMPILED[key] = _Compiled(relax.VirtualMachine(executable, tvm.cpu()), scales,
                                              len(report.npu_ops), len(report.ops))
    return compiled


def _dequantized(value: np.ndarray, qparams) -> np.ndarray:
    scale, zero_point = qparams
    if value.dtype.kind in "iu" and isinstance(scale, float):
        return (value.astype(np.float64) - zero_point) * scale
    return value.astype(np.float64)


@dataclass(frozen=True)
class EvalJob:
    """Everything a worker needs to evaluate shards (picklable; the model travels as bytes)."""

    model: ModelFile
    preset: NpuConfig
    numerics: str
    reference: str | None

    def run(self, shard: Shard) -> dict:
        import tvm

        from ..profiling import profile

        compiled = _compile(self.model, self.preset, self.numerics)
        runner = reference_runner(self.reference, self.model) if self.reference else None
        records = {name: [] for name in FIELDS}
        for i in range(shard.units):
            values = [np.ascontiguousarray(a[i]) for a in shard.inputs]
            with profile() as prof:
                result = compiled.vm["main"](*[tvm.runtime.tensor(v) for v in values])
            outputs = [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]
            digest = hashlib.sha256()
            for out in outputs:
                digest.update(out.tobytes())
            records["top1"].append(int(np.argmax(outputs[0].reshape(-1))))
            records["cycles"].append(prof.total_cycles)
            records["overflows"].append(prof.total_overflows)
            records["elements"].append(sum(o.size for o in outputs))
            records["digest"].append(digest.hexdigest()[:16])
            references = runner.run(values) if runner else None
            self._compare(records, outputs, references, compiled.scales)
        return {"records": records, "npu_ops": compiled.npu_ops, "ops": compiled.ops,
                "reference_label": runner.label if runner else None}

    @staticmethod
    def _compare(records: dict, outputs: list, references: list | None, scales: list) -> None:
        if references is None:
            for name, value in (("ref_top1", -1), ("signal", 0.0), ("noise", 0.0), ("exact", 0)):
                records[name].append(value)
            return
        if len(references) != len(outputs) or any(r.size != o.size for r, o in zip(references, outputs)):
            raise NpuError(f"the reference's outputs {[list(r.shape) for r in references]} do not match the "
                           f"model's {[list(o.shape) for o in outputs]}")
        signal = noise = 0.0
        exact = 0
        for out, ref, qparams in zip(outputs, references, scales):
            ref = np.asarray(ref).reshape(out.shape)
            r, o = _dequantized(ref, qparams), _dequantized(out, qparams)
            signal += float(np.sum(r * r))
            noise += float(np.sum((r - o) ** 2))
            exact += int(np.count_nonzero(ref == out))
        records["ref_top1"].append(int(np.argmax(np.asarray(references[0]).reshape(-1))))
        records["signal"].append(signal)
        records["noise"].append(noise)
        records["exact"].append(exact)

    def fingerprint(self) -> dict:
        return {"model": self.model.sha256, "hardware": self.preset.fingerprint, "numerics": self.numerics,
                "reference": self.reference}


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


@dataclass(frozen=True)
class Evaluation:
    """The figures of one evaluation; equal for equal work, however it was distributed.

    ``records`` holds the per-sample columns of :data:`FIELDS` in data-set order.
    """

    model: str
    hardware: NpuConfig
    reference: str | None
    reference_label: str | None
    labels: tuple | None
    records: dict = field(repr=False)
    npu_ops: int = 0
    ops: int = 0

    @property
    def samples(self) -> int:
        return len(self.records["top1"])

    def _accuracy(self, column: str) -> float | None:
        if self.labels is None or (column == "ref_top1" and self.reference is None):
            return None
        return float(np.mean(np.asarray(self.records[column]) == np.asarray(self.labels)))

    @property
    def top1(self) -> float | None:
        """Share of samples whose NPU top-1 is the label (None without labels)."""
        return self._accuracy("top1")

    @property
    def reference_top1(self) -> float | None:
        return self._accuracy("ref_top1")

    @property
    def agreement(self) -> float | None:
        """Share of samples whose NPU top-1 is the reference's."""
        if self.reference is None:
            return None
        return float(np.mean(np.asarray(self.records["top1"]) == np.asarray(self.records["ref_top1"])))

    @property
    def sqnr_db(self) -> float | None:
        """Signal (the reference's outputs) over error energy, summed over every sample, in dB."""
        if self.reference is None:
            return None
        signal, noise = math.fsum(self.records["signal"]), math.fsum(self.records["noise"])
        if noise == 0.0:
            return math.inf
        return -math.inf if signal == 0.0 else 10.0 * math.log10(signal / noise)

    @property
    def exact_elements(self) -> int:
        return sum(self.records["exact"])

    @property
    def elements(self) -> int:
        return sum(self.records["elements"])

    @property
    def cycles(self) -> tuple[int, float, int]:
        """(min, median, max) NPU cycles per inference."""
        c = np.asarray(self.records["cycles"])
        return int(c.min()), float(np.median(c)), int(c.max())

    def to_dict(self) -> dict:
        low, median, high = self.cycles
        sqnr = self.sqnr_db
        return {
            "model": self.model, "hardware": self.hardware.name, "hardware_fingerprint": self.hardware.fingerprint,
            "samples": self.samples, "reference": self.reference, "reference_label": self.reference_label,
            "top1": self.top1, "reference_top1": self.reference_top1, "agreement": self.agreement,
            "sqnr_db": None if sqnr is None else (sqnr if math.isfinite(sqnr) else ("inf" if sqnr > 0 else "-inf")),
            "exact_elements": self.exact_elements if self.reference else None, "elements": self.elements,
            "cycles": {"min": low, "median": median, "max": high,
                       "median_us": median / self.hardware.clock_mhz},
            "overflows": sum(self.records["overflows"]), "npu_ops": self.npu_ops, "ops": self.ops,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_table(self) -> str:
        d = self.to_dict()
        rows = [("model", f"{self.model} on {self.hardware.name}, {self.npu_ops} of {self.ops} operators on the NPU"),
                ("samples", str(self.samples))]
        if self.labels is not None:
            theirs = f" (reference: {_percent(self.reference_top1)})" if self.reference else ""
            rows.append(("top-1", f"{_percent(self.top1)}{theirs}"))
        if self.reference is not None:
            rows.append(("reference", self.reference_label))
            rows.append(("agreement", f"{_percent(self.agreement)} of top-1 classes"))
            sqnr = self.sqnr_db
            rows.append(("SQNR", "exact" if sqnr == math.inf else f"{sqnr:.2f} dB"))
            rows.append(("bit-exact", f"{self.exact_elements} of {self.elements} output elements"))
        low, median, high = self.cycles
        rows.append(("cycles", f"min {low} / median {median:g} / max {high} per inference "
                               f"({d['cycles']['median_us']:.1f} us at {self.hardware.clock_mhz} MHz)"))
        if d["overflows"]:
            rows.append(("overflows", f"{d['overflows']} accumulator overflows"))
        return "\n".join(f"{name:<10} {value}" for name, value in rows)


def default_preset(model: str | Path):
    """The hardware a model is built for unless told: a ``.npuq`` file's own, else the default preset."""
    if Path(model).suffix.lower() == ".npuq":
        from ..quantization.stored import stored_config

        return stored_config(model)
    return DEFAULT_PRESET


def evaluate(model: str | Path, data, *, key: str | None = None, labels: str | None = None,
             reference: str = "auto", preset: NpuConfig | str | None = None, numerics: str = "auto",
             workers: int | None = None, address: str | None = None, shard_size: int = SHARD_SIZE,
             limit: int | None = None, resume: str | Path | None = None, progress=None, notify=None) -> Evaluation:
    """Run a model over a data set on the simulated NPU and score it.

    Parameters
    ----------
    model : path
        A ``.tflite``, ``.onnx`` or ``.npuq`` file.
    data : path, dict or array
        The inputs batched on axis 0 (an ``.npz``: see :func:`~npu_backend.distributed.dataset.load_dataset`).
    key, labels : str, optional
        Which array is the (single) input; which holds the integer labels (for top-1).
    reference : str
        ``auto`` (the model file's runtime; ``float`` for ``.npuq``), ``tflite``, ``onnxruntime``, ``float``
        or ``none``.
    preset : NpuConfig or str, optional
        The hardware (a preset name or configuration file); default: a ``.npuq`` file's own, else ``npu-256``.
    numerics : str
        Whose rounding the NPU reproduces (``partition_for_npu``'s ``reference``).
    workers, address :
        None: a local Ray with one worker per CPU (or the cluster at ``address``); 0: this process, no Ray;
        N: N Ray workers. Without Ray installed, this process (with an ``NpuWarning``).
    shard_size, limit :
        Samples per task; evaluate only the first ``limit`` samples.
    resume : path, optional
        Directory keeping finished shards; rerunning with it continues where a killed run stopped.
    progress : callable, optional
        ``progress(samples_done, samples_total)``.
    notify : callable, optional
        Receives one-line notes (Ray missing, reference skipped); default: an ``NpuWarning`` each.
    """
    job, shards, dataset, placement, note = plan_evaluation(model, data, key=key, labels=labels,
                                                            reference=reference, preset=preset, numerics=numerics,
                                                            workers=workers, address=address,
                                                            shard_size=shard_size, limit=limit)
    for message in note:
        (notify or warn)(message)
    store = ShardStore(resume, {**job.fingerprint(), "data": dataset.digest(), "shard_size": shard_size,
                                "samples": dataset.size}) if resume is not None else None
    results = run_tasks(job, shards, placement, store, progress)
    return summarize(job, results, dataset.labels)


def plan_evaluation(model, data, *, key=None, labels=None, reference="auto", preset=None, numerics="auto",
                    workers=None, address=None, shard_size=SHARD_SIZE, limit=None):
    """(job, shards, data set, placement, notes): everything checked before any work starts."""
    from ..reference import Reference

    if numerics not in ("auto", *(r.value for r in Reference)):
        raise NpuError(f"unknown numerics {numerics!r}; known: auto, {', '.join(r.value for r in Reference)}")
    file = ModelFile.read(model)
    config = resolve_config(preset if preset is not None else default_preset(model))
    chosen, reference_note = resolve_reference(reference, file)
    dataset = load_dataset(data, InputSpec.of(file.load()), key, labels, limit)
    placement = plan_placement(workers, address)
    shards = dataset.shards(shard_size)
    notes = [n for n in (reference_note, placement.note) if n]
    return EvalJob(file, config, numerics, chosen), shards, dataset, placement, notes


def summarize(job: EvalJob, results: list[dict], labels) -> Evaluation:
    """The evaluation from its shards' results, in shard order."""
    records = {name: tuple(v for r in results for v in r["records"][name]) for name in FIELDS}
    return Evaluation(job.model.name, job.preset, job.reference, results[0]["reference_label"],
                      None if labels is None else tuple(int(x) for x in labels), records,
                      results[0]["npu_ops"], results[0]["ops"])


def warn(message: str) -> None:
    """The default ``notify``: an :class:`~npu_backend.errors.NpuWarning`."""
    import warnings

    from ..errors import NpuWarning

    warnings.warn(NpuWarning(message), stacklevel=3)
