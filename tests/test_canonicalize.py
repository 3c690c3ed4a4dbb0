"""Canonicalization: other idioms of the same operator become the form the pattern table matches."""

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from npu_backend.canonicalize import canonicalize
from npu_backend.qparams import TensorQParams, infer_qparams
from relax_idioms import ConvIdiom, integer_conv_module, integer_mean_module
from test_patterns import composites


def test_qparams_flow_forward_backward_and_through_transparent_ops():
    """Forward from quantize, backward from dequantize, both ways through int8 reshape and clip."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((1, 8), "float32"))
    b = relax.Var("b", relax.TensorType((2, 4), "int8"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            qa = bb.emit(relax.op.quantize(a, relax.const(np.float32(0.5)), relax.const(np.int32(3)), axis=0,
                                           out_dtype="int8"))
            clipped = bb.emit(relax.op.clip(qa, 0.0, 127.0))
            flat_b = bb.emit(relax.op.reshape(b, (1, 8)))
            dq = bb.emit(relax.op.dequantize(flat_b, relax.const(np.float32(0.25)), relax.const(np.int32(-1)),
                                             axis=0))
            gv = bb.emit_output(relax.op.add(relax.op.dequantize(clipped, relax.const(np.float32(0.5)),
                                                                 relax.const(np.int32(3)), axis=0), dq))
        bb.emit_func_output(gv)
    known = {v.name: qp for v, qp in infer_qparams(bb.get()["main"]).items()}
    assert known == {"lv": TensorQParams(0.5, 3), "lv1": TensorQParams(0.5, 3),
                     "b": TensorQParams(0.25, -1), "lv2": TensorQParams(0.25, -1)}


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("centred", [True, False])
def test_integer_domain_conv_becomes_the_canonical_composite(per_channel, centred):
    idiom = ConvIdiom(per_channel=per_channel, input_zero_point=-3 if centred else 0, clip=(-128, 100))
    integer = npu_backend.partition_for_npu(integer_conv_module(idiom, centred=centred))
    (name, p), = composites(integer)
    assert name == "npu.conv2d" and p.per_channel == per_channel
    assert p.input_scale == np.float32(idiom.input_scale)        # from the producer, via dataflow
    assert p.input_zero_point == idiom.input_zero_point
    recovered = (np.float32(idiom.input_scale) * idiom.weight_scales).astype(np.float64) / np.float32(idiom.input_scale)
    np.testing.assert_array_equal(p.weight_scales, np.broadcast_to(recovered.astype(np.float32), (6,)))
    np.testing.assert_allclose(p.weight_scales, np.broadcast_to(idiom.weight_scales, (6,)), rtol=2**-23)
    np.testing.assert_array_equal(p.weights, np.transpose(idiom.weights, (3, 0, 1, 2)))
    np.testing.assert_array_equal(p.bias, idiom.bias_values)
    assert (p.output_scale, p.output_zero_point, p.clamp) == (np.float32(0.05), 5, (-128, 100))
    report = npu_backend.partition_report(integer)
    assert [o.op for o in report.host_ops] == ["relax.quantize"]  # only the float -> int8 model input


def test_integer_domain_conv_without_known_input_scale_stays_on_host():
    """No quantize or dequantize tells the input's scale: nothing to recover s_w from."""
    idiom = ConvIdiom()
    mod = integer_conv_module(idiom)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(idiom.x_shape, "int8"))
    main = mod["main"]
    with bb.function("main", [x]):
        with bb.dataflow():
            # the same integer graph, fed straight from an int8 parameter with no qparams anywhere
            binds = {main.params[0]: None}
            out = None
            for block in main.body.blocks:
                for b in block.bindings:
                    if b.value.op.name == "relax.quantize" and b.value.args[0].same_as(main.params[0]):
                        binds[b.var] = x
                        continue
                    value = relax.Call(b.value.op, [binds.get(a, a) for a in b.value.args], b.value.attrs)
                    binds[b.var] = out = bb.emit(value)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    before = bb.get()
    tvm.ir.assert_structural_equal(canonicalize(before), before)
    assert composites(npu_backend.partition_for_npu(before)) == []


