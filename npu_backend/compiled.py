"""A compiled model on disk: a shared library that runs it, its command streams and a manifest.

``npu compile`` writes, into one directory:

* ``model.so``: the whole model (``Executable.export_library``): the host part compiled by TVM and every NPU
  region's command stream embedded (:mod:`npu_backend.codegen.embed`). Any process with npu_backend
  installed loads it with ``tvm.runtime.load_module`` and runs it; nothing is compiled again;
* ``<symbol>.npucmd``: the same streams, one file per NPU region (format 2: checksummed), for ``npu sim``
  and ``npu inspect``;
* ``manifest.json``: the source model's name and SHA-256; the model's inputs and outputs; the regions in
  call order, each stream's inputs and outputs under their model-level tensor names with shapes, dtypes
  and qparams; the hardware configuration; the numerics; the stream format; the SHA-256 of every file.

:func:`load_compiled` checks every file against the manifest before it loads the library.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from simulator.isa import FORMAT_VERSION, BufferKind
from simulator.stream import encode_stream

from .codegen import build_partitioned
from .codegen.lower import CONFIG_ATTR, lower_module
from .errors import NpuError
from .frontend import load_model
from .partition import partition_for_npu
from .qparams import infer_qparams, per_tensor_qparams
from .relax_exprs import is_call
from .report import partition_report

MANIFEST = "manifest.json"
LIBRARY = "model.so"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TensorTable:
    """Unique names (as TVMScript prints them) and known qparams of main's tensors.

    int8 tensors take the dataflow analysis's qparams; a float model input or output takes those of the
    quantize that consumes it or the dequantize that produces it (the grid it is exact on).
    """

    def __init__(self, main: relax.Function):
        self.names: dict = {}
        taken: set = set()
        bindings = [b for block in main.body.blocks for b in block.bindings]
        for var in [*main.params, *(b.var for b in bindings)]:
            name, k = var.name, 0
            while name in taken:
                k += 1
                name = f"{var.name}_{k}"
            taken.add(name)
            self.names[var] = name
        self.qparams = dict(infer_qparams(main))
        for b in bindings:
            if is_call(b.value, "relax.quantize") and b.value.args[0] in self.names:
                self.qparams.setdefault(b.value.args[0], per_tensor_qparams(b.value))
            if is_call(b.value, "relax.dequantize"):
                self.qparams.setdefault(b.var, per_tensor_qparams(b.value))

    def describe(self, expr, **extra) -> dict:
        ty, qp = expr.ty, self.qparams.get(expr)
        return {"name": self.names.get(expr, getattr(expr, "name", "?")), "shape": [int(d) for d in ty.shape.values],
                "dtype": str(ty.dtype), "scale": None if qp is None else qp.scale,
                "zero_point": None if qp is None else qp.zero_point, **extra}


def _region_calls(partitioned: tvm.IRModule, symbols: set[str]):
    """(symbol, argument expressions, result variables) of every region call in main, in call order."""
    bindings = [b for block in partitioned["main"].body.blocks for b in block.bindings]
    items = {}
    for b in bindings:
        if isinstance(b.value, relax.TupleGetItem):
            items.setdefault(b.value.tuple_value, {})[b.value.index] = b.var
    for b in bindings:
        callee = b.value.op if isinstance(b.value, relax.Call) else None
        if isinstance(callee, relax.GlobalVar) and callee.name_hint in symbols:
            results = items.get(b.var)
            outputs = [results[i] for i in sorted(results)] if results else [b.var]
            yield callee.name_hint, list(b.value.args), outputs


def write_compiled(model: str | Path, out: str | Path, preset="npu-256", reference: str = "auto") -> dict:
    """Compile the model file for ``preset``; write its library, its streams and the manifest into ``out``."""
    model, out = Path(model), Path(out)
    original = load_model(model)
    partitioned = partition_for_npu(original, preset, reference)
    hardware = json.loads(_hardware_json(partitioned))  # before anything is written: a model without NPU regions
    out.mkdir(parents=True, exist_ok=True)
    main = partitioned["main"]
    tensors = TensorTable(main)
    streams = lower_module(partitioned)
    encoded = {symbol: encode_stream(stream) for symbol, stream in streams.items()}
    report = partition_report(partitioned)
    build_partitioned(partitioned, streams=encoded).export_library(str(out / LIBRARY))
    regions = []
    for symbol, args, results in _region_calls(partitioned, set(streams)):
        stream, data = streams[symbol], encoded[symbol]
        (out / f"{symbol}.npucmd").write_bytes(data)
        stream_inputs = [b.name for _, b in stream.buffers_of(BufferKind.INPUT)]
        stream_outputs = [b.name for _, b in stream.buffers_of(BufferKind.OUTPUT)]
        regions.append({
            "symbol": symbol, "file": f"{symbol}.npucmd", "sha256": _sha256(data), "commands": len(stream.commands),
            "inputs": [tensors.describe(a, stream_buffer=s) for a, s in zip(args, stream_inputs)],
            "outputs": [tensors.describe(r, stream_buffer=s) for r, s in zip(results, stream_outputs)],
        })
    body = main.body.body
    outputs = list(body.fields) if isinstance(body, relax.Tuple) else [body]
    manifest = {
        "format_version": list(FORMAT_VERSION),
        "model": {"file": model.name, "sha256": _sha256(model.read_bytes())},
        "library": {"file": LIBRARY, "sha256": _sha256((out / LIBRARY).read_bytes())},
        "hardware": hardware,
        "numerics": report.numerics,
        "inputs": [tensors.describe(p) for p in main.params],
        "outputs": [tensors.describe(o) for o in outputs],
        "regions": regions,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _hardware_json(partitioned: tvm.IRModule) -> str:
    """The hardware configuration's JSON, as the regions record it."""
    for func in partitioned.functions.values():
        if func.attrs is not None and func.attrs.get("Codegen") == "npu":
            return str(func.attrs[CONFIG_ATTR])
    raise NpuError("the model has no NPU region to compile")


