"""Before/Expected structural tests of ``partition_for_npu``: the whole partitioned module, compared with
``tvm.ir.assert_structural_equal`` (attribute types included: ``int`` vs ``IntImm``, float32 vs float64 ``FloatImm``
and tensor contents all count).

Every Expected is written by hand from its Before module, in the form TVM's own MergeCompositeFunctions tests use:
``main`` calls a region function (``Codegen="npu"``) whose body binds each composite as a local function
(``Composite`` only: MergeCompositeFunctions drops ``Primitive``) and calls it. Only the region's content-hash
``global_symbol`` and its ``npu.config`` JSON are copied from the result; both are checked separately.
"""

import re

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import npu_backend
from npu_backend.partition import _RenameGlobals
from npu_backend.report import REPORT_ATTR, OpPlacement, PartitionReport
from relax_idioms import ConvIdiom, f32, i32

# One TFLite CONV_2D (per-channel int8, bias, fused ReLU with output zero point 5 -> clip(5, 127)) whose constants are
# written out, so every attribute below can be derived from them by hand. Kernel (KH, KW) = (2, 1) and padding
# (top, left, bottom, right) = (1, 0, 0, 0) are asymmetric so that any axis swap shows.
X_SHAPE = (1, 4, 4, 2)  # output (1, 4, 4, 3): H = 4 + 1 + 0 - 2 + 1, W = 4 + 0 + 0 - 1 + 1
W_HWIO = np.arange(-6, 6, dtype=np.int8).reshape(2, 1, 2, 3)  # W[kh, 0, ic, oc] = 6 kh + 3 ic + oc - 6
W_SCALES = np.array([0.002, 0.004, 0.003], np.float32)
BIAS = np.array([100, -200, 300], np.int32)
BIAS_SCALES = np.float32(0.0078125) * W_SCALES  # s_in * s_w: the accumulator domain (exact: s_in = 2**-7)
# The region's name is its content hash (global_symbol), which an Expected module cannot spell: it names the
# region "region" and named() gives it the result's symbol, as the partitioner does (GlobalVar name == symbol).
CONV_OPS = ["relax.dequantize", "relax.dequantize", "relax.nn.conv2d", "relax.dequantize", "relax.add",
            "relax.quantize", "relax.clip"]


def conv_idiom() -> ConvIdiom:
    idiom = ConvIdiom(x_shape=X_SHAPE, out_channels=3, kernel=(2, 1), padding=(1, 0, 0, 0), clip=(5, 127),
                      input_scale=0.0078125, input_zero_point=-3, output_scale=0.05, output_zero_point=5)
    idiom.weights, idiom.weight_scales, idiom.bias_values = W_HWIO, W_SCALES, BIAS
    return idiom


def float32_imm(value: float):
    """A float32 scale as the partitioner must store it: rounded to float32 first. (``T.float32(0.05)`` alone keeps
    the double 0.05 inside a float32-typed FloatImm and would not equal the float32 scale the graph holds.)"""
    return T.float32(float(np.float32(value)))


