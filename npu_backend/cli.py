"""The ``npu`` command: run | compile | partition | quantize | inspect | sim | eval | sweep.

``inspect`` and ``sim`` import only the simulator (no TVM), so they start fast
and work where only numpy and flatbuffers are installed. Every failure the
user can cause ends as one line ``npu: error: <reason>`` and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from simulator.config import DEFAULT_PRESET, PRESETS
from simulator.errors import NpuError

from npu_backend.errors import first_line
from npu_backend.progress import ProgressBar


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise NpuError(f"cannot read input array {path}: {exc}") from None


def _named_inputs(pairs: list[str]) -> dict[str, np.ndarray]:
    inputs = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep:
            raise NpuError(f"--input takes NAME=FILE.npy, got {pair!r}")
        inputs[name] = _load_npy(path)
    return inputs


def _read_stream(path: str):
    from simulator.stream import decode_stream

    try:
        return decode_stream(Path(path).read_bytes())
    except OSError as exc:
        raise NpuError(f"cannot read {path}: {exc.strerror}") from None


def cmd_inspect(args) -> int:
    from simulator.validate import validate_stream

    stream = _read_stream(args.stream)
    validate_stream(stream, stream.config)
    print(f"stream {stream.name}: format {stream.version[0]}.{stream.version[1]}, hardware {stream.config.name} "
          f"(fingerprint {stream.config.fingerprint}), {len(stream.buffers)} buffers, {len(stream.commands)} "
          f"commands (valid)")
    print("  " + ", ".join(f"{k}={v}" for k, v in stream.config.values().items()))
    for i, buf in enumerate(stream.buffers):
        print(f"  buffer {i:<3} {buf.kind.name:<8} {buf.name:<40} {buf.dtype}{list(buf.shape)} {buf.size} B")
    for i, cmd in enumerate(stream.commands):
        fields = ", ".join(f"{k}={v}" for k, v in vars(cmd.payload).items())
        waits = "" if cmd.deps is None else f" waits for {list(cmd.deps)}"
        print(f"  {i:>4} {cmd.layer:<22} {cmd.opcode.name:<17} {fields}{waits}")
    return 0


def _print_run_stats(stats) -> None:
    """The per-command table; an ``overflows`` column and line appear whenever an accumulator overflowed."""
    from simulator.machine import describe_overflows

    overflowed = stats.total_overflows > 0
    extra = f" {'overflows':>9}" if overflowed else ""
    print(f"{'#':>4} {'layer':<22} {'opcode':<17} {'engine':<7} {'start':>9} {'cycles':>9} {'MACs':>10} "
          f"{'DRAM rd':>8} {'DRAM wr':>8}{extra}")
    for c in stats.commands:
        extra = f" {c.overflows:>9}" if overflowed else ""
        print(f"{c.index:>4} {c.layer:<22} {c.opcode.name:<17} {c.engine.value:<7} {c.start:>9} {c.cycles:>9} "
              f"{c.macs:>10} {c.dram_read_bytes:>8} {c.dram_write_bytes:>8}{extra}")
    print(f"total: {stats.total_cycles} cycles (the schedule's makespan), {stats.total_macs} MACs, "
          f"{stats.total_dram_bytes} DRAM bytes on {stats.config.name}")
    if overflowed:
        print(describe_overflows(stats.total_overflows, stats.config))


def cmd_sim(args) -> int:
    if Path(args.stream).is_dir():
        return _sim_compiled(args)
    from simulator.isa import BufferKind
    from simulator.machine import run_stream

    from npu_backend.profiling import Profile

    _check_run_options(args)
    stream = _read_stream(args.stream)
    given = _named_inputs(args.input or [])
    rng = np.random.default_rng(args.seed)
    prof, first = Profile(), None
    for _ in _inferences(args.repeat):
        inputs = dict(given)
        if args.random_inputs:
            for _, buf in stream.buffers_of(BufferKind.INPUT):
                info = np.iinfo(buf.dtype)
                inputs.setdefault(buf.name, rng.integers(info.min, info.max + 1, buf.shape).astype(buf.dtype))
        outputs, stats = run_stream(stream, inputs)
        first = outputs if first is None else first
        prof.runs.append((stream.name, stats))
    _print_run_stats(prof.runs[0][1])
    if args.repeat > 1:
        print(f"{args.repeat} inferences (the table shows the first): {prof.total_cycles} cycles, "
              f"{prof.total_overflows} accumulator overflows")
    _save_outputs(args.output, first)
    _write_views(prof, args)
    return 0


def _inferences(count: int):
    """range(count), with a progress bar over the inferences when there are several (on a tty, with tqdm)."""
    progress = ProgressBar("running", "inference") if count > 1 else None
    try:
        for k in range(count):
            yield k
            if progress is not None:
                progress(k + 1, count)
    finally:
        if progress is not None:
            progress.close()


def _check_run_options(args) -> None:
    """Fail before compiling and running, not after, on a --repeat or --plot that cannot be honoured."""
    if args.repeat < 1:
        raise NpuError(f"--repeat takes a positive number of inferences, got {args.repeat}")
    if args.plot:
        from npu_backend.roofline_plot import require_matplotlib

        require_matplotlib()


def _write_views(prof, args) -> None:
    """--trace and --plot of npu run / npu sim."""
    if args.trace:
        prof.to_chrome_trace(args.trace)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        prof.plot(args.plot)
        print(f"plot written to {args.plot}")


def _save_outputs(path: str | None, outputs: dict) -> None:
    if path:
        np.savez(path, **outputs)
        print(f"outputs {', '.join(outputs)} written to {path}")


def _sim_compiled(args) -> int:
    """A whole compiled model (``npu compile``'s directory): model-level inputs, every region on the simulator."""
    import npu_backend
    from npu_backend.compiled import read_manifest, run_compiled

    _check_run_options(args)
    manifest = read_manifest(args.stream)
    given = _named_inputs(args.input or [])
    rng = np.random.default_rng(args.seed)
    first = None
    with npu_backend.profile() as prof:
        for _ in _inferences(args.repeat):
            inputs = dict(given)
            for tensor in manifest["inputs"]:
                if tensor["name"] not in inputs and args.random_inputs:
                    inputs[tensor["name"]] = _random_tensor(tensor, rng)
            outputs = run_compiled(args.stream, inputs)
            first = outputs if first is None else first
    print(prof.summary())
    _save_outputs(args.output, first)
    _write_views(prof, args)
    return 0


def _random_tensor(tensor: dict, rng) -> np.ndarray:
    """Any integer value, or for a float input the grid of its recorded qparams (exact through its quantize)."""
    dtype = np.dtype(tensor["dtype"])
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max + 1, tensor["shape"]).astype(dtype)
    if tensor["scale"] is None:
        raise NpuError(f"input {tensor['name']} is {dtype} and not quantized per tensor; pass it with --input")
    q = rng.integers(-128, 128, tensor["shape"]).astype(np.int32)
    return ((q - tensor["zero_point"]).astype(np.float32) * np.float32(tensor["scale"])).astype(dtype)


