"""The partition report: where every operator of the input graph runs, and why.

It is computed by ``partition_for_npu`` and stored on the returned module as
the ``npu.partition_report`` attribute (JSON), so it travels with the module
and can be read back with :func:`partition_report`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import tvm
from tvm import relax

from .errors import NpuError

REPORT_ATTR = "npu.partition_report"
NO_PATTERN = "no NPU pattern covers this operator"
FLOAT_BOUNDARY = {
    "relax.quantize": "float to int8 quantization (e.g. of a float model input): the NPU computes only on int8",
    "relax.dequantize": "int8 to float dequantization (e.g. to a float model output): the NPU computes only on int8",
}
"""Why a quantize/dequantize no composite absorbed stays on the host: it is where float data begins or ends."""


def unmatched_reason(op: str) -> str:
    """The reason for a host operator that no NPU pattern claimed."""
    return FLOAT_BOUNDARY.get(op, NO_PATTERN)


@dataclass(frozen=True)
class OpPlacement:
    var: str
    op: str
    target: str  # "npu" or "host"
    composite: str = ""
    region: str = ""
    reason: str = ""


@dataclass(frozen=True)
class PartitionReport:
    preset: str
    ops: tuple[OpPlacement, ...]
    numerics: str = "tflite"
    """Whose integer results the NPU reproduces (:class:`npu_backend.reference.Reference` value)."""
    numerics_why: str = ""

    @property
    def npu_ops(self) -> list[OpPlacement]:
        return [o for o in self.ops if o.target == "npu"]

    @property
    def host_ops(self) -> list[OpPlacement]:
        return [o for o in self.ops if o.target == "host"]

    def to_json(self) -> str:
        return json.dumps({"preset": self.preset, "numerics": self.numerics, "numerics_why": self.numerics_why,
                           "ops": [asdict(o) for o in self.ops]})

    @classmethod
    def from_json(cls, text: str) -> "PartitionReport":
        data = json.loads(text)
        return cls(data["preset"], tuple(OpPlacement(**o) for o in data["ops"]), data.get("numerics", "tflite"),
                   data.get("numerics_why", ""))

    def format_table(self) -> str:
        lines = [f"{'var':<12} {'op':<22} {'target':<6} {'composite / reason'}"]
        for o in self.ops:
            detail = o.composite if o.target == "npu" else o.reason
            lines.append(f"{o.var:<12} {o.op:<22} {o.target:<6} {detail}")
        n = len(self.ops)
        lines.append(f"{len(self.npu_ops)} of {n} operators on the NPU ({self.preset}), {len(self.host_ops)} on the host")
        lines.append(f"numerics: {self.numerics} ({self.numerics_why})")
        return "\n".join(lines)


def operator_bindings(func: relax.Function) -> list[tuple[str, str]]:
    """(bound var name, op name) of every operator call in a function body."""
    rows = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                rows.append((binding.var.name, str(value.op.name)))
    return rows


def partition_report(mod) -> PartitionReport:
    """Read the report ``partition_for_npu`` attached to a module."""
    if mod.attrs is None or REPORT_ATTR not in mod.attrs:
        raise NpuError("module carries no partition report: run npu_backend.partition_for_npu first")
    return PartitionReport.from_json(str(mod.attrs[REPORT_ATTR]))
