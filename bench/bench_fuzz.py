"""Fuzz the command-stream reader: mutated streams must end in NpuError or in the original's exact outputs.

Why: a stream file is the hand-off between compiler and hardware team; a corrupted one must never crash the
simulator, hang it, or run and silently produce other numbers. Two populations of mutants of a real
compiled region (a small conv -> add -> pool -> sigmoid network, so every unit is exercised):

* ``corrupted``: random byte flips, truncations and extensions of the file, as storage or transfer would do.
  The format-2 header's SHA-256 must refuse every one before parsing: 0 silent differences expected.
* ``resealed``: the same mutations of the flatbuffer payload with the checksum recomputed, as a buggy writer
  would produce. These reach the parser, validator and kernels; a mutant may be a different valid program
  (e.g. a changed weight byte), so a different output is not a defect here, but a crash or a hang is.

Each mutant runs under a wall-clock limit (a hang is a mutant that exceeds it). Prints counts and rates:

    python bench/bench_fuzz.py [--mutants 10000] [--seed 0] [--limit-seconds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import signal
import time

import numpy as np

from simulator import NpuError, decode_stream, encode_stream, run_stream, validate_stream
from simulator.isa import BufferKind
from simulator.stream import _HEADER, HEADER_BYTES


class Hang(Exception):
    pass


def _stream_bytes() -> bytes:
    """A small compiled region holding a conv, an add, a max pool and a sigmoid table."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import npu_backend
    from relax_idioms import ConvIdiom, f32, i32
    from tvm import relax

    idiom = ConvIdiom(x_shape=(1, 8, 8, 8), out_channels=8)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(idiom.x_shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(idiom._body(bb, x, relax.const(idiom.weights)))
            a = bb.emit(relax.op.dequantize(y, f32(0.05), i32(5), axis=0))
            b = bb.emit(relax.op.dequantize(y, f32(0.05), i32(5), axis=0))
            s = bb.emit(relax.op.quantize(relax.op.add(a, b), f32(0.1), i32(5), axis=0, out_dtype="int8"))
            m = bb.emit(relax.op.nn.max_pool2d(s, (2, 2), (2, 2), layout="NHWC"))
            d = bb.emit(relax.op.dequantize(m, f32(0.1), i32(5), axis=0))
            gv = bb.emit_output(relax.op.quantize(relax.op.sigmoid(d), f32(1 / 256), i32(-128), axis=0,
                                                  out_dtype="int8"))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get())
    (stream,) = npu_backend.codegen.lower_module(mod).values()
    return encode_stream(stream)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    roll = rng.random()
    if roll < 0.1:
        mutated = mutated[:rng.randrange(len(mutated))]
    elif roll < 0.15:
        mutated += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(mutated)


def _reseal(payload: bytes) -> bytes:
    header = _HEADER.pack(b"NPUS", 2, 0, len(payload))
    return header + hashlib.sha256(header + payload).digest() + payload


def _outcome(data: bytes, inputs_of, reference: dict) -> str:
    try:
        stream = decode_stream(data)
        validate_stream(stream, stream.config)
        outputs, _ = run_stream(stream, inputs_of(stream))
    except NpuError:
        return "refused"
    same = outputs.keys() == reference.keys() and all(np.array_equal(outputs[k], reference[k]) for k in outputs)
    return "same" if same else "different"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=10000, help="per population")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-seconds", type=int, default=5)
    args = parser.parse_args()

    data = _stream_bytes()
    original = decode_stream(data)
    rng = np.random.default_rng(args.seed)
    inputs = {b.name: rng.integers(-128, 128, b.shape).astype(b.dtype) for _, b in original.buffers_of(BufferKind.INPUT)}

    def inputs_of(stream):
        """The original inputs where a mutant still declares them alike; zeros for any other declaration."""
        def value(b):
            x = inputs.get(b.name)
            return x if x is not None and x.shape == tuple(b.shape) and str(x.dtype) == b.dtype else \
                np.zeros(b.shape, b.dtype)
        return {b.name: value(b) for _, b in stream.buffers_of(BufferKind.INPUT)}

    reference, _ = run_stream(original, inputs)

    def on_alarm(signum, frame):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)
    print(f"stream: {len(data)} bytes, {len(original.commands)} commands; {args.mutants} mutants per population")
    for population, make in (("corrupted", lambda r: _mutate(data, r)),
                             ("resealed", lambda r: _reseal(_mutate(data[HEADER_BYTES:], r)))):
        counts = dict.fromkeys(("refused", "same", "different", "crash", "hang"), 0)
        crashes = []
        mutant_rng = random.Random(f"{args.seed}-{population}")
        started = time.perf_counter()
        for _ in range(args.mutants):
            mutant = make(mutant_rng)
            signal.alarm(args.limit_seconds)
            try:
                counts[_outcome(mutant, inputs_of, reference)] += 1
            except Hang:
                counts["hang"] += 1
            except Exception as exc:  # noqa: BLE001 - this is what the bench counts
                counts["crash"] += 1
                crashes.append(f"{type(exc).__name__}: {exc}")
            finally:
                signal.alarm(0)
        seconds = time.perf_counter() - started
        silent = counts["different"] if population == "corrupted" else 0
        print(f"{population:>9}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f"; silent different outputs {silent}; {seconds:.1f} s ({1e3 * seconds / args.mutants:.2f} ms/mutant)")
        for line in sorted(set(crashes))[:10]:
            print(f"           crash: {line}")


if __name__ == "__main__":
    main()
