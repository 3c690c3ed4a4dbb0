"""The npu pattern table: what matches, the exact qparams extracted, and what must not match."""

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from npu_backend.ops import decode_composite
from npu_backend.params import NpuOp
from npu_backend.patterns import PREFIX, registered_patterns
from relax_idioms import ConvIdiom, activation_module


def composite_attrs(mod):
    """[(composite name, its attributes)] of every NPU composite, in region order."""
    found = []
    for func in mod.functions.values():
        if func.attrs is not None and func.attrs.get("Codegen") == PREFIX:
            for block in func.body.blocks:
                for binding in block.bindings:
                    if isinstance(binding.value, relax.Function):
                        found.append((str(binding.value.attrs["Composite"]), binding.value.attrs))
    return found


def composites(mod):
    """[(composite name, its params record)] of every NPU composite, in region order."""
    return [(name, decode_composite(attrs)) for name, attrs in composite_attrs(mod)]


def partition(idiom: ConvIdiom):
    mod = npu_backend.partition_for_npu(idiom.module())
    return mod, composites(mod), npu_backend.partition_report(mod)


def test_registry_order_puts_fused_activation_first():
    entries = registered_patterns()
    names = [e.name for e in entries]
    pools = ["npu.max_pool2d"] * 2 + ["npu.avg_pool2d"] * 2  # each: the QDQ form, then the bare int8 form
    clipped = ["npu.conv2d", "npu.depthwise_conv2d", "npu.fully_connected", "npu.add", "npu.subtract",
               "npu.multiply", *pools]
    n = len(clipped)
    # unclipped: an operator's idioms in its definition's order (the fixed-point chain before the QDQ form)
    assert names == clipped + ["npu.conv2d", "npu.conv2d", "npu.depthwise_conv2d", "npu.fully_connected",
                               "npu.fully_connected", "npu.batch_matmul", "npu.add", "npu.subtract", "npu.multiply",
                               "npu.mean",
                               *pools] + [
        "npu.reshape", "npu.sigmoid", "npu.tanh", "npu.exp", "npu.gelu", "npu.gelu_tanh",
        "npu.hard_swish", "npu.leaky_relu", "npu.elu", "npu.requantize",
        "npu.softmax", "npu.transpose", "npu.strided_slice", "npu.pad", "npu.resize_nearest",
        "npu.resize_bilinear"] + ["npu.concat"] * 5
    root_op = lambda e: str(e.pattern).split('name="', 1)[1].split('"', 1)[0]  # noqa: E731
    assert {root_op(e) for e in entries[:n]} == {"relax.clip"}
    assert "relax.clip" not in {root_op(e) for e in entries[n:]}


def test_conv2d_per_channel_with_relu_clip():
    idiom = ConvIdiom(op="conv2d", strides=(2, 2), padding=(0, 0, 1, 1), clip=(5, 127))
    mod, found, report = partition(idiom)
    assert [name for name, _ in found] == ["npu.conv2d"]
    p = found[0][1]
    assert p.op == NpuOp.CONV2D
    assert p.input_scale == np.float32(idiom.input_scale) and p.input_zero_point == -3
    assert p.output_scale == np.float32(0.05) and p.output_zero_point == 5
    assert p.per_channel and p.weight_axis == 0
    np.testing.assert_array_equal(p.weight_scales, idiom.weight_scales)  # exact float32
    np.testing.assert_array_equal(p.weight_zero_points, 0)
    np.testing.assert_array_equal(p.weights, np.transpose(idiom.weights, (3, 0, 1, 2)))
    np.testing.assert_array_equal(p.bias, idiom.bias_values)
    assert p.clamp == (5, 127)
    assert (p.kernel, p.strides, p.dilation, p.padding) == ((3, 3), (2, 2), (1, 1), (0, 0, 1, 1))
    assert p.ifm_shape == (1, 8, 8, 4) and p.ofm_shape == (1, 4, 4, 6)
    assert not report.host_ops


def test_conv2d_per_tensor_without_bias_or_clip():
    idiom = ConvIdiom(per_channel=False, bias=False, clip=None)
    _, found, _ = partition(idiom)
    (name, p), = found
    assert name == "npu.conv2d" and not p.per_channel
    np.testing.assert_array_equal(p.weight_scales, np.full(6, idiom.weight_scales[0]))
    np.testing.assert_array_equal(p.bias, np.zeros(6))
    assert p.clamp == (-128, 127)


def test_depthwise_per_channel_behind_reshape():
    idiom = ConvIdiom(op="depthwise", x_shape=(1, 8, 8, 5), clip=(-128, 90))
    _, found, _ = partition(idiom)
    (name, p), = found
    assert name == "npu.depthwise_conv2d" and p.per_channel
    np.testing.assert_array_equal(p.weights, np.transpose(idiom.weights[0], (2, 0, 1)))
    np.testing.assert_array_equal(p.weight_scales, idiom.weight_scales)
    assert p.clamp == (-128, 90) and p.ofm_shape == (1, 8, 8, 5)