def expected_conv_composite(source_vars: list[str]):
    """npu.conv2d: the original dequantize/conv2d/add/quantize/clip chain, untouched, with every qparam derived by
    hand from the constants above."""
    attrs = {
        "Composite": "npu.conv2d",
        "npu.op": "CONV2D",
        "npu.ifm_shape": [1, 4, 4, 2],
        "npu.ofm_shape": [1, 4, 4, 3],
        "npu.input_scale": float32_imm(0.0078125),
        "npu.input_zero_point": -3,
        "npu.weight_scales": tvm.runtime.tensor(np.array([0.002, 0.004, 0.003], np.float32)),
        "npu.weight_zero_points": tvm.runtime.tensor(np.array([0, 0, 0], np.int32)),
        "npu.per_channel": T.bool(True),
        # HWIO [2, 1, 2, 3] -> [OC, KH, KW, IC] = [3, 2, 1, 2]: out[oc][kh][0][ic] = W[kh, 0, ic, oc]
        "npu.weights": tvm.runtime.tensor(np.array([[[[-6, -3]], [[0, 3]]],
                                                    [[[-5, -2]], [[1, 4]]],
                                                    [[[-4, -1]], [[2, 5]]]], np.int8)),
        "npu.bias": tvm.runtime.tensor(np.array([100, -200, 300], np.int32)),  # already in s_in * s_w
        "npu.output_scale": float32_imm(0.05),
        "npu.output_zero_point": 5,
        "npu.clamp": [5, 127],  # clip(5.0, 127.0) on the int8 output
        "npu.kernel": [2, 1],
        "npu.strides": [1, 1],
        "npu.dilation": [1, 1],
        "npu.padding": [1, 0, 0, 0],
        "npu.rounding": "TFLITE_DOUBLE",  # a hand-built module: TFLite's reference, double rounding
        "npu.weight_axis": 0,
        "npu.activation_type": "INT8",
        "npu.source_vars": source_vars,
        "npu.operands": [0],  # the composite's one parameter is its input; the weights are bound constants
    }

    @R.function(private=True)
    def composite(x: R.Tensor((1, 4, 4, 2), "int8")) -> R.Tensor((1, 4, 4, 3), "int8"):
        R.func_attr(attrs)
        with R.dataflow():
            x_dq = R.dequantize(x, R.const(0.0078125, "float32"), R.const(-3, "int32"), axis=0)
            w_dq = R.dequantize(R.const(W_HWIO), R.const(W_SCALES), R.const(np.zeros(3, np.int32)), axis=3)
            conv = R.nn.conv2d(x_dq, w_dq, strides=[1, 1], padding=[1, 0, 0, 0], dilation=[1, 1],
                               data_layout="NHWC", kernel_layout="HWIO")
            b_dq = R.dequantize(R.const(BIAS), R.const(BIAS_SCALES), R.const(0, "int32"), axis=0)
            acc = R.add(conv, b_dq)
            q = R.quantize(acc, R.const(0.05, "float32"), R.const(5, "int32"), axis=0, out_dtype="int8")
            out = R.clip(q, 5.0, 127.0)
            R.output(out)
        return out

    return composite


def named(expected: tvm.IRModule, symbol: str) -> tvm.IRModule:
    """``expected`` with its function "region" renamed ``symbol`` (callers included)."""
    old = expected.get_global_var("region")
    new = relax.GlobalVar(symbol)
    relax.expr._update_type(new, old.ty)
    out = tvm.IRModule({})
    for gvar, func in expected.functions_items():
        out[new if gvar.same_as(old) else gvar] = _RenameGlobals({old: new}, expected).visit_expr(func)
    relax.analysis.well_formed(out)
    return out


def region_attrs(partitioned: tvm.IRModule) -> tuple[str, str]:
    """(global_symbol, npu.config) of the one region, copied from the result, each checked on its own."""
    (symbol, config), = [(str(f.attrs["global_symbol"]), str(f.attrs["npu.config"]))
                         for f in partitioned.functions.values() if f.attrs and f.attrs.get("Codegen") == "npu"]
    assert re.fullmatch(r"npu_npu_256_[0-9a-f]{16}", symbol)
    assert config == npu_backend.get_config("npu-256").to_json()
    return symbol, config


