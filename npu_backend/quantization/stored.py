"""The quantized-model file (``.npuq``): the float model it came from plus every calibrated decision.

Relax modules with constants cannot be serialized by TVM 0.27 (``save_json``
crashes on them), and a QDQ model is fully determined by the float graph and
the quantization parameters anyway, as a TensorRT calibration cache is. So the
file is an ``.npz`` holding the float model's own bytes, the qparams of every
quantized tensor, the int8 weights and int32 biases, the NPU configuration
and the report; loading it re-imports the float model, cuts the same layers
and emits the same QDQ module, and can simulate it again.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from simulator.config import NpuConfig

from ..errors import ModelImportError
from .calibrate import Context, Plan
from .config import QConfig
from .layers import cut_layers, prepared, tir_functions
from .qdq import emit_module
from .report import REPORT_ATTR, QuantizationReport
from .rewrite import TensorQ, WeightQ

FORMAT = "npu-quantized-model"
VERSION = 1
SUFFIX = ".npuq"


def _tensor_key(ctx: Context, var) -> str:
    params = list(ctx.func.params)
    if var in params:
        return f"param:{params.index(var)}"
    return f"layer:{ctx.producer[var].index}"


def save_quantized(calibrated, model_path: str | Path, path: str | Path) -> None:
    """Write a calibrated model (from :func:`npu_backend.quantization.calibrate` on ``model_path``'s model)."""
    ctx, plan = calibrated._ctx, calibrated._plan
    model_path = Path(model_path)
    arrays = {"model": np.frombuffer(model_path.read_bytes(), np.uint8)}
    weights = {}
    for index, wq in plan.weights.items():
        arrays[f"w{index}"], arrays[f"ws{index}"] = wq.weight, wq.scales
        if wq.bias is not None:
            arrays[f"b{index}"], arrays[f"bs{index}"] = wq.bias, wq.bias_scales
        weights[str(index)] = wq.axis
    constants = {}
    for index, table in plan.constants.items():
        layer = ctx.layers[index]
        entries = []
        for j, constant in enumerate(layer.constants):
            data, q = table[constant]
            arrays[f"c{index}_{j}"] = data
            entries.append([q.scale, q.zero_point])
        constants[str(index)] = entries
    meta = {
        "format": FORMAT, "version": VERSION, "model_suffix": model_path.suffix.lower(), "source": ctx.source,
        "npu": json.loads(ctx.npu.to_json()),
        "tensors": {_tensor_key(ctx, v): [q.scale, q.zero_point] for v, q in plan.tensors.items()},
        "weights": weights, "constants": constants, "float_layers": sorted(plan.float_layers),
        "reasons": {str(k): v for k, v in plan.reasons.items()}, "report": calibrated.report.to_json(),
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_quantized(path: str | Path):
    """The :class:`npu_backend.quantization.Calibrated` a ``.npuq`` file holds (its ``module`` is the QDQ model)."""
    from . import Calibrated
    from ..frontend import load_model

    path = Path(path)
    arrays, meta = _read(path)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / f"float{meta['model_suffix']}"
        model.write_bytes(arrays.pop("model").tobytes())
        mod = load_model(model)
    mod = prepared(mod)
    func = mod["main"]
    layers, folded = cut_layers(func)
    npu = NpuConfig.from_json(json.dumps(meta["npu"]))
    config = QConfig(rounding="tflite" if meta["source"] == "tflite" else "onnxruntime",
                     accumulator_bits=npu.accumulator_bits,
                     accumulator_overflow=getattr(npu, "accumulator_overflow", "wrap"))
    ctx = Context(func, layers, folded, config, npu, meta["source"], tir_functions(mod))
    plan = Plan(float_layers=set(meta["float_layers"]), reasons={int(k): v for k, v in meta["reasons"].items()})
    try:
        for key, (scale, zp) in meta["tensors"].items():
            kind, index = key.split(":")
            var = func.params[int(index)] if kind == "param" else layers[int(index)].output
            plan.tensors[var] = TensorQ(float(scale), int(zp))
        for index, axis in meta["weights"].items():
            i = int(index)
            plan.weights[i] = WeightQ(arrays[f"w{i}"], arrays[f"ws{i}"], axis, arrays.get(f"b{i}"),
                                      arrays.get(f"bs{i}"))
        for index, entries in meta["constants"].items():
            i = int(index)
            plan.constants[i] = {c: (arrays[f"c{i}_{j}"], TensorQ(float(s), int(z)))
                                 for j, (c, (s, z)) in enumerate(zip(layers[i].constants, entries))}
    except (KeyError, IndexError, ValueError) as exc:
        raise ModelImportError(f"{path.name}: its qparams do not fit the model it holds ({exc})") from None
    report = QuantizationReport.from_json(meta["report"])
    module = emit_module(ctx, plan).with_attr(REPORT_ATTR, meta["report"])
    return Calibrated(module, report, ctx, plan)


def _read(path: Path) -> tuple[dict, dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError, EOFError) as exc:
        raise ModelImportError(f"{path.name}: not a quantized-model file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ModelImportError(f"{path.name}: not a version-{VERSION} {FORMAT} file")
    return arrays, meta


def stored_config(path: str | Path) -> NpuConfig:
    """The NPU a quantized-model file was calibrated for (read without importing the model)."""
    _, meta = _read(Path(path))
    return NpuConfig.from_json(json.dumps(meta["npu"]))


def float_model_bytes(path: str | Path) -> tuple[bytes, str]:
    """The float model a quantized-model file holds (its own bytes) and its file suffix (``.tflite``, ``.onnx``)."""
    arrays, meta = _read(Path(path))
    return arrays["model"].tobytes(), meta["model_suffix"]