def test_depthwise_per_tensor():
    idiom = ConvIdiom(op="depthwise", per_channel=False)
    _, found, _ = partition(idiom)
    (name, p), = found
    assert name == "npu.depthwise_conv2d" and not p.per_channel


def test_fully_connected_behind_permute_dims():
    idiom = ConvIdiom(op="fc", x_shape=(2, 16), out_channels=7, per_channel=False, clip=None)
    _, found, _ = partition(idiom)
    (name, p), = found
    assert name == "npu.fully_connected"
    np.testing.assert_array_equal(p.weights, idiom.weights)  # already [OC, IC]
    assert p.ifm_shape == (2, 16) and p.ofm_shape == (2, 7) and not p.per_channel


def test_float_conv2d_does_not_match():
    mod, found, report = partition(ConvIdiom(float_graph=True))
    assert found == []
    assert {(o.op, o.reason) for o in report.host_ops} == {
        ("relax.nn.conv2d", "no NPU pattern covers this operator"),
        ("relax.nn.relu", "no NPU pattern covers this operator")}


def test_weights_that_are_not_constants_do_not_match():
    mod, found, report = partition(ConvIdiom(weight_is_param=True))
    assert found == []
    assert report.npu_ops == []


@pytest.mark.parametrize("field, ok, bad, reason", [
    ("kernel", (8, 8), (9, 9), "kernel 9x9 exceeds the NPU maximum of 8"),
    ("strides", (3, 3), (4, 4), "stride (4, 4) exceeds the NPU maximum of 3"),
])
def test_hardware_limits_at_and_past_the_edge(field, ok, bad, reason):
    base = dict(x_shape=(1, 20, 20, 2), padding=(0, 0, 0, 0))
    _, found, _ = partition(ConvIdiom(**base, **{field: ok}))
    assert [name for name, _ in found] == ["npu.conv2d"]
    _, found, report = partition(ConvIdiom(**base, **{field: bad}))
    assert found == []
    conv_rows = [o for o in report.host_ops if o.op == "relax.nn.conv2d"]
    assert len(conv_rows) == 1 and f"npu.conv2d: {reason}" in conv_rows[0].reason


def test_dilation_limit():
    _, found, _ = partition(ConvIdiom(x_shape=(1, 20, 20, 2), dilation=(4, 4), padding=(0, 0, 0, 0)))
    assert len(found) == 1
    _, found, report = partition(ConvIdiom(x_shape=(1, 20, 20, 2), dilation=(5, 5), padding=(0, 0, 0, 0)))
    assert found == [] and "dilation (5, 5) exceeds" in report.host_ops[2].reason


@pytest.mark.parametrize("idiom, reason", [
    (ConvIdiom(bias_scale_factor=1.01), "bias scale is not input_scale * weight_scale"),
    (ConvIdiom(weight_zero_point=3), "weight zero points must be 0"),
])
def test_inconsistent_qparams_stay_on_host_with_reason(idiom, reason):
    _, found, report = partition(idiom)
    assert found == []
    conv = next(o for o in report.host_ops if o.op == "relax.nn.conv2d")
    assert reason in conv.reason


def test_layer_too_large_for_sram_is_rejected():
    idiom = ConvIdiom(x_shape=(1, 4, 2000, 64), out_channels=8, kernel=(1, 1), padding=(0, 0, 0, 0))
    _, found, report = partition(idiom)
    small = npu_backend.partition_for_npu(idiom.module(), preset="npu-tiny")
    assert len(found) == 1
    conv = next(o for o in npu_backend.partition_report(small).host_ops if o.op == "relax.nn.conv2d")
    assert "cannot be tiled" in conv.reason


def test_composites_carry_qparams_that_survive_the_text_round_trip():
    mod, _, _ = partition(ConvIdiom())
    region = next(f for f in mod.functions.values() if f.attrs is not None and f.attrs.get("Codegen") == "npu")
    inner = next(b.value for blk in region.body.blocks for b in blk.bindings if isinstance(b.value, relax.Function))
    keys = set(inner.attrs.keys())
    assert {"npu.input_scale", "npu.input_zero_point", "npu.weight_scales", "npu.weight_axis", "npu.bias",
            "npu.output_scale", "npu.output_zero_point", "npu.clamp", "npu.rounding"} <= keys
    assert str(inner.attrs["npu.rounding"]) == "TFLITE_DOUBLE"


def test_add_with_fused_relu():
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module(clip=(1, 127)))
    (name, p), = composites(mod)
    assert name == "npu.add"
    assert (p.input_scale, p.input_zero_point) == (np.float32(0.03), -5)
    assert (p.input2_scale, p.input2_zero_point) == (np.float32(0.02), 7)
    assert (p.output_scale, p.output_zero_point, p.clamp) == (np.float32(0.05), 1, (1, 127))
    assert p.shape == (1, 6, 6, 8)


