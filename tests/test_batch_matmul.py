"""Batch matmul of two int8 activations on the MAC array (TFLite BATCH_MATMUL, with adj_y).

What the pattern matches and extracts (exact records), what stays on the host and why, the kernel against
the loop-per-element reference of ``reference_ops::BatchMatMul`` (whole-batch tiles and row stripes), the
SRAM limit at the byte, the multiplier TFLite prepares, and the BATCH_MATMUL command's validation and cost.
The TFLite fixtures (bit-exact with BUILTIN_REF) are in test_tflite_golden.py.
"""

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
import reference_kernels as ref
from layer_streams import run_layer
from relax_idioms import f32, i32
from test_patterns import composites
from npu_backend.params import BatchMatMulParams, NpuOp
from npu_backend.tiling import plan_batch_matmul
from simulator import (Buffer, BufferKind, Command, CommandStream, FeatureMap, Opcode, Rounding, StreamError,
                       decode_stream, encode_stream, get_config, run_stream, validate_stream)
from simulator.isa import MatMul
from simulator.numerics import batch_matmul_multiplier

BASE = get_config("npu-256")
QA, QB, QOUT = (0.011764235, -43), (0.015685735, 63), (0.12787972, 62)  # the batch_matmul fixture's qparams


def _module(a_shape, b_shape, permute=None, constant_b=False):
    """quantize(matmul(dequantize(a), dequantize([permute_dims] b))) as npu_backend's TFLite converter writes it."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "int8"))
    b = relax.Var("b", relax.TensorType(b_shape, "int8"))
    params = [a] if constant_b else [a, b]
    with bb.function("main", params):
        with bb.dataflow():
            if constant_b:
                b = relax.const(np.ones(b_shape, np.int8))
            rhs = bb.emit(relax.op.permute_dims(b, permute)) if permute else b
            product = bb.emit(relax.op.matmul(bb.emit(relax.op.dequantize(a, f32(QA[0]), i32(QA[1]), axis=0)),
                                              bb.emit(relax.op.dequantize(rhs, f32(QB[0]), i32(QB[1]), axis=0))))
            gv = bb.emit_output(relax.op.quantize(product, f32(QOUT[0]), i32(QOUT[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def _params(a_shape, b_shape, out_shape, adj_y=False):
    return BatchMatMulParams(NpuOp.BATCH_MATMUL, a_shape, b_shape, out_shape, adj_y,
                             *(float(np.float32(v)) if isinstance(v, float) else v for v in (*QA, *QB, *QOUT)))


def _reference(p: BatchMatMulParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    mult, shift = ref.conv_multipliers(p.input_scale, [p.input2_scale], p.output_scale,
                                       per_tensor_fully_connected=True)
    batches, rows, depth, columns = p.dims
    lhs, rhs = a.reshape(batches, rows, depth), b.reshape(batches, *p.ifm2_shape[-2:])
    out = ref.batch_matmul(lhs.tolist(), rhs.tolist(), QA[1], QB[1], mult[0], shift[0], QOUT[1], p.adj_y)
    return np.array(out, dtype=np.int8).reshape(p.ofm_shape)


def _host_reason(mod) -> str:
    (op,) = [o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.matmul"]
    return op.reason


@pytest.mark.parametrize("permute, b_shape, adj_y", [(None, (2, 7, 3), False), ([0, 2, 1], (2, 3, 7), True)])
def test_batch_matmul_extracts_both_operands_and_runs_exactly(permute, b_shape, adj_y):
    """adj_y is the permute_dims the composite absorbs: the MAC array reads the operand transposed."""
    mod = npu_backend.partition_for_npu(_module((2, 5, 7), b_shape, permute))
    report = npu_backend.partition_report(mod)
    assert not report.host_ops
    (name, p), = composites(mod)
    assert name == "npu.batch_matmul" and p == _params((2, 5, 7), b_shape, (2, 5, 3), adj_y)
    assert (p.input_scale, p.input2_scale, p.output_scale) == tuple(float(np.float32(q[0])) for q in (QA, QB, QOUT))
    rng = np.random.default_rng(5)
    a, b = (rng.integers(-128, 128, shape, dtype=np.int8) for shape in ((2, 5, 7), b_shape))
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    with npu_backend.profile() as prof:
        got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    assert prof.runs
    np.testing.assert_array_equal(got, _reference(p, a, b))


def test_the_same_tensor_on_both_sides():
    """x @ x^T (self-similarity): one region input feeds both operands."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 4), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            transposed = bb.emit(relax.op.permute_dims(x, [0, 2, 1]))
            lhs = bb.emit(relax.op.dequantize(x, f32(QA[0]), i32(QA[1]), axis=0))
            rhs = bb.emit(relax.op.dequantize(transposed, f32(QA[0]), i32(QA[1]), axis=0))
            product = bb.emit(relax.op.matmul(lhs, rhs))
            gv = bb.emit_output(relax.op.quantize(product, f32(QOUT[0]), i32(QOUT[1]), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get())
    (name, p), = composites(mod)
    assert name == "npu.batch_matmul" and p.adj_y and p.ifm2_shape == (1, 6, 4)
    x_value = np.random.default_rng(6).integers(-128, 128, (1, 6, 4), dtype=np.int8)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    mult, shift = batch_matmul_multiplier(QA[0], QA[0], QOUT[0])
    want = ref.batch_matmul(x_value.tolist(), x_value.tolist(), QA[1], QA[1], mult, shift, QOUT[1], adj_y=True)
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x_value)).numpy(), np.array(want, np.int8))