def test_single_qdq_conv2d_becomes_one_region_with_one_annotated_composite():
    """A per-channel QDQ conv2d with bias and fused ReLU: main calls one NPU region holding exactly one npu.conv2d
    composite, whose body is the original chain and whose npu.* attributes are the hand-derived qparams (weights
    transposed to [OC, KH, KW, IC], clamp from the clip bounds, scales as float32, absorbed binding names)."""
    before = conv_idiom().module()
    partitioned = npu_backend.partition_for_npu(before)
    symbol, config = region_attrs(partitioned)
    # BlockBuilder names the Before's bindings lv, lv1, ..., lv5 and the emitted output gv
    composite = expected_conv_composite(["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "gv"])

    @I.ir_module(check_well_formed=False)  # "region" becomes the symbol in named(), which is checked
    class Expected:
        @R.function
        def region(
                x: R.Tensor((1, 4, 4, 2), "int8")) -> R.Tensor((1, 4, 4, 3), "int8"):
            R.func_attr({"Codegen": "npu", "global_symbol": symbol, "npu.config": config})
            conv = composite
            out = conv(x)
            return out

        @R.function
        def main(x: R.Tensor((1, 4, 4, 2), "int8")) -> R.Tensor((1, 4, 4, 3), "int8"):
            cls = Expected
            with R.dataflow():
                gv = cls.region(x)
                R.output(gv)
            return gv

    relax.analysis.well_formed(partitioned)  # raises unless every GlobalVar is named as its symbol
    tvm.ir.assert_structural_equal(partitioned.without_attr(REPORT_ATTR), named(Expected, symbol))
    report = npu_backend.partition_report(partitioned)
    names = ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "gv"]
    assert report == PartitionReport("npu-256", tuple(
        OpPlacement(name, op, "npu", composite="npu.conv2d", region=symbol) for name, op in zip(names, CONV_OPS)),
        "tflite", "detected: every zero point is int32, as TVM's TFLite importer writes them")


def test_conv2d_then_softmax_over_a_non_last_axis_leaves_the_softmax_in_main():
    """conv2d -> dequantize -> softmax(axis=1) -> quantize: the conv becomes the same region function as alone (only
    npu.source_vars differ); the softmax (the NPU's softmax unit runs only over the last axis) and the
    dequantize/quantize around it stay in main exactly as written, and the report says why for each of the three."""
    idiom = conv_idiom()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(X_SHAPE, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(idiom._body(bb, x, relax.const(idiom.weights)))
            y_dq = bb.emit(relax.op.dequantize(y, f32(0.05), i32(5), axis=0))
            soft = bb.emit(relax.op.nn.softmax(y_dq, axis=1))
            gv = bb.emit_output(relax.op.quantize(soft, f32(1 / 256), i32(-128), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    partitioned = npu_backend.partition_for_npu(bb.get())
    symbol, config = region_attrs(partitioned)
    # the conv's clip is now lv6 (no longer the function's output); lv7, lv8 and gv are the host's
    composite = expected_conv_composite(["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6"])

    @I.ir_module(check_well_formed=False)  # "region" becomes the symbol in named(), which is checked
    class Expected:
        @R.function
        def region(
                x: R.Tensor((1, 4, 4, 2), "int8")) -> R.Tensor((1, 4, 4, 3), "int8"):
            R.func_attr({"Codegen": "npu", "global_symbol": symbol, "npu.config": config})
            conv = composite
            out = conv(x)
            return out

        @R.function
        def main(x: R.Tensor((1, 4, 4, 2), "int8")) -> R.Tensor((1, 4, 4, 3), "int8"):
            cls = Expected
            with R.dataflow():
                y = cls.region(x)
                y_dq = R.dequantize(y, R.const(0.05, "float32"), R.const(5, "int32"), axis=0)
                soft = R.nn.softmax(y_dq, axis=1)
                gv = R.quantize(soft, R.const(0.00390625, "float32"), R.const(-128, "int32"), axis=0,
                                out_dtype="int8")
                R.output(gv)
            return gv

    relax.analysis.well_formed(partitioned)  # raises unless every GlobalVar is named as its symbol
    tvm.ir.assert_structural_equal(partitioned.without_attr(REPORT_ATTR), named(Expected, symbol))
    report = npu_backend.partition_report(partitioned)
    assert [(o.var, o.op) for o in report.npu_ops] == list(zip(["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6"],
                                                               CONV_OPS))
    assert {o.region for o in report.npu_ops} == {symbol}
    assert [(o.var, o.op, o.reason) for o in report.host_ops] == [
        ("lv7", "relax.dequantize",
         "int8 to float dequantization (e.g. to a float model output): the NPU computes only on int8"),
        ("lv8", "relax.nn.softmax", "npu.softmax: softmax over axis 1 is not over the last axis"),
        ("gv", "relax.quantize",
         "float to int8 quantization (e.g. of a float model input): the NPU computes only on int8"),
    ]
