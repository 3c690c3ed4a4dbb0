"""npu_backend: a BYOC NPU backend for Apache TVM (Relax).

Importing it registers the ``npu`` pattern table in TVM's pattern registry and
the ``relax.ext.npu`` codegen.

Typical use::

    mod = npu_backend.partition_for_npu(mod)        # inspectable
    mod = relax.transform.RunCodegen()(mod)          # NPU regions -> command streams
    ex = tvm.compile(mod, target="llvm")
    # or, in one line: ex = npu_backend.build(mod)
"""

from __future__ import annotations

import tvm

from simulator.config import DEFAULT_PRESET, PRESETS, NpuConfig, get_config, load_config, register_preset

from . import codegen
from .distributed import Evaluation, Sweep, evaluate, sweep
from .errors import InternalError, ModelImportError, NpuError, QParamError, UnsupportedOpError
from .frontend import load_model, load_onnx, load_tflite
from .ops import OPS
from .partition import partition_for_npu
from .patterns import register_table
from .profiling import Profile, profile
from .quantization import QConfig, QuantizationReport, calibrate, quantization_report, quantize
from .report import PartitionReport, partition_report

register_table(OPS)
codegen.register_codegen()


def build(mod: tvm.IRModule, target: str = "llvm", preset: NpuConfig | str = DEFAULT_PRESET):
    """Partition, generate NPU command streams and build the host part in one step.

    Equivalent to ``tvm.compile(RunCodegen()(partition_for_npu(mod, preset)), target)``; ``preset`` is an
    ``NpuConfig``, a preset name or a configuration file.
    """
    return codegen.build_partitioned(partition_for_npu(mod, preset), target)


__all__ = [
    "build", "partition_for_npu", "partition_report", "PartitionReport", "profile", "Profile",
    "load_tflite", "load_onnx", "load_model", "codegen", "NpuError", "InternalError", "ModelImportError", "QParamError",
    "UnsupportedOpError", "quantize", "calibrate", "QConfig", "QuantizationReport", "quantization_report",
    "DEFAULT_PRESET", "PRESETS", "NpuConfig", "get_config", "load_config", "register_preset",
    "evaluate", "Evaluation", "sweep", "Sweep",
]