def _preset(args):
    """The hardware to build for: --preset, else a quantized-model file's own (what it was calibrated on)."""
    if args.preset is not None:
        return args.preset
    if Path(args.model).suffix.lower() == ".npuq":
        from npu_backend.quantization.stored import stored_config

        return stored_config(args.model)
    return DEFAULT_PRESET


def cmd_compile(args) -> int:
    from npu_backend.compiled import MANIFEST, write_compiled

    manifest = write_compiled(args.model, args.output, _preset(args), args.reference)
    out = Path(args.output)
    for region in manifest["regions"]:
        print(f"{out / region['file']}: {region['commands']} commands, inputs "
              f"{', '.join(t['name'] for t in region['inputs'])} -> outputs "
              f"{', '.join(t['name'] for t in region['outputs'])}")
    print(f"{len(manifest['regions'])} NPU regions in call order; manifest: {out / MANIFEST} "
          f"(run the whole model with: npu sim {out} --random-inputs)")
    return 0


def cmd_partition(args) -> int:
    import npu_backend

    report = npu_backend.partition_report(npu_backend.partition_for_npu(npu_backend.load_model(args.model),
                                                                          _preset(args), args.reference))
    print(report.to_json() if args.json else report.format_table())
    return 0


def _tflite_outputs(model: str, inputs: list[np.ndarray]):
    """(outputs, label) of TFLite's reference kernels (:func:`npu_backend.reference_runtimes.tflite_interpreter`);
    None when ai-edge-litert is absent."""
    from npu_backend.reference_runtimes import tflite_interpreter

    try:
        interpreter, label = tflite_interpreter(model)
    except ImportError:
        return None
    for detail, value in zip(interpreter.get_input_details(), inputs):
        interpreter.set_tensor(detail["index"], value)
    interpreter.invoke()
    return [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()], label