@pytest.mark.parametrize("op, name", [(relax.op.subtract, "npu.subtract"), (relax.op.multiply, "npu.multiply")])
def test_subtract_and_multiply_with_fused_relu(op, name):
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module(clip=(-100, 127), op=op))
    (found, p), = composites(mod)
    assert found == name and p.op == NpuOp(name.split(".")[1])
    assert (p.input_scale, p.input_zero_point, p.input2_scale, p.input2_zero_point) == (
        np.float32(0.03), -5, np.float32(0.02), 7)
    assert (p.output_scale, p.output_zero_point, p.clamp) == (np.float32(0.05), 1, (-100, 127))


def test_divide_is_not_an_npu_operator():
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module(op=relax.op.divide))
    assert composites(mod) == []
    divide = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.divide")
    assert divide.reason == "no NPU pattern covers this operator"


def test_broadcasting_add_stays_on_host():
    """Only a per-channel vector broadcasts on the NPU; a [1, 1, 6, 8] operand does not."""
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module(shape2=(1, 1, 6, 8)))
    assert composites(mod) == []
    add = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.add")
    assert "broadcasting add" in add.reason


def test_add_whose_output_scale_cannot_be_reached_stays_on_host():
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module(q1=(1.0, 0), q2=(1.0, 0), q_out=(1e-7, 0)))
    add = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.add")
    assert "output multiplier" in add.reason


def test_global_mean():
    from relax_idioms import mean_module

    mod = npu_backend.partition_for_npu(mean_module())
    (name, p), = composites(mod)
    assert name == "npu.mean" and p.ifm_shape == (1, 5, 5, 16) and p.ofm_shape == (1, 16)
    assert (p.input_zero_point, p.output_zero_point) == (-128, -128)


def test_mean_over_channels_stays_on_host():
    from relax_idioms import mean_module

    mod = npu_backend.partition_for_npu(mean_module(axis=(3,)))
    assert composites(mod) == []
    mean = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.mean")
    assert "axes 1, 2" in mean.reason


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_int8_pooling_idioms(kind):
    from relax_idioms import pool_module

    mod = npu_backend.partition_for_npu(pool_module(kind, pool_size=(3, 3), strides=(2, 2), padding=(0, 0, 1, 1)))
    (name, p), = composites(mod)
    assert name == f"npu.{kind}_pool2d"
    assert (p.kernel, p.strides, p.padding) == ((3, 3), (2, 2), (0, 0, 1, 1))
    assert p.ifm_shape == (1, 9, 9, 8) and p.ofm_shape == (1, 4, 4, 8) and p.clamp == (-128, 127)


def test_float_pooling_and_counted_padding_stay_on_host():
    from relax_idioms import pool_module

    report = npu_backend.partition_report(npu_backend.partition_for_npu(pool_module("max", dtype="float32")))
    assert "not int8" in report.host_ops[0].reason
    report = npu_backend.partition_report(npu_backend.partition_for_npu(
        pool_module("avg", padding=(1, 1, 1, 1), count_include_pad=True)))
    pool = next(o for o in report.host_ops if o.op == "relax.nn.avg_pool2d")
    assert "counts padding" in pool.reason


def test_pool_window_limit():
    from relax_idioms import pool_module

    assert len(composites(npu_backend.partition_for_npu(pool_module("max", shape=(1, 20, 20, 4),
                                                                    pool_size=(16, 16))))) == 1
    mod = npu_backend.partition_for_npu(pool_module("max", shape=(1, 20, 20, 4), pool_size=(17, 17)))
    assert "pool window 17x17 exceeds the NPU maximum of 16" in npu_backend.partition_report(mod).host_ops[0].reason


def test_int8_reshape_joins_its_neighbours_in_one_region():
    """conv -> reshape (Flatten) -> fully connected: one region, and the report names it for every op."""
    idiom = ConvIdiom(x_shape=(1, 4, 4, 3), out_channels=4)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 3), "int8"))
    fc = ConvIdiom(op="fc", x_shape=(1, 64), out_channels=5, clip=None, seed=1)
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(idiom._body(bb, x, relax.const(idiom.weights)))
            flat = bb.emit(relax.op.reshape(y, (1, 64)))
            out = bb.emit_output(fc._body(bb, flat, relax.const(fc.weights)))
        bb.emit_func_output(out)
    partitioned = npu_backend.partition_for_npu(bb.get())
    assert [name for name, _ in composites(partitioned)] == ["npu.conv2d", "npu.reshape", "npu.fully_connected"]
    report = npu_backend.partition_report(partitioned)
    regions = {o.region for o in report.ops}
    assert not report.host_ops and len(regions) == 1 and regions.pop().startswith("npu_npu_256_")
    reshape = next(o for o in report.ops if o.op == "relax.reshape")
    assert reshape.composite == "npu.reshape"


