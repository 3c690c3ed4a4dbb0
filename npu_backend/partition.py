"""``partition_for_npu``: from an imported Relax module to NPU regions plus host code."""

from __future__ import annotations

import dataclasses
import re
import warnings

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.expr_functor import PyExprMutator, mutator

from simulator.config import DEFAULT_PRESET, NpuConfig, resolve_config

from .canonicalize import canonicalize
from .codegen.lower import CONFIG_ATTR
from .errors import InternalError, NpuError, NpuWarning
from .ops import composite_def
from .params import OPERAND_ROLES, OPERANDS_ATTR, to_attrs, to_attrs_value
from .patterns import PREFIX, PartitionContext, patterns_for
from .patterns.table import ACTIVE_CONTEXT, extract_params
from .qparam_checks import check_qparams
from .qparams import TensorQParams, infer_qparams
from .reference import Reference, choose_reference
from .report import REPORT_ATTR, OpPlacement, PartitionReport, operator_bindings, unmatched_reason


def _match_annotations(name: str, func: relax.Function):
    """Re-match the composite's patterns on its body: (idiom, named sub-expressions)."""
    var2val = relax.analysis.get_var2val(func)
    root = var2val.get(func.body.body, func.body.body)
    for idiom in composite_def(name).idioms:
        for with_clip in (True, False) if idiom.fused_clip else (False,):
            pattern, annotations = idiom.build(with_clip)
            matched = pattern.extract_matched_expr(root, var2val)
            if matched is not None:
                return idiom, {key: matched[p] for key, p in annotations.items() if p in matched}
    raise InternalError(f"composite {name} no longer matches its own pattern")


SOURCE_ATTR = "npu.source_vars"


def _composite_sources(original: relax.Function, fused: tvm.IRModule) -> dict:
    """Composite global var -> names of the original bindings it absorbed.

    FuseOpsByPattern keeps the names of the bindings it moves into a composite,
    except the composite's output, whose call it places where that output was.
    So an absorbed binding is either named inside some composite, or it is the
    output of the next composite call in program order.
    """
    calls, inner_names = [], {}
    for block in fused["main"].body.blocks:
        for binding in block.bindings:
            callee = binding.value.op if isinstance(binding.value, relax.Call) else None
            if isinstance(callee, relax.GlobalVar) and "Composite" in (fused[callee].attrs or {}):
                calls.append(callee)
                composite = fused[callee]
                # its output binding is renamed (often "gv", like the graph's own output): not a source name
                output = composite.body.body.name if isinstance(composite.body.body, relax.Var) else None
                inner_names.update({name: callee for name, _ in operator_bindings(composite) if name != output})
    host = {name for name, _ in operator_bindings(fused["main"])}
    sources: dict = {callee: [] for callee in calls}
    pending = iter(calls)
    for name, _ in operator_bindings(original):
        if name in host:
            continue
        owner = inner_names.get(name) or next(pending, None)
        if owner is not None:
            sources[owner].append(name)
    return sources


def _operand_order(func: relax.Function, annotations: dict) -> list[int]:
    """Indices of the composite's parameters in operand order (input, input2, ...); -1 for a constant."""
    index = {param: i for i, param in enumerate(func.params)}
    operands = [annotations[role] for role in OPERAND_ROLES if role in annotations]
    variables = [op for op in operands if not isinstance(op, Constant)]
    if any(op not in index for op in variables) or len(set(variables)) != len(func.params):
        raise InternalError(f"operands of {func.attrs['Composite']} are not its parameters")
    return [-1 if isinstance(op, Constant) else index[op] for op in operands]


QPARAM_FIELDS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


def _transparent_qparams(params, qp: TensorQParams | None) -> tuple:
    """A qparam-transparent operator's record and extra attributes, with the qparams the dataflow analysis
    found for its int8 tensor (its input's and output's alike) where the record lacks them."""
    if qp is None:
        return params, {}
    values = dict(zip(QPARAM_FIELDS, (qp.scale, qp.zero_point) * 2))
    names = {f.name for f in dataclasses.fields(params)}
    if set(QPARAM_FIELDS) <= names:
        unknown = getattr(params, "input_scale") == 0.0
        return (dataclasses.replace(params, **values) if unknown else params), {}
    if names & set(QPARAM_FIELDS):
        return params, {}
    return params, {f"npu.{k}": to_attrs_value(v) for k, v in values.items()}


