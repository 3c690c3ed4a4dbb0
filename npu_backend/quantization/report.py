"""What quantization chose and what it cost: per tensor and per layer, as a table, JSON or a plot.

The report travels with the quantized module (attribute ``npu.quantization_report``), so
``npu_backend.quantization_report(qmod)`` answers for any module ``quantize`` returned.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import tvm

from ..errors import NpuError

REPORT_ATTR = "npu.quantization_report"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    method: str
    min: float
    max: float
    scale: float
    zero_point: int
    histogram: dict
    """Histogram summary of the observed values: count, mean, std and percentiles. For a range read from the
    extremes alone (minmax, a global scale), of the tensor's int8 values on the first
    :attr:`QuantizationReport.compared_samples` samples (the range itself is every sample's): counting every
    byte of every tensor had been a tenth of calibration's CPU time."""


@dataclass(frozen=True)
class LayerEntry:
    name: str
    kind: str
    placement: str
    """``npu``, ``host int8`` (quantized, but no NPU pattern takes it) or ``float``."""
    output_scale: float
    output_zero_point: int
    sqnr_db: float
    """SQNR of the layer's output in the quantized model against the float model, over the samples the float model
    ran on (:attr:`QuantizationReport.compared_samples`; NaN: not measured, ``QConfig.float_reference`` off)."""
    accumulator_peak: int
    overflows: int
    widened_channels: int
    note: str


@dataclass(frozen=True)
class QuantizationReport:
    config: dict
    tensors: tuple[TensorEntry, ...]
    layers: tuple[LayerEntry, ...]
    output_sqnr_db: float
    """SQNR of the model's outputs against the float model's, over the samples it ran on (NaN: not measured)."""
    accumulator_bits: int
    overflow_mode: str
    samples: int = 0
    """Calibration samples (every range is observed on all of them; 0: a report that did not say)."""
    compared_samples: int = 0
    """Of those, the first ones the report's measurements were taken on (``QConfig.reference_samples``): the float
    model's pass, when it ran (every SQNR, bias correction's means), and the int8 summaries of ranges read from
    extremes."""

    @property
    def total_overflows(self) -> int:
        return sum(layer.overflows for layer in self.layers)

    def to_json(self) -> str:
        def clean(x):
            if isinstance(x, float) and not math.isfinite(x):
                return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [clean(v) for v in x]
            return x

        return json.dumps(clean({
            "config": self.config, "output_sqnr_db": self.output_sqnr_db, "accumulator_bits": self.accumulator_bits,
            "overflow_mode": self.overflow_mode, "samples": self.samples,
            "compared_samples": self.compared_samples, "tensors": [asdict(t) for t in self.tensors],
            "layers": [asdict(layer) for layer in self.layers]}))

    @staticmethod
    def from_json(text: str) -> QuantizationReport:
        def num(x):
            return float(x) if isinstance(x, str) else (math.nan if x is None else x)

        raw = json.loads(text)
        tensors = tuple(TensorEntry(**t) for t in raw["tensors"])
        layers = tuple(LayerEntry(**{**layer, "sqnr_db": num(layer["sqnr_db"])}) for layer in raw["layers"])
        return QuantizationReport(raw["config"], tensors, layers, num(raw["output_sqnr_db"]), raw["accumulator_bits"],
                                  raw["overflow_mode"], raw.get("samples", 0), raw.get("compared_samples", 0))

    def to_table(self) -> str:
        lines = [f"{'layer':<18} {'kind':<14} {'placement':<9} {'scale':>10} {'zp':>5} {'SQNR dB':>8} "
                 f"{'acc peak':>10} {'overflows':>9}  note"]
        for layer in self.layers:
            sqnr = ("-" if math.isnan(layer.sqnr_db) else
                    "exact" if math.isinf(layer.sqnr_db) and layer.sqnr_db > 0 else f"{layer.sqnr_db:.1f}")
            scale = f"{layer.output_scale:.3g}" if layer.output_scale else "-"
            lines.append(f"{layer.name:<18} {layer.kind:<14} {layer.placement:<9} {scale:>10} "
                         f"{layer.output_zero_point:>5} {sqnr:>8} {layer.accumulator_peak or '-':>10} "
                         f"{layer.overflows:>9}  {layer.note}")
        output = ("output SQNR not measured (float_reference off)" if math.isnan(self.output_sqnr_db) else
                  f"output SQNR {self.output_sqnr_db:.2f} dB")
        if self.samples and not math.isnan(self.output_sqnr_db):
            output += f" (float model on {self.compared_samples} of {self.samples} samples)"
        lines.append(f"{output}; accumulators {self.accumulator_bits} bits "
                     f"({self.overflow_mode}), {self.total_overflows} overflow(s) on the calibration set")
        return "\n".join(lines)

    def plot(self, path) -> None:
        """A PNG of the SQNR of every layer (needs matplotlib: ``pip install "npu-backend[plot]"``)."""
        if all(math.isnan(layer.sqnr_db) for layer in self.layers):
            raise NpuError("no SQNR to plot: the model was calibrated without the float model (float_reference off)")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise NpuError("plotting needs matplotlib: pip install 'npu-backend[plot]'") from exc
        names = [layer.name for layer in self.layers]
        values = [min(layer.sqnr_db, 80.0) for layer in self.layers]
        colours = ["tab:blue" if layer.placement == "npu" else "tab:orange" for layer in self.layers]
        fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(names)), 4))
        ax.bar(range(len(names)), values, color=colours)
        ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
        ax.set_ylabel("SQNR vs float (dB, capped at 80)")
        ax.set_title(f"Per-layer SQNR; output {self.output_sqnr_db:.1f} dB (orange: host)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def quantization_report(mod: tvm.IRModule) -> QuantizationReport:
    """The report ``quantize`` attached to the module it returned."""
    attrs = mod.attrs
    if attrs is None or REPORT_ATTR not in attrs:
        raise NpuError("this module carries no quantization report (it was not produced by npu_backend.quantize)")
    return QuantizationReport.from_json(str(attrs[REPORT_ATTR]))