def test_float_reshape_is_not_an_npu_reshape():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.reshape(x, (16,)))
        bb.emit_func_output(out)
    report = npu_backend.partition_report(npu_backend.partition_for_npu(bb.get()))
    assert report.host_ops[0].reason == "npu.reshape: reshape of float32 data is not an int8 tensor move"


@pytest.mark.parametrize("op, name, q_out", [(relax.op.sigmoid, "npu.sigmoid", (1 / 256, -128)),
                                             (relax.op.tanh, "npu.tanh", (1 / 128, 0))])
def test_fake_quantized_activation_becomes_a_table(op, name, q_out):
    from relax_idioms import activation_module

    (found, p), = composites(npu_backend.partition_for_npu(activation_module(op, q_out=q_out)))
    assert found == name and (p.input_scale, p.input_zero_point) == (np.float32(0.05), 3)
    assert (p.output_scale, p.output_zero_point) == (np.float32(q_out[0]), q_out[1])


def test_softmax_over_the_last_axis():
    from relax_idioms import activation_module

    mod = npu_backend.partition_for_npu(activation_module(lambda x: relax.op.nn.softmax(x, axis=-1), shape=(2, 10)))
    (found, p), = composites(mod)
    assert found == "npu.softmax" and p.shape == (2, 10) and p.beta == 1.0
    assert (p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point) == (
        np.float32(0.05), 3, np.float32(1 / 256), -128)


@pytest.mark.parametrize("axis, q_out, reason", [
    (0, (1 / 256, -128), "softmax over axis 0 is not over the last axis"),
    (-1, (1 / 128, 0), "int8 SOFTMAX needs output scale 0.00390625 and zero point -128")])
def test_softmax_the_npu_cannot_run_stays_on_host(axis, q_out, reason):
    from relax_idioms import activation_module

    mod = npu_backend.partition_for_npu(
        activation_module(lambda x: relax.op.nn.softmax(x, axis=axis), shape=(2, 10), q_out=q_out))
    assert composites(mod) == []
    softmax = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.nn.softmax")
    assert reason in softmax.reason


def test_activation_with_other_output_qparams_stays_on_host():
    """TFLite's int8 LOGISTIC is defined only for output scale 1/256 and zero point -128."""
    from relax_idioms import activation_module

    mod = npu_backend.partition_for_npu(activation_module(q_out=(0.01, 0)))
    assert composites(mod) == []
    sigmoid = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.sigmoid")
    assert "int8 SIGMOID needs output scale 0.00390625 and zero point -128" in sigmoid.reason


