"""What an evaluation compares the NPU with: a reference runtime, or the model in float on the host.

* ``tflite``: LiteRT's reference kernels (BUILTIN_REF; the builtin kernels without delegates for a model using
  an operator BUILTIN_REF lacks), the runtime the NPU is bit-exact with for TFLite models;
* ``onnxruntime``: onnxruntime executing the graph literally (optimizations off, one thread);
* ``float``: the model built by TVM for the CPU alone, nothing offloaded (a QDQ model then runs its quantize /
  dequantize in float, TVM's own emulation).

Each runs the model's *source*: for a ``.npuq`` file, the float model it was quantized from, so the figures
measure what quantization and the NPU cost against the original. A runner is opened once per process.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import NpuError
from ..reference_runtimes import onnxruntime_session, tflite_interpreter
from .model_files import ModelFile

_RUNNERS: dict[tuple[str, str], "Runner"] = {}


@dataclass(frozen=True)
class Runner:
    label: str
    run: Callable[[list[np.ndarray]], list[np.ndarray]]


def _tflite(model: ModelFile) -> Runner:
    interpreter, label = tflite_interpreter(str(model.path()))
    inputs, outputs = interpreter.get_input_details(), interpreter.get_output_details()

    def run(values):
        for detail, value in zip(inputs, values):
            interpreter.set_tensor(detail["index"], value)
        interpreter.invoke()
        return [interpreter.get_tensor(d["index"]).copy() for d in outputs]

    return Runner(label, run)


def _onnxruntime(model: ModelFile) -> Runner:
    session, label = onnxruntime_session(str(model.path()))
    names = [i.name for i in session.get_inputs()]
    return Runner(label, lambda values: session.run(None, dict(zip(names, values))))


def _float(model: ModelFile) -> Runner:
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(tvm.compile(model.load(), target="llvm"), tvm.cpu())

    def run(values):
        result = vm["main"](*[tvm.runtime.tensor(v) for v in values])
        return [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]

    return Runner("the model in float on the host (TVM, nothing offloaded)", run)


REFERENCES: dict[str, tuple[Callable[[ModelFile], Runner], str | None, tuple[str, ...]]] = {
    "tflite": (_tflite, "ai_edge_litert", (".tflite",)),
    "onnxruntime": (_onnxruntime, "onnxruntime", (".onnx",)),
    "float": (_float, None, (".tflite", ".onnx")),
}
"""name -> (opener, the module it needs, the model files it runs)."""

NATIVE = {".tflite": "tflite", ".onnx": "onnxruntime"}
"""The runtime a source format's models are checked against by default."""


def resolve_reference(requested: str, model: ModelFile) -> tuple[str | None, str | None]:
    """(reference to use or None, a note for the user): ``auto`` picks the model file's own runtime (``float``
    for a ``.npuq`` file), or none, with a note, when that runtime is not installed; ``none`` compares nothing."""
    if requested == "none":
        return None, None
    source_suffix = _source_suffix(model)
    if requested == "auto":
        name = "float" if model.suffix == ".npuq" else NATIVE.get(source_suffix)
        module = REFERENCES[name][1]
        if module is not None and importlib.util.find_spec(module) is None:
            return None, (f"reference skipped: {module} is not installed (pip install 'npu-backend[reference]', "
                          "or --reference float)")
        return name, None
    if requested not in REFERENCES:
        raise NpuError(f"unknown reference {requested!r}; known: auto, {', '.join(REFERENCES)}, none")
    _, module, suffixes = REFERENCES[requested]
    if source_suffix not in suffixes:
        raise NpuError(f"the {requested} reference runs {' and '.join(suffixes)} models; {model.name}'s source is "
                       f"{source_suffix}")
    if module is not None and importlib.util.find_spec(module) is None:
        raise NpuError(f"--reference {requested} needs {module}: pip install 'npu-backend[reference]'")
    return requested, None


def _source_suffix(model: ModelFile) -> str:
    if model.suffix != ".npuq":
        return model.suffix
    from ..quantization.stored import float_model_bytes

    return float_model_bytes(model.path())[1]


def reference_runner(name: str, model: ModelFile) -> Runner:
    """The runner of reference ``name`` on ``model``'s source, opened once per process."""
    key = (name, model.sha256)
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = _RUNNERS[key] = REFERENCES[name][0](model.source())
    return runner
