"""The runtimes whose outputs ours must equal, opened the one way every comparison uses.

Each opener imports its runtime lazily (they are extras) and raises ``ImportError`` when it is absent, so
callers can say how to install it. ``npu run`` (cli.py) and ``npu eval`` (distributed/references.py) both
open them here, so they compare against the same kernels with the same settings.
"""

from __future__ import annotations

from .errors import NpuError, first_line


def tflite_interpreter(path: str):
    """(allocated interpreter, label): TFLite's reference kernels (BUILTIN_REF), or, for a model using an operator
    BUILTIN_REF lacks (ELU), TFLite's builtin kernels without the XNNPACK delegate."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    try:
        interpreter = Interpreter(model_path=path, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
        label = "TFLite BUILTIN_REF"
    except ValueError as exc:
        if "Didn't find op" not in str(exc):
            raise NpuError(f"TFLite cannot load {path}: {first_line(exc)}") from None
        interpreter = Interpreter(model_path=path,
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
        label = f"TFLite builtin kernels, no delegate ({first_line(exc).split('.')[0]} in BUILTIN_REF)"
    interpreter.allocate_tensors()
    return interpreter, label


def onnxruntime_session(path: str):
    """(session, label): onnxruntime executing a QDQ graph literally (graph optimizations off, one thread)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]), "onnxruntime, optimizations off"