def test_broadcast_batch_axes_stay_on_host():
    mod = npu_backend.partition_for_npu(_module((2, 5, 7), (7, 3)))
    assert _host_reason(mod) == ("npu.batch_matmul: batch matmul of [2, 5, 7] and [7, 3]: the NPU multiplies "
                                 "operands of equal rank and equal batch axes only (no broadcasting)")


def test_a_permute_other_than_adj_y_stays_on_host():
    mod = npu_backend.partition_for_npu(_module((2, 5, 7), (7, 2, 3), permute=[1, 0, 2]))
    assert _host_reason(mod) == ("npu.batch_matmul: permute_dims [1, 0, 2] of the second operand is not a swap of "
                                 "its last two axes")


def test_a_constant_right_operand_is_not_this_idiom():
    """A constant is a fully connected layer's weight: the batch-matmul pattern does not claim it."""
    mod = npu_backend.partition_for_npu(_module((2, 5, 7), (2, 7, 3), constant_b=True))
    assert _host_reason(mod) == "npu.fully_connected: fully connected needs a 2-D input and weight, got [2, 5, 7]"


def test_onnxruntime_numerics_stay_on_host():
    mod = npu_backend.partition_for_npu(_module((2, 5, 7), (2, 7, 3)), reference="onnxruntime")
    assert _host_reason(mod) == ("npu.batch_matmul: the NPU's batch_matmul is TFLite's integer kernel; "
                                 "onnxruntime's float32 batch_matmul of the dequantized input is not reproduced")


