"""The operator and opcode tables are the one source of each fact: the layers point one way, every pattern's
Relax operators are classified, nothing unknown takes a default, and each table-driven bound holds exactly at
its limit and fails one past it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from tvm import relax
from tvm.relax.dpl import pattern as dpl

import npu_backend
from npu_backend.errors import InternalError, UnsupportedOpError
from npu_backend.ops import MAX_CONCAT_INPUTS, OPS, decode_composite, op_def
from npu_backend.params import NpuOp
from npu_backend.relax_ops import RELAX_OPS
from npu_backend.tiling import plan_layer
from relax_idioms import ConvIdiom, activation_module, f32, i32
from simulator import get_config

ROOT = Path(npu_backend.__file__).resolve().parent.parent
BASE = get_config("npu-256")


# -- the import graph -------------------------------------------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in ("npu_backend", "simulator") for p in (ROOT / package).rglob("*.py")}


def _imports(name: str, path: Path, known: dict) -> set[str]:
    """Project modules a module imports at its top (the ones that run when it is imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
                parent = target.rpartition(".")[0]
                while parent:  # a submodule import runs its packages' __init__ too
                    found.add(parent)
                    parent = parent.rpartition(".")[0]
    found -= {name, "npu_backend"}  # the root package is the facade that wires everything together
    return found


def _reach(start: str) -> set[str]:
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", ["npu_backend.patterns", "npu_backend.patterns.builders",
                                    "npu_backend.patterns.extract", "npu_backend.patterns.fixed_point",
                                    "npu_backend.patterns.table", "npu_backend.canonicalize"])
def test_the_front_end_does_not_import_the_back_end(module):
    reached = _reach(module)
    assert not {m for m in reached if m.startswith("npu_backend.codegen") or m == "npu_backend.ops"}, reached


@pytest.mark.parametrize("module", ["npu_backend.tiling", "npu_backend.prepare", "npu_backend.legality",
                                    "npu_backend.params"])
def test_planning_and_preparation_sit_below_both(module):
    reached = _reach(module)
    assert not {m for m in reached if m.startswith(("npu_backend.codegen", "npu_backend.patterns"))}, reached


def test_the_simulator_imports_no_compiler():
    for name in _modules():
        if name.startswith("simulator"):
            assert not {m for m in _reach(name) if m.startswith("npu_backend")}, name


def test_the_import_graph_check_sees_real_edges():
    """The checker is not vacuous: it finds the edges the code has."""
    assert "npu_backend.codegen.emit" in _reach("npu_backend.ops")
    assert {"npu_backend.legality", "npu_backend.patterns.table"} <= _reach("npu_backend.patterns")
    assert "npu_backend.prepare" in _reach("npu_backend.patterns.fixed_point")


# -- one definition per fact ------------------------------------------------------------------------------------

def _relax_ops(pattern) -> set[str]:
    if isinstance(pattern, dpl.CallPattern):
        own = {pattern.op.expr.name} if isinstance(pattern.op, dpl.ExprPattern) else set()
        return own.union(*(_relax_ops(a) for a in pattern.args))
    if isinstance(pattern, (dpl.OrPattern, dpl.AndPattern)):
        return _relax_ops(pattern.left) | _relax_ops(pattern.right)
    if isinstance(pattern, dpl.AttrPattern):  # an operator selected by attribute (a resize's method)
        return _relax_ops(pattern.pattern)
    if isinstance(pattern, dpl.TuplePattern):
        return set().union(*(_relax_ops(f) for f in pattern.fields))
    return set()


def test_every_operator_a_pattern_matches_is_classified():
    """layout.py and qparams.py derive their operator sets from relax_ops.RELAX_OPS; a pattern may use only
    operators that table classifies, so a new idiom cannot silently miss the layout pass or the dataflow."""
    used = set()
    for definition in OPS:
        for idiom in definition.idioms:
            for with_clip in (True, False):
                used |= _relax_ops(idiom.build(with_clip)[0])
    assert used - set(RELAX_OPS) == set()
    assert {"relax.nn.conv2d", "relax.nn.gelu", "relax.divide", "relax.exp", "relax.image.resize2d"} <= used


def test_every_operator_has_exactly_one_definition():
    assert sorted(d.op.name for d in OPS) == sorted(op.name for op in NpuOp)
    assert len({d.composite for d in OPS}) == len(OPS)


# -- errors, not defaults ---------------------------------------------------------------------------------------

def test_an_operator_without_a_definition_is_refused_by_name(monkeypatch):
    monkeypatch.delitem(npu_backend.ops._BY_OP, NpuOp.ELU)
    with pytest.raises(UnsupportedOpError, match="NPU operator ELU has no definition"):
        op_def(NpuOp.ELU)


def test_a_composite_naming_no_operator_is_refused():
    with pytest.raises(UnsupportedOpError, match="npu.op='WARP_DRIVE' names no NPU operator"):
        decode_composite({"npu.op": "WARP_DRIVE"})


