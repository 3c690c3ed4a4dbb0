"""``partition_for_npu``: from an imported Relax module to NPU regions plus host code."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from simulator.config import DEFAULT_PRESET, get_config

from .codegen.lower import CONFIG_ATTR
from .params import to_attrs
from .patterns import ENTRY_BY_NAME, PREFIX, PartitionContext, registered_patterns
from .patterns.table import ACTIVE_CONTEXT
from .errors import NpuError
from .report import NO_PATTERN, REPORT_ATTR, OpPlacement, PartitionReport, operator_bindings


def _match_annotations(entry, func: relax.Function) -> dict:
    """Re-match the entry's pattern on a fused composite to recover the named sub-expressions."""
    var2val = relax.analysis.get_var2val(func)
    root = var2val.get(func.body.body, func.body.body)
    for with_clip in (True, False) if entry.clip_variant else (False,):
        pattern, annotations = entry.build(with_clip)
        matched = pattern.extract_matched_expr(root, var2val)
        if matched is not None:
            return {name: matched[p] for name, p in annotations.items() if p in matched}
    raise RuntimeError(f"internal error: composite {entry.name} no longer matches its own pattern")


def _annotate_composites(mod: tvm.IRModule) -> tvm.IRModule:
    """Write each composite's extracted qparams onto it as ``npu.*`` attributes."""
    for gvar, func in list(mod.functions_items()):
        name = str(func.attrs["Composite"]) if func.attrs and "Composite" in func.attrs else ""
        if not name.startswith(PREFIX + "."):
            continue
        entry = ENTRY_BY_NAME[name]
        params = entry.extract(_match_annotations(entry, func))
        mod[gvar] = func.with_attrs(to_attrs(params))
    return mod


def _name_regions(mod: tvm.IRModule, preset: str) -> tvm.IRModule:
    """Give each NPU region a content-derived ``global_symbol`` and record its preset.

    The symbol names the command stream at run time; deriving it from the
    region's structure (constants included) and the preset means two models
    compiled in one process can never run each other's streams.
    """
    for gvar, func in list(mod.functions_items()):
        if func.attrs is not None and func.attrs.get("Codegen") == PREFIX:
            func = func.with_attr(CONFIG_ATTR, preset)
            digest = tvm_ffi.structural_hash(func) & (2**64 - 1)
            mod[gvar] = func.with_attr("global_symbol", f"npu_{preset.replace('-', '_')}_{digest:016x}")
    return mod


def _region_of_vars(mod: tvm.IRModule) -> dict[str, str]:
    """Names bound inside the composites of each NPU region -> region symbol.

    Composite bodies keep the names of the bindings they absorbed (all but
    their output), which is enough to tell which region an accepted match went to.
    """
    region_of = {}
    for func in mod.functions.values():
        if not (func.attrs is not None and func.attrs.get("Codegen") == PREFIX):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding.value, relax.Function):
                    for var, _ in operator_bindings(binding.value):
                        region_of[var] = str(func.attrs["global_symbol"])
    return region_of


def _build_report(original: tvm.IRModule, partitioned: tvm.IRModule, context: PartitionContext) -> PartitionReport:
    host_vars = {var for var, _ in operator_bindings(partitioned["main"])}
    region_of = _region_of_vars(partitioned)
    composite_of = {}
    for composite, names in context.accepted:
        region = next((region_of[n] for n in names if n in region_of), "")
        composite_of.update({n: (composite, region) for n in names})
    reasons: dict[str, list[str]] = {}
    for rejection in context.rejections:
        text = f"{rejection.composite}: {rejection.reason}"
        if text not in reasons.setdefault(rejection.anchor, []):
            reasons[rejection.anchor].append(text)
    rows = []
    for var, op in operator_bindings(original["main"]):
        if var in host_vars or var not in composite_of:
            rows.append(OpPlacement(var, op, "host", reason="; ".join(reasons.get(var, [NO_PATTERN]))))
        else:
            composite, region = composite_of[var]
            rows.append(OpPlacement(var, op, "npu", composite=composite, region=region))
    return PartitionReport(context.config.name, tuple(rows))


def partition_for_npu(mod: tvm.IRModule, preset: str = DEFAULT_PRESET) -> tvm.IRModule:
    """Split a quantized Relax module into NPU regions (``Codegen="npu"``) and host code.

    Parameters
    ----------
    mod : tvm.IRModule
        A module as TVM's importers produce it (e.g. ``from_tflite``), entry ``main``.
    preset : str
        Hardware preset whose limits the pattern checks apply (see ``simulator.PRESETS``).

    Returns
    -------
    tvm.IRModule
        The partitioned module. Every NPU composite carries its qparams as
        ``npu.*`` attributes; the module attribute ``npu.partition_report``
        says where each original operator runs and why (read it with
        :func:`npu_backend.partition_report`). Build it with
        ``relax.transform.RunCodegen()`` then ``tvm.compile``, or use
        :func:`npu_backend.build` which does both.
    """
    config = get_config(preset)
    if not isinstance(mod, tvm.IRModule) or "main" not in mod:
        raise NpuError("partition_for_npu needs an IRModule with a 'main' function")
    original = relax.transform.ConvertToDataflow()(mod)
    context = PartitionContext(config)
    token = ACTIVE_CONTEXT.set(context)
    try:
        fused = relax.transform.FuseOpsByPattern(registered_patterns(), bind_constants=True,
                                                 annotate_codegen=False)(original)
    finally:
        ACTIVE_CONTEXT.reset(token)
    fused = _annotate_composites(fused)
    merged = relax.transform.MergeCompositeFunctions()(fused)
    partitioned = _name_regions(merged, config.name)
    report = _build_report(original, partitioned, context)
    return partitioned.with_attr(REPORT_ATTR, report.to_json())