def test_canonicalize_leaves_the_input_module_untouched():
    mod = integer_conv_module(ConvIdiom())
    text = mod.script()
    canonicalize(mod)
    assert mod.script() == text


@pytest.mark.parametrize("keepdims", [True, False])
def test_integer_mean_becomes_the_canonical_mean_and_matches_tflite(keepdims):
    """astype(int32) -> mean -> requantize: TVM would truncate the int32 mean before requantizing;
    the canonical composite computes TFLite's MEAN (sum, one requantization) instead."""
    import reference_kernels as ref

    mod = npu_backend.partition_for_npu(integer_mean_module(keepdims=keepdims))
    (name, p), = composites(mod)
    assert name == "npu.mean"
    assert (p.input_scale, p.input_zero_point) == (np.float32(0.02), -7)
    assert (p.output_scale, p.output_zero_point) == (np.float32(0.015), 3)
    assert p.ifm_shape == (1, 5, 5, 16) and not npu_backend.partition_report(mod).host_ops
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    x = np.random.default_rng(1).integers(-128, 128, (1, 5, 5, 16), dtype=np.int8)
    want = np.array(ref.mean_hw(x[0].astype(int).tolist(), float(np.float32(0.02)), -7, float(np.float32(0.015)), 3))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy().reshape(-1), want.reshape(-1))