def test_a_bug_in_a_check_surfaces_instead_of_hiding_as_a_host_fallback(monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'attrs'")

    monkeypatch.setattr("npu_backend.patterns.table.extract_params", broken)
    with pytest.raises(InternalError, match=r"checking the npu\.\w+ match at \w+: AttributeError"):
        npu_backend.partition_for_npu(ConvIdiom().module())


def test_the_lowering_refuses_what_the_rules_refuse():
    """Codegen re-runs the legality check: a record edited to break a rule cannot reach the hardware."""
    from layer_streams import layer_stream, random_params

    p = random_params(np.random.default_rng(0), NpuOp.CONV2D, (1, 12, 12, 4), out_channels=4, kernel=(5, 5),
                      padding=(2, 2, 2, 2))
    with pytest.raises(UnsupportedOpError, match="conv2d_0 .npu.conv2d. cannot run on small-kernel: kernel 5x5"):
        layer_stream(p, dataclasses.replace(BASE, name="small-kernel", max_kernel=3))


# -- table-driven bounds, at the limit and one past it -----------------------------------------------------------

def _concat_module(arity: int):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType((1, 4, 4, 8), "int8")) for i in range(arity)]
    with bb.function("main", xs):
        with bb.dataflow():
            dqs = [bb.emit(relax.op.dequantize(x, f32(0.05), i32(3), axis=0)) for x in xs]
            cat = bb.emit(relax.op.concat(dqs, axis=3))
            gv = bb.emit_output(relax.op.quantize(cat, f32(0.05), i32(3), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("arity, offloaded", [(MAX_CONCAT_INPUTS, True), (MAX_CONCAT_INPUTS + 1, False)])
def test_concat_of_at_most_max_inputs_is_offloaded(arity, offloaded):
    report = npu_backend.partition_report(npu_backend.partition_for_npu(_concat_module(arity)))
    (concat,) = [o for o in report.ops if o.op == "relax.concat"]
    assert (concat.target == "npu") == offloaded
    if not offloaded:
        assert concat.reason.startswith("no NPU pattern")


def _one_by_one(in_channels=8, width=6, out_channels=4):
    return ConvIdiom(x_shape=(1, 5, width, in_channels), out_channels=out_channels, kernel=(1, 1),
                     padding=(0, 0, 0, 0))


def test_sram_fit_exactly_and_one_byte_over():
    """With 1-byte alignment, a 1x1 layer's smallest tile (one output channel, one output row) needs
    weights IC + scale/bias 12 + one input row W*IC + one output row W bytes: that SRAM runs it, one byte
    less keeps it on the host; and the whole layer in one tile needs its full sum."""
    idiom = _one_by_one()
    ic, w, oc, h = 8, 6, 4, 5
    smallest = ic + 12 + w * ic + w
    whole = oc * ic + oc * 12 + h * w * ic + h * w * oc
    exact = dataclasses.replace(BASE, name="exact", sram_bytes=smallest, sram_align=1)
    short = dataclasses.replace(BASE, name="short", sram_bytes=smallest - 1, sram_align=1)
    (conv,) = [o for o in npu_backend.partition_report(npu_backend.partition_for_npu(idiom.module(), exact)).ops
               if o.op == "relax.nn.conv2d"]
    assert conv.target == "npu"
    (conv,) = [o for o in npu_backend.partition_report(npu_backend.partition_for_npu(idiom.module(), short)).ops
               if o.op == "relax.nn.conv2d"]
    assert conv.target == "host" and "cannot be tiled" in conv.reason
    params = decode_composite(_conv_attrs(npu_backend.partition_for_npu(idiom.module())))
    one_tile = plan_layer(params, dataclasses.replace(BASE, name="whole", sram_bytes=whole, sram_align=1))
    assert (one_tile.channel_tile, one_tile.row_tile, one_tile.sram_used) == (oc, h, whole)
    split = plan_layer(params, dataclasses.replace(BASE, name="whole-1", sram_bytes=whole - 1, sram_align=1))
    assert (split.channel_tile, split.row_tile) != (oc, h) and split.sram_used <= whole - 1


def _conv_attrs(mod):
    for func in mod.functions.values():
        if func.attrs is not None and func.attrs.get("Codegen") == "npu":
            for block in func.body.blocks:
                for binding in block.bindings:
                    if isinstance(binding.value, relax.Function):
                        return binding.value.attrs
    raise AssertionError("no composite")


@pytest.mark.parametrize("max_kernel, offloaded", [(3, True), (2, False)])
def test_kernel_limit_comes_from_the_configuration(max_kernel, offloaded):
    config = dataclasses.replace(BASE, name=f"k{max_kernel}", max_kernel=max_kernel)
    report = npu_backend.partition_report(npu_backend.partition_for_npu(ConvIdiom().module(), config))
    (conv,) = [o for o in report.ops if o.op == "relax.nn.conv2d"]
    assert (conv.target == "npu") == offloaded
    if not offloaded:
        assert conv.reason.startswith(f"npu.conv2d: kernel 3x3 exceeds the NPU maximum of {max_kernel};")


def test_a_look_up_table_of_another_size_keeps_int8_activations_on_the_host():
    config = dataclasses.replace(BASE, name="lut512", lut_entries=512)
    report = npu_backend.partition_report(npu_backend.partition_for_npu(activation_module(), config))
    (sigmoid,) = [o for o in report.ops if o.op == "relax.sigmoid"]
    assert sigmoid.target == "host"
    assert sigmoid.reason == "npu.sigmoid: an int8 table needs 256 entries; lut512's look-up table has 512"
