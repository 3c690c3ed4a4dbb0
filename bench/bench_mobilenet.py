"""Wall-clock of the simulated NPU path against LiteRT's interpreters, in one run.

Measures, on an int8 TFLite model (default: the bundled MobileNetV2 fixture, alpha 0.35, 96x96; ``--model``
takes another, e.g. MobileNetV2-1.0-224 from ``bench/mobilenet_v2_tflite.py``):
  * npu_backend: Relax VM with the NPU regions executed by the bit-exact simulator;
  * LiteRT BUILTIN_REF: TFLite's reference kernels (the golden oracle);
  * LiteRT default: the optimized kernels (XNNPACK / ruy);
  * TVM CPU: the same imported module built by TVM for the host alone (float QDQ).
plus the simulator alone (the region's stream run directly, and run on 16 samples at a time),
and prints milliseconds per inference, the ratios, and the simulated NPU time
(cycles at the preset's clock), which is what the hardware would take. Everything runs on one thread
(LiteRT ``num_threads=1``, BLAS pinned to one, TVM's pool set to one before it loads); ``npu_sim`` is what
a user of the Relax VM sees, its NPU region's stream prepared once (:mod:`simulator.prepared`) and run.

    python bench/bench_mobilenet.py [--runs 10] [--preset npu-256] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", "1")  # before tvm loads: one thread, as the LiteRT interpreters

import numpy as np
from threadpoolctl import threadpool_limits
import tvm
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from tvm import relax

import npu_backend
from npu_backend.codegen.lower import lower_module
from simulator import BufferKind, run_stream
from simulator.batch import run_stream_batch
from simulator.config import resolve_config

MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tflite" / "mobilenet_v2_035_96.tflite"


BATCH = 16


def _best_of(candidates: dict, runs: int) -> dict[str, float]:
    """Best wall clock of each candidate, in ms, over ``runs`` rounds of one call each (after a warm-up round).

    Rounds interleave the candidates, so that on a shared machine whose load changes over time every one of them
    meets the same conditions: the ratios are taken in the same run, as the figures that matter.
    """
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(runs):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def _litert(model: Path, resolver):
    interpreter = Interpreter(model_path=str(model), experimental_op_resolver_type=resolver, num_threads=1)
    interpreter.allocate_tensors()
    return interpreter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--preset", default=npu_backend.DEFAULT_PRESET)
    parser.add_argument("--model", type=Path, default=MODEL, help="an int8 TFLite model with one int8 input")
    args = parser.parse_args()
    threadpool_limits(1)

    interpreters = {"litert_ref": _litert(args.model, OpResolverType.BUILTIN_REF),
                    "litert_opt": _litert(args.model, OpResolverType.AUTO)}
    shape = interpreters["litert_ref"].get_input_details()[0]["shape"]
    x = np.random.default_rng(0).integers(-128, 128, shape, dtype=np.int8)
    mod = npu_backend.load_tflite(args.model)
    vm = relax.VirtualMachine(npu_backend.build(mod, preset=args.preset), tvm.cpu())
    cpu_vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    tx = tvm.runtime.tensor(x)

    def run_litert(interpreter):
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])

    with npu_backend.profile() as prof:
        npu_out = vm["main"](tx).numpy()
    exact = np.array_equal(npu_out, run_litert(interpreters["litert_ref"]))

    cpu_exact = int(np.count_nonzero(cpu_vm["main"](tx).numpy() != run_litert(interpreters["litert_ref"])))
    # The simulator alone: the region's command stream run directly, one sample, and a batch of them
    # (simulator.batch, equal output for output to one run each), per sample.
    config = resolve_config(args.preset)
    (stream,) = lower_module(npu_backend.partition_for_npu(mod, args.preset)).values()
    (name,) = [b.name for _, b in stream.buffers_of(BufferKind.INPUT)]
    batch = np.random.default_rng(1).integers(-128, 128, (BATCH, *x.shape), dtype=np.int8)
    batch[0] = x
    stream_exact = np.array_equal(run_stream(stream, {name: x}, config)[0]["output0"], npu_out)
    batch_exact = np.array_equal(run_stream_batch(stream, {name: batch}, config)[0]["output0"][0], npu_out)
    timings = _best_of({"npu_sim": lambda: vm["main"](tx),
                        "sim_stream": lambda: run_stream(stream, {name: x}, config),
                        "tvm_cpu": lambda: cpu_vm["main"](tx),
                        **{key: lambda i=interpreter: run_litert(i) for key, interpreter in interpreters.items()}},
                       args.runs)
    batched = _best_of({"batch": lambda: run_stream_batch(stream, {name: batch}, config)}, max(1, args.runs // 4))
    timings[f"sim_batch{BATCH}"] = batched["batch"] / BATCH

    clock = resolve_config(args.preset).clock_mhz
    print(f"model: {args.model.name}, best of {args.runs} runs, 1 thread")
    for name, ms in timings.items():
        print(f"  {name:<11} {ms:9.2f} ms/inference")
    print(f"  ratio npu_sim / litert_ref = {timings['npu_sim'] / timings['litert_ref']:.2f}: the simulated NPU "
          f"(functional and timing) is {timings['litert_ref'] / timings['npu_sim']:.2f}x faster than BUILTIN_REF")
    print(f"  ratio sim_stream / litert_ref = {timings['sim_stream'] / timings['litert_ref']:.2f} "
          f"(sim_stream: the simulator alone; sim_batch{BATCH}: per sample, {BATCH} at a time)")
    print(f"  ratio npu_sim / litert_opt = {timings['npu_sim'] / timings['litert_opt']:.2f}")
    print(f"  ratio npu_sim / tvm_cpu    = {timings['npu_sim'] / timings['tvm_cpu']:.2f}")
    print(f"simulated NPU ({args.preset}): {prof.total_cycles} cycles = {prof.total_cycles / clock / 1e3:.3f} ms "
          f"at {clock} MHz, {prof.total_macs} MACs, {prof.total_dram_bytes} DMA bytes, "
          f"{len(prof.runs)} NPU calls")
    print(f"output bit-exact with litert_ref: npu_sim {exact}; tvm_cpu differs on {cpu_exact} of {npu_out.size}; "
          f"sim_stream and sim_batch{BATCH} equal npu_sim: {stream_exact and batch_exact}")


if __name__ == "__main__":
    main()