def _onnxruntime_outputs(model: str, inputs: list[np.ndarray]):
    """(outputs, label): onnxruntime executing the QDQ graph literally (optimizations off); None when it is
    absent."""
    from npu_backend.reference_runtimes import onnxruntime_session

    try:
        session, label = onnxruntime_session(model)
    except ImportError:
        return None
    feeds = {i.name: x for i, x in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds), label


def _simulated_outputs(model: str, inputs: list[np.ndarray]):
    """(outputs, label): a quantized-model file's simulated quantization, layer by layer on the NPU's integers."""
    from npu_backend.quantization.stored import load_quantized

    calibrated = load_quantized(model)
    names = [p.name for p in calibrated.module["main"].params]
    return calibrated.simulate([dict(zip(names, inputs))])[0], "the simulated quantization it was calibrated on"


REFERENCES = {".tflite": (_tflite_outputs, "ai-edge-litert"), ".onnx": (_onnxruntime_outputs, "onnxruntime"),
              ".npuq": (_simulated_outputs, "")}
"""Per model type: how to run the runtime the NPU must match, and the package it needs."""


def _print_placement(report) -> None:
    composites = sorted({o.composite for o in report.npu_ops})
    regions = {o.region for o in report.npu_ops}
    print(f"NPU: {len(report.npu_ops)} of {len(report.ops)} Relax operators in {len(regions)} regions "
          f"({', '.join(composites)})")
    host: dict[tuple[str, str], int] = {}
    for o in report.host_ops:
        host[(o.op, o.reason)] = host.get((o.op, o.reason), 0) + 1
    for (op, reason), count in sorted(host.items()):
        print(f"host: {count:>3} x {op:<22} {reason}")


def cmd_run(args) -> int:
    import tvm
    from tvm import relax

    import npu_backend

    _check_run_options(args)
    mod = npu_backend.load_model(args.model)
    partitioned = npu_backend.partition_for_npu(mod, _preset(args), args.reference)
    _print_placement(npu_backend.partition_report(partitioned))
    vm = relax.VirtualMachine(npu_backend.codegen.build_partitioned(partitioned), tvm.cpu())
    rng = np.random.default_rng(args.seed)
    given = [_load_npy(p) for p in args.input] if args.input else None
    if given is None:
        from npu_backend.compiled import TensorTable

        tensors = TensorTable(mod["main"])
    run_reference, package = REFERENCES[Path(args.model).suffix.lower()]
    total, mismatched, ran = 0, 0, None
    with npu_backend.profile() as prof:
        for k in _inferences(args.repeat):
            inputs = given or [_random_tensor(tensors.describe(param), rng) for param in mod["main"].params]
            result = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
            outputs = [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]
            # The first inference tells whether the reference runtime is installed; given inputs repeat, and so
            # do their reference outputs.
            if not args.no_reference and (k == 0 or (ran is not None and given is None)):
                ran = run_reference(args.model, inputs)
            if ran is not None:
                total += sum(r.size for r in ran[0])
                mismatched += sum(int(np.count_nonzero(o != r)) for o, r in zip(outputs, ran[0]))
    print(prof.summary())
    _write_views(prof, args)
    if ran is None:
        print("reference: skipped (--no-reference)" if args.no_reference else
              f"reference: skipped (install {package}, e.g. pip install 'npu-backend[reference]')")
        return 0
    verdict = "MATCH" if mismatched == 0 else "MISMATCH"
    inferences = f" over {args.repeat} inferences" if args.repeat > 1 else ""
    print(f"reference ({ran[1]}): {verdict}, {total - mismatched} of {total} output elements bit-exact{inferences}")
    return 0 if mismatched == 0 else 1


def _calibration_data(path: str, names: list[str], key: str | None):
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise NpuError(f"cannot read calibration data {path}: {first_line(exc)}") from None
    if len(names) == 1:
        pick = key or (names[0] if names[0] in arrays else None) or (next(iter(arrays)) if len(arrays) == 1 else None)
        if pick not in arrays:
            raise NpuError(f"{path} holds {', '.join(arrays) or 'nothing'}: say which array with --key")
        return arrays[pick]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise NpuError(f"{path} lacks arrays for inputs {', '.join(missing)} (one array per model input, by name)")
    return {n: arrays[n] for n in names}


