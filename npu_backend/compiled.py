"""A compiled model on disk: its command streams, its model and a manifest that ties them together.

``npu compile`` writes, into one directory:

* ``<symbol>.npucmd``: one command stream per NPU region (format 2: checksummed);
* a copy of the model file, from which the host part is rebuilt (TVM 0.27 cannot serialize a Relax
  module with constants: ``tvm.ir.save_json`` crashes on one);
* ``manifest.json``: the model's inputs and outputs; the regions in call order, each stream's inputs and
  outputs under their model-level tensor names with shapes, dtypes and qparams; the hardware
  configuration; the numerics; the stream format; the SHA-256 of every file.

:func:`load_compiled` checks every file against the manifest, partitions the model again for the
manifest's hardware and numerics, requires its regions to be exactly the manifest's (a region's symbol
is a hash of its content and hardware), installs each stream from its file under that symbol (no region
is lowered again) and builds the host part around them.
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

from simulator.config import NpuConfig

from .codegen.lower import CONFIG_ATTR, lower_module
from .errors import NpuError
from .frontend import load_model
from .partition import partition_for_npu
from .qparams import infer_qparams, per_tensor_qparams
from .reference import Reference
from .relax_exprs import is_call
from .report import partition_report
from .runtime import install_stream

MANIFEST = "manifest.json"


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
    """Compile the model file for ``preset``; write its streams, a copy of it and the manifest into ``out``."""
    model, out = Path(model), Path(out)
    original = load_model(model)
    partitioned = partition_for_npu(original, preset, reference)
    out.mkdir(parents=True, exist_ok=True)
    model_bytes = model.read_bytes()
    (out / model.name).write_bytes(model_bytes)
    main = partitioned["main"]
    tensors = TensorTable(main)
    streams = lower_module(partitioned)
    report = partition_report(partitioned)
    regions = []
    for symbol, args, results in _region_calls(partitioned, set(streams)):
        stream = streams[symbol]
        data = encode_stream(stream)
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
        "model": {"file": model.name, "sha256": _sha256(model_bytes)},
        "hardware": json.loads(_hardware_json(partitioned)),
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
    missing = {"format_version", "model", "hardware", "numerics", "inputs", "outputs", "regions"} - set(manifest)
    if missing:
        raise NpuError(f"{path} lacks {', '.join(sorted(missing))}")
    return manifest


def load_compiled(directory: str | Path, target: str = "llvm"):
    """(manifest, Relax VM) of a compiled directory: every file checked, every stream installed from its file."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    model = directory / manifest["model"]["file"]
    _read_checked(directory, manifest["model"])
    try:
        hardware = NpuConfig.from_mapping(manifest["hardware"], where=f"{MANIFEST} hardware")
        reference = Reference(manifest["numerics"]).value
    except (TypeError, ValueError) as exc:
        raise NpuError(f"{MANIFEST}: {exc}") from None
    partitioned = partition_for_npu(load_model(model), hardware, reference)
    rebuilt = {str(f.attrs["global_symbol"]) for f in partitioned.functions.values()
               if f.attrs is not None and f.attrs.get("Codegen") == "npu"}
    listed = {region["symbol"] for region in manifest["regions"]}
    if rebuilt != listed:
        raise NpuError(f"the model's regions ({len(rebuilt)}) are not the manifest's ({len(listed)}): compiled by "
                       "another npu_backend, or the files do not belong together")
    for region in manifest["regions"]:
        data = _read_checked(directory, region)
        install_stream(region["symbol"], data)
    executable = tvm.compile(relax.transform.RunCodegen()(partitioned), target=target)
    return manifest, relax.VirtualMachine(executable, tvm.cpu())


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