def _role_qparams(idiom, func: relax.Function, annotations: dict, site, output: str | None,
                  tensor_qparams: dict) -> dict:
    """Dataflow qparams of the tensors an entry asks for: a composite parameter is its call's argument,
    and its result the last original binding it absorbed (the call's own variable is renamed)."""
    if not idiom.qparam_roles or site is None:
        return {}
    names = {"output": output}
    for role in idiom.qparam_roles:
        expr = annotations.get(role)
        if any(expr is p or expr.same_as(p) for p in func.params):
            arg = site.value.args[[p.same_as(expr) for p in func.params].index(True)]
            names[role] = arg.name if isinstance(arg, relax.Var) else None
    return {role: tensor_qparams.get(names.get(role)) for role in idiom.qparam_roles}


def _annotate_composites(original: relax.Function, mod: tvm.IRModule, reference: Reference) -> tvm.IRModule:
    """Write each composite's extracted qparams, and the bindings it absorbed, onto it as attributes.

    Qparam-transparent operators (pooling, reshape, pad, transpose, slices) whose
    graph states no qparams around them get those of their int8 tensor from
    :func:`npu_backend.qparams.infer_qparams`.
    """
    sources = _composite_sources(original, mod)
    tensor_qparams = {var.name: qp for var, qp in infer_qparams(original).items()}
    call_sites = {b.value.op: b for block in mod["main"].body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and isinstance(b.value.op, relax.GlobalVar)}
    for gvar, func in list(mod.functions_items()):
        name = str(func.attrs["Composite"]) if func.attrs and "Composite" in func.attrs else ""
        if not name.startswith(PREFIX + "."):
            continue
        idiom, annotations = _match_annotations(name, func)
        absorbed = sources.get(gvar, [])
        params = extract_params(idiom, annotations, reference,
                                _role_qparams(idiom, func, annotations, call_sites.get(gvar),
                                              absorbed[-1] if absorbed else None, tensor_qparams))
        params, extra = _transparent_qparams(params, tensor_qparams.get(absorbed[-1]) if absorbed else None)
        mod[gvar] = func.with_attrs({**to_attrs(params), **extra, SOURCE_ATTR: absorbed,
                                     OPERANDS_ATTR: _operand_order(func, annotations)})
    return mod


@mutator
class _RenameGlobals(PyExprMutator):
    """Point every call of a renamed function at its new GlobalVar."""

    def __init__(self, renames: dict, mod: tvm.IRModule):
        super().__init__(mod)
        self.renames = renames

    def visit_global_var_(self, gvar):
        return self.renames.get(gvar, gvar)


def _name_regions(mod: tvm.IRModule, config: NpuConfig) -> tvm.IRModule:
    """Give each NPU region a content-derived name, used as its ``global_symbol``, and record its hardware.

    The symbol names the command stream at run time; deriving it from the
    region's structure (constants included) and the configuration's numbers
    means two models compiled in one process can never run each other's streams.
    The region's GlobalVar takes the same name, as TVM's well-formedness requires.
    """
    label = re.sub(r"\W", "_", config.name)
    regions, renames = {}, {}
    for gvar, func in mod.functions_items():
        if func.attrs is not None and func.attrs.get("Codegen") == PREFIX:
            func = func.with_attr(CONFIG_ATTR, config.to_json())
            symbol = f"npu_{label}_{tvm_ffi.structural_hash(func) & (2**64 - 1):016x}"
            regions[gvar] = func.with_attr("global_symbol", symbol)
            renamed = relax.GlobalVar(symbol)
            relax.expr._update_type(renamed, gvar.ty)
            renames[gvar] = renamed
    out = tvm.IRModule({}, attrs=mod.attrs)
    for gvar, func in mod.functions_items():
        if gvar in regions:
            out[renames[gvar]] = regions[gvar]
        elif isinstance(func, relax.Function):
            out[gvar] = _RenameGlobals(renames, mod).visit_expr(func)
        else:
            out[gvar] = func
    return out


def _placements(partitioned: tvm.IRModule) -> dict[str, tuple[str, str]]:
    """Original binding name -> (region symbol, composite) for everything offloaded."""
    placement = {}
    for func in partitioned.functions.values():
        if not (func.attrs is not None and func.attrs.get("Codegen") == PREFIX):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                inner = binding.value
                if isinstance(inner, relax.Function) and SOURCE_ATTR in (inner.attrs or {}):
                    for name in inner.attrs[SOURCE_ATTR]:
                        placement[str(name)] = (str(func.attrs["global_symbol"]), str(inner.attrs["Composite"]))
    return placement