def _headroom(text: str) -> str | float:
    """``--output-headroom``: a number, or the name of a choice; QConfig validates either."""
    try:
        return float(text)
    except ValueError:
        return text


def _reference_samples(text: str) -> int | str | None:
    """``--reference-samples``: a count, or ``all`` (None); QConfig validates the count."""
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def cmd_quantize(args) -> int:
    import npu_backend
    from npu_backend.quantization import QConfig, calibrate
    from npu_backend.quantization.stored import SUFFIX, save_quantized

    if not str(args.output).endswith(SUFFIX):
        raise NpuError(f"the quantized model is written as a {SUFFIX} file: name -o accordingly")
    if args.plot and args.no_float_reference:
        raise NpuError("--plot draws each layer's SQNR against the float model, which --no-float-reference skips")
    mod = npu_backend.load_model(args.model)
    data = _calibration_data(args.calibration, [p.name for p in mod["main"].params], args.key)
    settings = dict(calibration=args.method, weight_bits=args.weight_bits, accumulator_bits=args.accumulator_bits,
                    accumulator_overflow=args.overflow, per_channel=not args.per_tensor,
                    symmetric_activations=args.symmetric, power_of_two=args.power_of_two,
                    avoid_overflow=args.avoid_overflow, fallback_budget_db=args.fallback_budget,
                    global_scale=args.global_scale, preset=args.preset,
                    rounding=args.rounding or ("onnxruntime" if args.model.lower().endswith(".onnx") else "tflite"),
                    skip_layers=tuple(int(s) if s.isdigit() else s for s in args.skip or ()))
    if args.no_float_reference:
        settings.update(float_reference=False, bias_correction=False)
    for option in ("percentile", "weight_rounding", "output_headroom"):
        if getattr(args, option) is not None:
            settings[option] = getattr(args, option)
    if hasattr(args, "reference_samples"):
        settings["reference_samples"] = args.reference_samples
    config = QConfig(**settings)
    progress = ProgressBar("calibrating", "layer")
    try:
        calibrated = calibrate(mod, data, config, progress)
    finally:
        progress.close()
    save_quantized(calibrated, args.model, args.output)
    report = calibrated.report
    print(report.to_json() if args.json else report.to_table())
    if args.plot:
        report.plot(args.plot)
        print(f"SQNR plot written to {args.plot}")
    print(f"quantized model written to {args.output} (npu run|partition|compile accept it)")
    return 0