@pytest.mark.parametrize("sram, tiles", [(4096, (4, 16)), (1024, (2, 16)), (300, (1, 7))])
def test_kernel_in_whole_batches_or_row_stripes_matches_the_reference(sram, tiles):
    """4 batches of [16, 8] x [16, 8]^T: all at once, two batches a tile, or one batch's right operand with
    row stripes of the left one."""
    config = dataclasses.replace(BASE, name=f"sram-{sram}", sram_bytes=sram, sram_align=1)
    p = _params((1, 4, 16, 8), (1, 4, 16, 8), (1, 4, 16, 16), adj_y=True)
    plan = plan_batch_matmul(p, config)
    assert (plan.batches, plan.rows) == tiles
    rng = np.random.default_rng(7)
    a, b = (rng.integers(-128, 128, (1, 4, 16, 8), dtype=np.int8) for _ in range(2))
    got, stats = run_layer(p, config, a, b)
    np.testing.assert_array_equal(got, _reference(p, a, b))
    commands = [c for c in stats.commands if c.opcode == Opcode.BATCH_MATMUL]
    assert len(commands) == -(-4 // tiles[0]) * -(-16 // tiles[1])
    assert sum(c.macs for c in commands) == 4 * 16 * 8 * 16


def test_sram_limit_at_the_byte():
    """One row stripe needs a row of the left operand (K), the right operand (K x N) and an output row (N)."""
    p = _params((1, 3, 7), (1, 7, 5), (1, 3, 5))
    need = 7 + 7 * 5 + 5
    assert plan_batch_matmul(p, dataclasses.replace(BASE, name="exact", sram_bytes=need, sram_align=1)).rows == 1
    short = dataclasses.replace(BASE, name="short", sram_bytes=need - 1, sram_align=1)
    mod = npu_backend.partition_for_npu(_module((1, 3, 7), (1, 7, 5)), short)
    assert _host_reason(mod) == ("npu.batch_matmul: one batch's 7x5 right operand, a row of the left operand and "
                                 "a row of the output need more than the 46-byte SRAM")


def test_multiplier_is_tflites_float32_scale_product():
    """batch_matmul.cc: GetQuantizedConvolutionMultipler multiplies the two scales in float32 (the fixture's
    multiplier; the product taken in double would give 1586597275)."""
    assert batch_matmul_multiplier(QA[0], QB[0], QOUT[0]) == (1586597232, -9)
    mult, shift = ref.conv_multipliers(QA[0], [QB[0]], QOUT[0], per_tensor_fully_connected=True)
    assert (mult[0], shift[0]) == (1586597232, -9)


# -- the BATCH_MATMUL command -------------------------------------------------------------------------------------

def _matmul_stream(version=None, **changes) -> CommandStream:
    fields = dict(ifm=FeatureMap(0, 2, 5, 7), ifm2=FeatureMap(128, 2, 3, 7), ofm=FeatureMap(256, 2, 5, 3),
                  input_zero_point=-43, input2_zero_point=63, output_zero_point=62, output_multiplier=1586597232,
                  output_shift=-9, rounding=Rounding.TFLITE_DOUBLE, adj_y=True)
    command = Command(Opcode.BATCH_MATMUL, MatMul(**{**fields, **changes}), layer="matmul")
    stream = CommandStream("matmul", BASE, (Buffer("ofm", BufferKind.OUTPUT, 16, shape=(16,)),), (command,))
    return stream if version is None else dataclasses.replace(stream, version=version)


def test_matmul_command_round_trips_and_costs_as_fully_connected_rows():
    stream = _matmul_stream()
    decoded = decode_stream(encode_stream(stream))
    assert decoded == stream and decoded.commands[0].payload.adj_y is True
    _, stats = run_stream(decoded, {})
    (command,) = stats.commands
    # Each batch holds its own right operand in the array: 2 batches x ceil(7 / C) x ceil(3 / R) folds, each
    # streaming 5 rows but lasting the C cycles its weights take to enter the array (docs/cycle_model.md).
    folds = 2 * -(-7 // BASE.mac_cols) * -(-3 // BASE.mac_rows)
    array = folds * max(5, BASE.mac_cols)
    outputs = -(-(2 * 5 * 3) // BASE.output_lanes)
    assert command.cycles == BASE.command_overhead_cycles + max(array, outputs) and command.macs == 2 * 5 * 7 * 3
    with pytest.raises(StreamError, match=r"BATCH_MATMUL is not defined in format 2.1 \(added in 2.2\)"):
        encode_stream(_matmul_stream(version=(2, 1)))


@pytest.mark.parametrize("changes, message", [
    (dict(adj_y=False), r"matmul ifm2 is 2x3x7, the ifm 2x5x7 needs 2x7x3"),
    (dict(ofm=FeatureMap(256, 2, 5, 4)), r"matmul ifm2 is 2x3x7, the ifm 2x5x7 needs 2x4x7"),
    (dict(ifm2=FeatureMap(128, 1, 3, 7)), r"matmul ifm2 is 1x3x7, the ifm 2x5x7 needs 2x3x7"),
    (dict(input2_zero_point=128), r"input2_zero_point 128 is outside int8"),
    (dict(output_shift=31), r"output multiplier 1586597232 / shift 31 out of range"),
    (dict(rounding=Rounding.FLOAT64), r"rounding FLOAT64 is not one of TFLite's fixed-point builds"),
    (dict(ofm=FeatureMap(150, 2, 5, 3)), r"ofm overlaps ifm2 in SRAM"),
])
def test_matmul_command_validation(changes, message):
    validate_stream(_matmul_stream(), BASE)
    with pytest.raises(StreamError, match=message):
        validate_stream(_matmul_stream(**changes), BASE)