def _build_report(original: relax.Function, partitioned: tvm.IRModule, context: PartitionContext,
                  numerics) -> PartitionReport:
    placement = _placements(partitioned)
    reasons: dict[str, list[str]] = {}
    for rejection in context.rejections:
        text = f"{rejection.composite}: {rejection.reason}"
        if text not in reasons.setdefault(rejection.anchor, []):
            reasons[rejection.anchor].append(text)
    rows = []
    for var, op in operator_bindings(original):
        if var in placement:
            region, composite = placement[var]
            rows.append(OpPlacement(var, op, "npu", composite=composite, region=region))
        else:
            rows.append(OpPlacement(var, op, "host", reason="; ".join(reasons.get(var, [unmatched_reason(op)]))))
    return PartitionReport(context.config.name, tuple(rows), numerics.reference.value, numerics.why)


def _warn_other_accumulators(mod: tvm.IRModule, config: NpuConfig) -> None:
    """A module ``npu_backend.quantize`` made records the accumulators it was calibrated on; built for others, its
    outputs are right for that hardware but differ from the calibration's simulation wherever a sum overflows, so
    say so rather than let the difference pass for a defect (``Calibrated.npu_config`` is the hardware to pass)."""
    from .quantization.report import REPORT_ATTR as QUANTIZATION_ATTR, quantization_report

    if mod.attrs is None or QUANTIZATION_ATTR not in mod.attrs:
        return
    try:
        report = quantization_report(mod)
    except (ValueError, KeyError, TypeError):
        return  # a report this version did not write: nothing to compare
    calibrated = (report.accumulator_bits, report.overflow_mode)
    if calibrated != (config.accumulator_bits, config.accumulator_overflow):
        warnings.warn(NpuWarning(
            f"this module was calibrated for {calibrated[0]}-bit accumulators that {calibrated[1]}; partitioning for "
            f"{config.name} ({config.accumulator_bits}-bit, {config.accumulator_overflow}): where a sum overflows, "
            "its outputs differ from the calibration's simulation (pass Calibrated.npu_config as the preset)"),
            stacklevel=3)


def partition_for_npu(mod: tvm.IRModule, preset: NpuConfig | str = DEFAULT_PRESET,
                      reference: str = "auto") -> tvm.IRModule:
    """Split a quantized Relax module into NPU regions (``Codegen="npu"``) and host code.

    Parameters
    ----------
    mod : tvm.IRModule
        A module as TVM's importers produce it (e.g. ``from_tflite``), entry ``main``.
    preset : NpuConfig or str
        The hardware whose limits the pattern checks apply: an ``NpuConfig``, a preset name (see
        ``simulator.PRESETS``) or the path of a ``.toml`` / ``.json`` configuration file.
    reference : str
        Whose integer results to reproduce: ``"tflite"`` (fixed-point requantization, round half
        away from zero), ``"onnxruntime"`` (its float32 QDQ execution, round half to even), or ``"auto"``: the
        source the loader recorded on the module, TFLite when there is none (see
        :mod:`npu_backend.reference`).

    Returns
    -------
    tvm.IRModule
        The partitioned module. Every NPU composite carries its qparams as
        ``npu.*`` attributes; the module attribute ``npu.partition_report``
        says where each operator of the canonicalized graph (see
        :mod:`npu_backend.canonicalize`; TFLite graphs are already canonical) runs and why (read it with
        :func:`npu_backend.partition_report`). Build it with
        ``relax.transform.RunCodegen()`` then ``tvm.compile``, or use
        :func:`npu_backend.build` which does both.
    """
    config = resolve_config(preset)
    if not isinstance(mod, tvm.IRModule) or "main" not in mod:
        raise NpuError("partition_for_npu needs an IRModule with a 'main' function")
    _warn_other_accumulators(mod, config)
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            check_qparams(func)
    original = relax.transform.ConvertToDataflow()(canonicalize(mod))
    numerics = choose_reference(mod, reference)
    context = PartitionContext(config, numerics.reference,
                               tensor_qparams={v.name: qp for v, qp in infer_qparams(original["main"]).items()})
    token = ACTIVE_CONTEXT.set(context)
    try:
        fused = relax.transform.FuseOpsByPattern(patterns_for(original), bind_constants=True,
                                                 annotate_codegen=False)(original)
    finally:
        ACTIVE_CONTEXT.reset(token)
    if context.failure is not None:
        raise context.failure
    fused = _annotate_composites(original["main"], fused, context.reference)
    merged = relax.transform.MergeCompositeFunctions()(fused)
    partitioned = _name_regions(merged, config)
    report = _build_report(original["main"], partitioned, context, numerics)
    return partitioned.with_attr(REPORT_ATTR, report.to_json())