PRESET_HELP = ("hardware: a preset name (" + ", ".join(sorted(PRESETS)) + ") or a .toml/.json configuration file "
               "of NpuConfig fields ('base' names a preset to inherit from)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="compile a .tflite or .onnx model, run it (NPU regions on the simulator), "
                                     "compare with its reference runtime")
    run.add_argument("model")
    run.add_argument("--preset", help=PRESET_HELP + f" (default: {DEFAULT_PRESET}, or a .npuq file's own)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random input")
    run.add_argument("--input", action="append", help="input .npy, one per model input, in order")
    run.add_argument("--no-reference", action="store_true", help="do not compare with the reference runtime")
    run.set_defaults(func=cmd_run)
    comp = sub.add_parser("compile", help="write one .npucmd command stream per NPU region")
    comp.add_argument("model")
    comp.add_argument("-o", "--output", required=True, help="output directory")
    comp.add_argument("--preset", help=PRESET_HELP + f" (default: {DEFAULT_PRESET}, or a .npuq file's own)")
    comp.set_defaults(func=cmd_compile)
    part = sub.add_parser("partition", help="show where every operator runs (NPU or host) and why")
    part.add_argument("model")
    part.add_argument("--preset", help=PRESET_HELP + f" (default: {DEFAULT_PRESET}, or a .npuq file's own)")
    part.add_argument("--json", action="store_true", help="machine-readable report")
    for command in (run, comp, part):
        command.add_argument("--reference", default="auto", choices=["auto", "tflite", "onnxruntime"],
                             help="whose rounding to reproduce (default: the model file's own runtime)")
    part.set_defaults(func=cmd_partition)
    quant = sub.add_parser("quantize", help="post-training quantization of a float .tflite/.onnx model into the "
                                            "int8 form the NPU runs; writes a .npuq file and prints the report")
    quant.add_argument("model")
    quant.add_argument("--calibration", required=True, help=".npz of calibration inputs (a batch on axis 0; one "
                                                            "array per input, by name, for several inputs)")
    quant.add_argument("--key", help="which array of the .npz (single-input models)")
    quant.add_argument("--method", default="minmax", choices=["minmax", "percentile", "kl", "mse"])
    quant.add_argument("--percentile", type=float, help="percentile kept by --method percentile")
    quant.add_argument("--weight-bits", type=int, default=8)
    quant.add_argument("--weight-rounding", choices=["nearest", "least_squares"],
                       help="least_squares: each layer's integer weights chosen together to minimise its output "
                            "error against float (default: nearest)")
    quant.add_argument("--output-headroom", type=_headroom, metavar="H",
                       help="quantize the model's outputs on (1 + H) times their range, H from 0 to 1, or "
                            "'cross_validated' (the default: chosen from the calibration samples)")
    quant.add_argument("--per-tensor", action="store_true", help="one weight scale per tensor (default: per channel)")
    quant.add_argument("--symmetric", action="store_true", help="symmetric activations (zero point 0)")
    quant.add_argument("--power-of-two", action="store_true", help="power-of-two scales (shifts, no multipliers)")
    quant.add_argument("--rounding", choices=["tflite", "onnxruntime"],
                       help="requantization rounding (default: the source format's runtime)")
    quant.add_argument("--accumulator-bits", type=int, default=32)
    quant.add_argument("--overflow", default="wrap", choices=["wrap", "saturate"])
    quant.add_argument("--avoid-overflow", action="store_true",
                       help="widen weight scales until no accumulator overflows on the calibration set")
    quant.add_argument("--fallback-budget", type=float, metavar="DB",
                       help="keep in float the layers whose quantization costs the output more than DB dB of SQNR")
    quant.add_argument("--global-scale", type=float, help="every activation on the range [-g, g]")
    quant.add_argument("--no-float-reference", action="store_true",
                       help="do not run the float model beside calibration: less work, no bias correction and no "
                            "SQNR in the report")
    quant.add_argument("--reference-samples", type=_reference_samples, default=argparse.SUPPRESS, metavar="N",
                       help="run the float model (bias correction, SQNR) on the first N calibration samples, or "
                            "'all' (default: QConfig.reference_samples)")
    quant.add_argument("--skip", action="append", help="layer kept float (name or index; repeatable)")
    quant.add_argument("--preset", default=DEFAULT_PRESET, help=PRESET_HELP)
    quant.add_argument("--json", action="store_true", help="print the report as JSON")
    quant.add_argument("--plot", help="write a PNG of per-layer SQNR (needs matplotlib)")
    quant.add_argument("-o", "--output", required=True, help="the quantized model (.npuq)")
    quant.set_defaults(func=cmd_quantize)
    insp = sub.add_parser("inspect", help="validate and print a command stream")
    insp.add_argument("stream")
    insp.set_defaults(func=cmd_inspect)
    sim = sub.add_parser("sim", help="execute a command stream, or a whole model compiled by npu compile (its "
                                     "directory), on the simulator")
    sim.add_argument("stream", help="a .npucmd file, or the directory npu compile wrote")
    sim.add_argument("--input", action="append", help="NAME=FILE.npy for an input buffer")
    sim.add_argument("--random-inputs", action="store_true", help="fill inputs not given with random values")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--output", help="write outputs to this .npz (of the first inference)")
    sim.set_defaults(func=cmd_sim)
    for command in (run, sim):
        command.add_argument("--repeat", type=int, default=1, metavar="N",
                             help="run N inferences, each on new random inputs unless given (default: 1); a "
                                  "progress bar follows them on a terminal")
        command.add_argument("--trace", metavar="FILE.json",
                             help="write a Chrome trace of every command on its engine (open it in "
                                  "https://ui.perfetto.dev)")
        command.add_argument("--plot", metavar="FILE.png",
                             help="write a PNG of per-layer cycles by engine against the roofline (needs "
                                  "matplotlib)")
    from npu_backend.distributed.commands import add_commands  # eval, sweep

    add_commands(sub, PRESET_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NpuError as exc:
        print(f"npu: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. head: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