def _read_checked(directory: Path, entry: dict) -> bytes:
    path = directory / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise NpuError(f"cannot read {path}: {exc.strerror}") from None
    if _sha256(data) != entry["sha256"]:
        raise NpuError(f"{path.name} does not match the manifest's SHA-256: the compiled model is corrupt")
    return data


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise NpuError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise NpuError(f"{path} is not valid JSON: {exc}") from None
    missing = {"format_version", "model", "library", "hardware", "numerics", "inputs", "outputs",
               "regions"} - set(manifest)
    if missing:
        raise NpuError(f"{path} lacks {', '.join(sorted(missing))}")
    return manifest


def load_compiled(directory: str | Path):
    """(manifest, Relax VM) of a compiled directory: every file checked against the manifest, the library loaded."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for region in manifest["regions"]:
        _read_checked(directory, region)
    _read_checked(directory, manifest["library"])
    library = tvm.runtime.load_module(str(directory / manifest["library"]["file"]))
    return manifest, relax.VirtualMachine(library, tvm.cpu())


def run_compiled(directory: str | Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a compiled directory on model-level inputs (by the manifest's input names); outputs by name."""
    manifest, vm = load_compiled(directory)
    declared = manifest["inputs"]
    missing = [t["name"] for t in declared if t["name"] not in inputs]
    extra = sorted(set(inputs) - {t["name"] for t in declared})
    if missing or extra:
        raise NpuError(f"inputs do not match the model: missing {missing}, unexpected {extra}")
    arrays = []
    for t in declared:
        value = np.asarray(inputs[t["name"]])
        if str(value.dtype) != t["dtype"] or list(value.shape) != t["shape"]:
            raise NpuError(f"input {t['name']!r} must be {t['dtype']}{t['shape']}, got {value.dtype}{list(value.shape)}")
        arrays.append(tvm.runtime.tensor(value))
    result = vm["main"](*arrays)
    values = [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]
    return {t["name"]: v for t, v in zip(manifest["outputs"], values)}