def test_integer_mean_of_a_non_int8_tensor_is_left_alone():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.mean(relax.op.astype(x, "int32"), axis=[1, 2]))
            real = bb.emit(relax.op.dequantize(m, relax.const(np.float32(0.1)), relax.const(np.int32(0)), axis=0))
            gv = bb.emit_output(relax.op.quantize(real, relax.const(np.float32(0.1)), relax.const(np.int32(0)),
                                                  axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    before = bb.get()
    tvm.ir.assert_structural_equal(canonicalize(before), before)


def _residual_module(activation=None):
    """y = conv-free residual: add(dequantize(a), dequantize(b)) where b's dequantize also feeds a second add,
    and the first operand's dequantize is bound *after* the second's (composite parameters then come in the
    opposite order of the operands)."""
    from relax_idioms import f32, i32

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((1, 4, 4, 8), "int8"))
    b = relax.Var("b", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            db = bb.emit(relax.op.dequantize(b, f32(0.02), i32(7), axis=0))
            da = bb.emit(relax.op.dequantize(a, f32(0.05), i32(-3), axis=0))
            s = bb.emit(relax.op.add(da, db))
            if activation is not None:
                s = bb.emit(activation(s))
            q1 = bb.emit(relax.op.quantize(s, f32(0.06), i32(-10), axis=0, out_dtype="int8"))
            s2 = bb.emit(relax.op.add(db, relax.op.dequantize(q1, f32(0.06), i32(-10), axis=0)))
            gv = bb.emit_output(relax.op.quantize(s2, f32(0.07), i32(2), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def _tflite_add(x1, q1, x2, q2, q_out, clamp=(-128, 127)):
    import reference_kernels as ref

    out = [ref.add([int(u)], [int(v)], float(np.float32(q1[0])), q1[1], float(np.float32(q2[0])), q2[1],
                   float(np.float32(q_out[0])), q_out[1], clamp)[0] for u, v in zip(x1.ravel(), x2.ravel())]
    return np.array(out, dtype=np.int8).reshape(x1.shape)


@pytest.mark.parametrize("activation, clamp", [(None, (-128, 127)), (relax.op.nn.relu, (-10, 127))])
def test_shared_dequantize_and_operand_order_and_float_relu(activation, clamp):
    """A dequantize shared by two adds is duplicated, each add reads its operands in role order (not the
    order of its composite's parameters), and a float relu before the quantize becomes the clamp [z, 127]."""
    mod = npu_backend.partition_for_npu(_residual_module(activation))
    found = composites(mod)
    assert [name for name, _ in found] == ["npu.add", "npu.add"] and not npu_backend.partition_report(mod).host_ops
    first = found[0][1]
    assert (first.input_scale, first.input_zero_point, first.input2_scale, first.input2_zero_point) == (
        np.float32(0.05), -3, np.float32(0.02), 7)
    assert first.clamp == clamp
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    rng = np.random.default_rng(5)
    a, b = (rng.integers(-128, 128, (1, 4, 4, 8), dtype=np.int8) for _ in range(2))
    q1 = _tflite_add(a, (0.05, -3), b, (0.02, 7), (0.06, -10), clamp)
    want = _tflite_add(b, (0.02, 7), q1, (0.06, -10), (0.07, 2))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy(), want)


def test_float_relu6_becomes_the_clamp_of_its_quantized_bounds():
    from relax_idioms import add_module

    base = add_module(q_out=(0.05, 1))
    func = base["main"]
    # rebuild with a float clip(0, 6) between the add and the quantize
    bb = relax.BlockBuilder()
    a, b = func.params
    with bb.function("main", [a, b]):
        with bb.dataflow():
            da = bb.emit(relax.op.dequantize(a, relax.const(np.float32(0.03)), relax.const(np.int32(-5)), axis=0))
            db = bb.emit(relax.op.dequantize(b, relax.const(np.float32(0.02)), relax.const(np.int32(7)), axis=0))
            s = bb.emit(relax.op.clip(relax.op.add(da, db), 0.0, 6.0))
            gv = bb.emit_output(relax.op.quantize(s, relax.const(np.float32(0.05)), relax.const(np.int32(1)), axis=0,
                                                  out_dtype="int8"))
        bb.emit_func_output(gv)
    (name, p), = composites(npu_backend.partition_for_npu(bb.get()))
    assert name == "npu.add" and p.clamp == (1, 121)  # z = 1; 6 / 0.05 = 120, + 1


@pytest.mark.parametrize("per_channel", [True, False])
def test_integer_domain_matmul_becomes_the_canonical_fully_connected(per_channel):
    from relax_idioms import integer_fc_module

    idiom = ConvIdiom(op="fc", x_shape=(1, 24), out_channels=10, per_channel=per_channel, clip=None)
    mod = npu_backend.partition_for_npu(integer_fc_module(idiom))
    (name, p), = composites(mod)
    assert name == "npu.fully_connected" and p.per_channel == per_channel
    assert (p.input_scale, p.input_zero_point) == (np.float32(idiom.input_scale), idiom.input_zero_point)
    np.testing.assert_allclose(p.weight_scales, np.broadcast_to(idiom.weight_scales, (10,)), rtol=2**-23)
    np.testing.assert_array_equal(p.weights, idiom.weights)  # [OC, IC], from the [IC, OC] int32 matmul
    np.testing.assert_array_equal(p.bias, idiom.bias_values)
    assert (p.output_scale, p.output_zero_point) == (np.float32(0.05), 5)
    assert [o.op for o in npu_backend.partition_report(mod).host_ops] == ["relax.quantize"]


def test_transparent_composites_carry_the_qparams_the_dataflow_analysis_finds():
    """int8 max pool -> pad -> reshape between a quantize and a dequantize: none states qparams itself; each
    composite carries the (scale, zero point) of its tensor, found forwards from the quantize."""
    from relax_idioms import f32, i32
    from test_patterns import composite_attrs

    bb = relax.BlockBuilder()
    real = relax.Var("real", relax.TensorType((1, 8, 8, 4), "float32"))
    with bb.function("main", [real]):
        with bb.dataflow():
            q = bb.emit(relax.op.quantize(real, f32(0.125), i32(-3), axis=0, out_dtype="int8"))
            pooled = bb.emit(relax.op.nn.max_pool2d(q, pool_size=(2, 2), strides=(2, 2), layout="NHWC"))
            padded = bb.emit(relax.op.nn.pad(pooled, [0, 0, 1, 1, 1, 1, 0, 0], pad_value=-3.0))
            flat = bb.emit(relax.op.reshape(padded, (1, 144)))
            gv = bb.emit_output(relax.op.dequantize(flat, f32(0.125), i32(-3), axis=0))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get())
    found = {name: (float(attrs["npu.input_scale"].value), int(attrs["npu.input_zero_point"]),
                    float(attrs["npu.output_scale"].value), int(attrs["npu.output_zero_point"]))
             for name, attrs in composite_attrs(mod)}
    assert found == {name: (0.125, -3, 0.125, -3) for name in ("npu.max_pool2d", "npu.pad", "npu.reshape")}
    (pool,) = [p for name, p in composites(mod) if name == "npu.max_pool2d"]
    assert (pool.input_scale, pool.output_zero_point) == (0.125, -3)  # the record itself holds them


@pytest.mark.parametrize("op, per_channel", [("conv2d", True), ("conv2d", False), ("fc", True)])
def test_fixed_point_requantize_chain_runs_exactly_what_it_says(op, per_channel):
    """The integer conv requantized by an explicit multiply / rounding shift / clip chain: one npu.conv2d with
    s_in and s_w recovered separately, single rounding, and outputs equal to TVM executing the chain itself
    (integer arithmetic, exact on the CPU)."""
    from relax_idioms import fixed_point_conv_module

    shape = (1, 24) if op == "fc" else (1, 8, 8, 4)
    idiom = ConvIdiom(op=op, x_shape=shape, per_channel=per_channel, clip=(-20, 127), seed=4)
    module = fixed_point_conv_module(idiom)
    mod = npu_backend.partition_for_npu(module)
    (name, p), = composites(mod)
    assert name == {"conv2d": "npu.conv2d", "fc": "npu.fully_connected"}[op]
    assert p.rounding.name == "TFLITE_SINGLE" and p.per_channel == per_channel
    assert (p.input_scale, p.input_zero_point) == (np.float32(idiom.input_scale), idiom.input_zero_point)
    np.testing.assert_array_equal(p.weight_scales, np.broadcast_to(idiom.weight_scales, (6,)))  # exactly
    assert (p.output_scale, p.output_zero_point, p.clamp) == (np.float32(0.05), 5, (-20, 127))
    assert [o.op for o in npu_backend.partition_report(mod).host_ops] == ["relax.quantize", "relax.dequantize"]
    npu = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    host = relax.VirtualMachine(tvm.compile(module, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(7)
    for _ in range(3):
        real = rng.uniform(-1.2, 1.2, idiom.x_shape).astype(np.float32)
        x = tvm.runtime.tensor(real)
        np.testing.assert_array_equal(npu["main"](x).numpy(), host["main"](x).numpy())


def test_fixed_point_chain_whose_multipliers_no_scales_produce_stays_on_host():
    from relax_idioms import fixed_point_conv_module

    idiom = ConvIdiom(seed=4)
    module = fixed_point_conv_module(idiom, multipliers=np.full(6, (1 << 30) + 12345), shifts=np.full(6, -9))
    report = npu_backend.partition_report(npu_backend.partition_for_npu(module))
    (conv,) = [o for o in report.ops if o.op == "relax.nn.conv2d"]
    assert conv.target == "host" and "multipliers are not those of any float32 weight scales" in conv.reason


def test_a_function_no_rewrite_changes_still_loses_its_dead_bindings():
    """The dead-binding clean-up runs whether or not a rewrite matched: the partition report lists only the
    operators that run."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            bb.emit(relax.op.multiply(x, x), name_hint="dead")
            out = bb.emit_output(relax.op.nn.relu(x))
        bb.emit_func_output(out)
    func = canonicalize(bb.get())["main"]
    ops = [b.value.op.name for block in func.body.blocks for b in block.bindings]
    assert ops == ["relax.nn.relu"]