def test_standalone_requantize_is_a_table_matching_tflite_requantize():
    import reference_kernels as ref
    from npu_backend.ops import op_def

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dq = bb.emit(relax.op.dequantize(x, relax.const(np.float32(0.02)), relax.const(np.int32(-7)), axis=0))
            gv = bb.emit_output(relax.op.quantize(dq, relax.const(np.float32(0.035)), relax.const(np.int32(9)),
                                                  axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    (name, p), = composites(npu_backend.partition_for_npu(bb.get()))
    assert name == "npu.requantize"
    m, s = ref.quantize_multiplier(float(np.float32(0.02)) / float(np.float32(0.035)))
    want = [min(max(ref.multiply_by_quantized_multiplier(v + 7, m, s) + 9, -128), 127) for v in range(-128, 128)]
    assert op_def(p.op).prepare(p).tolist() == want


def _concat_module(qparams, out_q=(0.05, 2), axis=3):
    from relax_idioms import f32, i32

    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType((1, 4, 4, 2 + i), "int8")) for i in range(len(qparams))]
    with bb.function("main", xs):
        with bb.dataflow():
            dqs = [bb.emit(relax.op.dequantize(x, f32(s), i32(z), axis=0)) for x, (s, z) in zip(xs, qparams)]
            cat = bb.emit(relax.op.concat(dqs, axis=axis))
            gv = bb.emit_output(relax.op.quantize(cat, f32(out_q[0]), i32(out_q[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("arity", [2, 3, 6])
def test_concat_of_equal_qparams(arity):
    (name, p), = composites(npu_backend.partition_for_npu(_concat_module([(0.05, 2)] * arity)))
    assert name == "npu.concat" and p.axis == 3 and p.extents == tuple(range(2, 2 + arity))
    assert (p.output_scale, p.output_zero_point) == (np.float32(0.05), 2)


def test_concat_with_differing_qparams_gets_a_requantize_per_input():
    """The canonicalizer gives each input whose qparams differ from the output its own requantize;
    the concat then only moves bytes, and the result equals per-input TFLite requantization."""
    import reference_kernels as ref

    qparams = [(0.05, 2), (0.07, -3), (0.02, 2)]
    mod = npu_backend.partition_for_npu(_concat_module(qparams))
    found = composites(mod)
    assert sorted(name for name, _ in found) == ["npu.concat", "npu.requantize", "npu.requantize"]
    requantized = sorted((p.input_scale, p.input_zero_point) for name, p in found if name == "npu.requantize")
    assert requantized == sorted((float(np.float32(s)), z) for s, z in qparams[1:])
    for name, p in found:
        assert (p.output_scale, p.output_zero_point) == (np.float32(0.05), 2)
    assert not npu_backend.partition_report(mod).host_ops

    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    rng = np.random.default_rng(3)
    xs = [rng.integers(-128, 128, (1, 4, 4, 2 + i), dtype=np.int8) for i in range(3)]
    want = []
    for x, (s, z) in zip(xs, qparams):
        m, shift = ref.quantize_multiplier(float(np.float32(s)) / float(np.float32(0.05)))
        want.append(np.vectorize(lambda v: min(max(ref.multiply_by_quantized_multiplier(int(v) - z, m, shift) + 2,
                                                   -128), 127))(x) if (s, z) != (0.05, 2) else x)
    got = vm["main"](*[tvm.runtime.tensor(x) for x in xs]).numpy()
    np.testing.assert_array_equal(got, np.concatenate(want, axis=3).astype(np.int8))


def test_int8_spatial_pad_runs_on_the_npu_exactly():
    """pad with the zero point: the output equals numpy's pad, tiled into stripes on a small SRAM."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 40, 200, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.nn.pad(x, [0, 0, 1, 2, 3, 0, 0, 0], pad_value=-7.0))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get(), preset="npu-tiny")
    (name, p), = composites(mod)
    assert name == "npu.pad" and p.padding == (1, 3, 2, 0) and p.pad_value == -7
    (stream,) = npu_backend.codegen.lower_module(mod).values()
    assert len(stream.commands) == 3 * 3  # three stripes: fill, interior rows, store
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    data = np.random.default_rng(0).integers(-128, 128, (1, 40, 200, 8), dtype=np.int8)
    want = np.pad(data, ((0, 0), (1, 2), (3, 0), (0, 0)), constant_values=-7)
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(data)).numpy(), want)


def test_leaky_relu_carries_its_slope():
    from relax_idioms import activation_module

    mod = activation_module(lambda x: relax.op.nn.leakyrelu(x, 0.2), q_out=(0.03, -20))
    (name, p), = composites(npu_backend.partition_for_npu(mod))
    assert name == "npu.leaky_relu" and p.alpha == np.float32(0.2)
    assert (p.output_scale, p.output_zero_point) == (np.float32(0.03), -20)


def _hard_swish_module(three=3.0):
    from relax_idioms import f32, i32

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dq = bb.emit(relax.op.dequantize(x, f32(0.04), i32(0), axis=0))
            relu6 = bb.emit(relax.op.clip(bb.emit(relax.op.add(dq, relax.const(np.float32(three)))), 0.0, 6.0))
            hs = bb.emit(relax.op.divide(bb.emit(relax.op.multiply(dq, relu6)), relax.const(np.float32(6.0))))
            gv = bb.emit_output(relax.op.quantize(hs, f32(0.02), i32(-100), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def test_hard_swish_idiom_becomes_a_table():
    (name, p), = composites(npu_backend.partition_for_npu(_hard_swish_module()))
    assert name == "npu.hard_swish" and (p.output_scale, p.output_zero_point) == (np.float32(0.02), -100)


def test_something_else_shaped_like_hard_swish_stays_on_host():
    mod = npu_backend.partition_for_npu(_hard_swish_module(three=2.5))
    assert composites(mod) == []
    div = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.divide")
    assert "not x * relu6(x + 3) / 6" in div.reason


def _add_constant_module(constant, first=False):
    from relax_idioms import f32, i32

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 10), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(0.06), i32(11), axis=0))
            dc = bb.emit(relax.op.dequantize(relax.const(constant), f32(0.005), i32(-24), axis=0))
            s = bb.emit(relax.op.add(dc, dx) if first else relax.op.add(dx, dc))
            gv = bb.emit_output(relax.op.quantize(s, f32(0.058), i32(2), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def test_add_of_a_constant_carries_it_broadcast_and_runs_exactly():
    """ONNX MatMul's bias is a quantized Add of an int8 constant: broadcast into the record, streamed as a
    constant buffer, and the result equals TFLite's ADD of the broadcast tensors."""
    import reference_kernels as ref

    bias = np.arange(-50, 50, 10, dtype=np.int8)
    mod = npu_backend.partition_for_npu(_add_constant_module(bias))
    (name, p), = composites(mod)
    assert name == "npu.add" and p.shape == (1, 10)
    np.testing.assert_array_equal(p.input2_values, bias.reshape(1, 10))
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    x = np.random.default_rng(2).integers(-128, 128, (1, 10), dtype=np.int8)
    f = lambda s: float(np.float32(s))  # noqa: E731
    want = ref.add(x.ravel().tolist(), bias.tolist(), f(0.06), 11, f(0.005), -24, f(0.058), 2, (-128, 127))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy().ravel(), want)


@pytest.mark.parametrize("constant, first, reason", [
    (np.zeros(10, np.int8), True, "an operand is a constant"),
    (np.zeros((2, 10), np.int8), False, "constant [2, 10] does not broadcast to [1, 10]")])
def test_constant_operands_the_npu_cannot_take_stay_on_host(constant, first, reason):
    mod = npu_backend.partition_for_npu(_add_constant_module(constant, first))
    assert composites(mod) == []
    add = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.add")
    assert reason in add.reason


def _strided_slice_module(dtype="int8", strides=(2, 1)):
    """x[:, 1:7:2, :, 2:10] as Relax writes it (the fixture strided_slice.tflite, which TVM's importer refuses)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.strided_slice(x, axes=[1, 3], begin=[1, 2], end=[7, 10], strides=strides))
        bb.emit_func_output(gv)
    return bb.get()


def test_strided_slice_is_a_dma_gather_equal_to_tflite():
    """Same slice as the STRIDED_SLICE fixture: the NPU's output equals BUILTIN_REF's on all 8 stored inputs."""
    from conftest import FIXTURES

    mod = npu_backend.partition_for_npu(_strided_slice_module())
    (name, p), = composites(mod)
    assert name == "npu.strided_slice" and p.begin == (0, 1, 0, 2) and p.strides == (1, 2, 1, 1)
    assert p.ofm_shape == (1, 3, 8, 8)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    golden = np.load(FIXTURES / "tflite" / "strided_slice.npz")
    assert golden["input_scale"] == golden["output_scale"]  # qparam-transparent in TFLite too
    for x, want in zip(golden["inputs"], golden["outputs"]):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)


def test_strided_slice_with_channel_stride_runs_exactly():
    mod = npu_backend.partition_for_npu(_strided_slice_module(strides=(3, 3)))
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    x = np.random.default_rng(4).integers(-128, 128, (1, 8, 8, 16), dtype=np.int8)
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), x[:, 1:7:3, :, 2:10:3])


def test_float_strided_slice_stays_on_host():
    mod = npu_backend.partition_for_npu(_strided_slice_module(dtype="float32"))
    (op,) = npu_backend.partition_report(mod).host_ops
    assert op.reason == "npu.strided_slice: strided slice of float32 data is not an int8 tensor move"


@pytest.mark.parametrize("fixture, op", [("gelu", relax.op.nn.gelu), ("gelu_approximate", relax.op.nn.gelu_tanh)])
def test_gelu_table_equals_tflite(fixture, op):
    """TVM's TFLite importer refuses quantized GELU, so the idiom is built by hand with the fixture's qparams;
    the NPU's table reproduces BUILTIN_REF on every stored element (the inputs cover all 256 values)."""
    from conftest import FIXTURES
    from relax_idioms import activation_module

    golden = np.load(FIXTURES / "tflite" / f"{fixture}.npz")
    q_in = (float(golden["input_scale"]), int(golden["input_zero_point"]))
    q_out = (float(golden["output_scale"]), int(golden["output_zero_point"]))
    mod = npu_backend.partition_for_npu(activation_module(op, shape=(1, 8, 8, 16), q_in=q_in, q_out=q_out))
    (name, p), = composites(mod)
    assert name == f"npu.{op.__name__}" and (p.input_scale, p.output_scale) == (q_in[0], q_out[0])
    assert len(np.unique(golden["inputs"])) == 256
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    for x, want in zip(golden["inputs"], golden["outputs"]):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)


def _tvm_elu_module(q_in, q_out, alpha=-1.0, shape=(1, 8, 8, 16)):
    """TVM's float spelling of TFLite ELU (convert_elu: -1 * relu(1 - exp(x)) + relu(x)) between a dequantize
    and a quantize: the canonical QDQ form of int8 ELU (TVM's importer refuses the quantized operator)."""
    from relax_idioms import f32, i32

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(q_in[0]), i32(q_in[1]), axis=0))
            e = bb.emit(relax.op.exp(dx))
            d = bb.emit(relax.op.subtract(relax.const(1.0, "float32"), e))
            r = bb.emit(relax.op.nn.relu(d))
            m = bb.emit(relax.op.multiply(relax.const(alpha, "float32"), r))
            p = bb.emit(relax.op.nn.relu(dx))
            y = bb.emit(relax.op.add(m, p))
            gv = bb.emit_output(relax.op.quantize(y, f32(q_out[0]), i32(q_out[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def test_elu_table_equals_tflite():
    """int8 ELU, a table operator added through its definition alone: offloaded whole as one npu.elu and equal
    to TFLite's kernel on every stored element."""
    from conftest import FIXTURES

    golden = np.load(FIXTURES / "tflite" / "elu.npz")
    q_in = (float(golden["input_scale"]), int(golden["input_zero_point"]))
    q_out = (float(golden["output_scale"]), int(golden["output_zero_point"]))
    mod = npu_backend.partition_for_npu(_tvm_elu_module(q_in, q_out))
    (name, p), = composites(mod)
    assert name == "npu.elu" and p.op == NpuOp.ELU
    assert (p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point) == (*q_in, *q_out)
    assert npu_backend.partition_report(mod).host_ops == []
    assert len(np.unique(golden["inputs"])) == 256
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    for x, want in zip(golden["inputs"], golden["outputs"]):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)


def test_elu_of_another_alpha_stays_on_host():
    """TFLite's ELU has alpha 1; -2 * relu(1 - exp(x)) + relu(x) is something else and is not matched as it."""
    mod = npu_backend.partition_for_npu(_tvm_elu_module((0.04, 25), (0.02, -77), alpha=-2.0))
    report = npu_backend.partition_report(mod)
    assert "npu.elu" not in {op.composite for op in report.ops}
    (add,) = [op for op in report.host_ops if op.op == "relax.add"]
    assert add.reason == "npu.elu: not -relu(1 - exp(x)) + relu(x), an ELU of alpha 1"


def test_plain_from_tflite_gets_tflite_numerics():
    import tflite
    from conftest import FIXTURES
    from tvm.relax.frontend.tflite import from_tflite

    data = (FIXTURES / "tflite" / "add_two_inputs.tflite").read_bytes()
    report = npu_backend.partition_report(npu_backend.partition_for_npu(from_tflite(tflite.Model.GetRootAsModel(data, 0))))
    assert report.numerics == "tflite"
    assert report.numerics_why == ("detected: main carries the 'params' attribute TVM's TFLite importer writes; "
                                   "every zero point is int32, as TVM's TFLite importer writes them")


def test_numerics_that_cannot_be_told_are_stated_and_warned():
    """int8 zero points (ONNX's) in a module that also carries TFLite's 'params' attribute: TFLite's numerics,
    a warning saying how to choose, and the report saying why."""
    from npu_backend.errors import NpuWarning

    mod = activation_module()
    func = mod["main"]
    mixed = tvm.IRModule({"main": func.with_attr("params", [])})
    with pytest.warns(NpuWarning, match="pass reference='onnxruntime'"):
        report = npu_backend.partition_report(npu_backend.partition_for_npu(_int8_zero_points(mixed)))
    assert report.numerics == "tflite" and report.numerics_why.startswith("default, the module shows signs of both")
    assert "numerics: tflite (default" in report.format_table()


def _int8_zero_points(mod):
    """The same module with every zero point typed int8, as TVM's ONNX importer writes them."""
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class Narrow(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.name in ("relax.quantize", "relax.dequantize"):
                zp = relax.const(call.args[2].value.numpy().astype(np.int8))
                return relax.Call(call.op, [call.args[0], call.args[1], zp], call.attrs)
            return call

    return tvm.IRModule({"main": Narrow().visit_expr(mod["main"])}, attrs=mod.attrs)


@pytest.mark.parametrize("shapes, broadcast", [
    (((1, 6, 5, 8), (1, 1, 1, 8)), (1,)),   # x * gate: a squeeze-excite multiply
    (((1, 1, 1, 8), (1, 6, 5, 8)), (0,)),   # gate * x
])
@pytest.mark.parametrize("op", ["multiply", "add"])
def test_per_channel_broadcast_runs_exactly(shapes, broadcast, op):
    """A per-channel operand is replicated over the pixels by a stride-0 DMA read (on npu-tiny, chunk by chunk);
    every element equals TFLite's MUL / ADD restated element by element (reference_kernels) on the broadcast
    operands."""
    import reference_kernels as ref
    from relax_idioms import add_module

    q1, q2, q_out = (0.03, -5), (0.02, 7), (0.004, -3) if op == "multiply" else (0.05, 1)
    mod = npu_backend.partition_for_npu(add_module(shapes[0], shapes[1], q1, q2, q_out, op=getattr(relax.op, op)),
                                        dataclasses.replace(npu_backend.get_config("npu-tiny"), name="npu-64b",
                                                            sram_bytes=64))
    (name, p), = composites(mod)
    assert name == f"npu.{op}" and p.broadcast == broadcast and p.shape == (1, 6, 5, 8)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    rng = np.random.default_rng(7)
    a, b = (rng.integers(-128, 128, s, dtype=np.int8) for s in shapes)
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    wa, wb = (np.broadcast_to(v, (1, 6, 5, 8)).reshape(-1).tolist() for v in (a, b))
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    reference = ref.mul if op == "multiply" else ref.add
    want = reference(wa, wb, f32(q1[0]), q1[1], f32(q2[0]), q2[1], f32(q_out[0]), q_out[1], (-128, 127))
    np.testing.assert_array_equal(got.reshape(-1), want)


def test_other_broadcasts_stay_on_the_host():
    from relax_idioms import add_module

    mod = npu_backend.partition_for_npu(add_module((1, 6, 5, 8), (1, 6, 1, 8), op=relax.op.multiply))
    (mul,) = [o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.multiply"]
    assert mul.reason == ("npu.multiply: broadcasting multiply ([1, 6, 5, 8] and [1, 6, 1, 8]) is supported only "
                          "of a per-channel vector [1, ..., 1, C] over the other operand")


# -- the pre-filter: only patterns whose operators occur in the module are handed to FuseOpsByPattern --------

def test_required_ops_of_hand_built_patterns():
    from tvm.relax.dpl.pattern import is_const, is_op, is_tuple_get_item, wildcard

    from npu_backend.patterns import required_ops

    x = wildcard()
    add = is_op("relax.add")(x, wildcard())
    assert required_ops(is_op("relax.quantize")(add, is_const(), is_const())) == {"relax.quantize", "relax.add"}
    relu, clip = is_op("relax.nn.relu")(x), is_op("relax.clip")(x, wildcard(), wildcard())
    assert required_ops(relu | clip) == frozenset()  # either may be absent
    either = is_op("relax.quantize")(relu, is_const(), is_const()) | is_op("relax.quantize")(clip, is_const(),
                                                                                              is_const())
    assert required_ops(either) == {"relax.quantize"}  # what both sides need
    assert required_ops(relu & add) == {"relax.nn.relu", "relax.add"}
    assert required_ops(add.has_dtype("int8").has_attr({"foo": 1})) == {"relax.add"}
    assert required_ops(is_tuple_get_item(is_op("relax.split")(x), 0)) == {"relax.split"}
    assert required_ops(x) == required_ops(is_const()) == frozenset()
    # an operator given as an alternation is not required: either one may be the call
    assert required_ops((is_op("relax.add") | is_op("relax.subtract"))(x, x)) == frozenset()
    assert required_ops(~add) == frozenset()  # a negation matches what has no add
    assert required_ops(is_op("relax.concat")(varg_default_wildcard=True)) == {"relax.concat"}  # any arguments
    assert required_ops(wildcard()(x)) == frozenset()  # a call of anything
    assert required_ops(is_op("relax.add")(x, is_op("relax.nn.relu")(x), varg_default_wildcard=True)) == {
        "relax.add", "relax.nn.relu"}


def test_patterns_for_keeps_priority_and_drops_patterns_whose_operators_are_absent():
    from npu_backend.canonicalize import canonicalize
    from npu_backend.patterns import patterns_for, required_ops

    mod = canonicalize(ConvIdiom(op="conv2d", clip=(5, 127)).module())
    kept = patterns_for(mod)
    present = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: present.add(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    expected = [e for e in registered_patterns() if required_ops(e.pattern) <= present]
    assert [(e.name, str(e.pattern)) for e in kept] == [(e.name, str(e.pattern)) for e in expected]
    names = [e.name for e in kept]
    assert names[0] == "npu.conv2d" and "npu.requantize" in names  # the fused clip first; QDQ idioms stay
    assert not {"npu.softmax", "npu.mean", "npu.concat", "npu.multiply", "npu.max_pool2d"} & set(names)
    assert len(kept) < len(registered_patterns())


@pytest.mark.parametrize("fixture", ["tflite/mobilenet_v2_035_96.tflite", "tflite/concat_branches.tflite",
                                     "tflite/add_two_inputs.tflite"])
def test_fusion_with_the_pre_filtered_table_equals_fusion_with_the_whole_table(fixture):
    from pathlib import Path

    from npu_backend.canonicalize import canonicalize
    from npu_backend.patterns import patterns_for

    path = Path(__file__).parent / "fixtures" / fixture
    mod = relax.transform.ConvertToDataflow()(canonicalize(npu_backend.load_model(path)))

    def fuse(patterns):
        return relax.transform.FuseOpsByPattern(patterns, bind_constants=True, annotate_codegen=False)(mod)

    kept = patterns_for(mod)
    assert len(kept) < len(registered_patterns())
    tvm.ir.assert_structural_equal(fuse(kept), fuse(registered_patterns()))
    for entry in registered_patterns():  # what the filter drops cannot fuse anything on its own
        if not any(entry.pattern.same_as(k.pattern) for k in kept):
            tvm.ir.assert_structural_equal(fuse([entry]), mod)
