"""An int8 MobileNetV2 TFLite model with seeded random weights, for the benchmarks: any width and resolution.

Built exactly as the bundled fixture tests/fixtures/tflite/mobilenet_v2_035_96.tflite is (Keras MobileNetV2,
``classifier_activation=None``, BatchNorm statistics measured on random inputs, full-integer conversion with
per-channel weights: ``randomize_batchnorm`` and ``convert`` of scripts/make_tflite_fixtures.py), so the
1.0-224 model the issue's figures quote is one command away. It needs TensorFlow (the ``fixtures`` extra);
the files (4 MB for 1.0-224) go to a cache directory, never to the repository.

    python bench/mobilenet_v2_tflite.py [--alpha 1.0] [--resolution 224] [-o out.tflite]

The benchmarks run on the project's environment, which has no TensorFlow: they call :func:`cached_model`,
which runs this script under a Python that has it (``--tf-python``) the first time and reuses the file after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tests" / "fixtures" / "tflite" / "mobilenet_v2_035_96.tflite"


def cache_dir() -> Path:
    """Where the benchmarks keep what they build or install: ``$NPU_BENCH_CACHE``, else
    ``$XDG_CACHE_HOME/npu-bench`` (``~/.cache/npu-bench``)."""
    explicit = os.environ.get("NPU_BENCH_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "npu-bench"


def model_name(alpha: float, resolution: int) -> str:
    return f"mobilenet_v2_{round(alpha * 100):03d}_{resolution}"


def cached_model(alpha: float, resolution: int, tf_python: str | None) -> Path:
    """The model's path: the bundled fixture for 0.35-96, else the cached file, built on first use by running
    this script under ``tf_python`` (a Python with TensorFlow)."""
    if (alpha, resolution) == (0.35, 96):
        return BUNDLED
    path = cache_dir() / f"{model_name(alpha, resolution)}.tflite"
    if path.exists():
        return path
    if tf_python is None:
        raise SystemExit(f"{path} is not built yet and building it needs TensorFlow: pass --tf-python with a Python "
                         f"that has the 'fixtures' extra (pip install -e '.[fixtures]')")
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([tf_python, str(Path(__file__).resolve()), "--alpha", str(alpha), "--resolution", str(resolution),
                    "-o", str(path)], check=True, cwd=ROOT)
    return path


def build(alpha: float, resolution: int) -> bytes:
    """The int8 TFLite flatbuffer (imports TensorFlow), seeded from the model's name as the fixtures are
    (``seed_of``): a rebuild gives the same bytes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tflite_fixtures as fixtures
    import tensorflow as tf

    seed = fixtures.seed_of(model_name(alpha, resolution))
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.applications.MobileNetV2(input_shape=(resolution, resolution, 3), alpha=alpha, weights=None,
                                              classifier_activation=None, classes=1000)
    return fixtures.convert(fixtures.randomize_batchnorm(model, seed), seed, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="where to write the model (default: the cache directory)")
    args = parser.parse_args()
    out = args.output or cache_dir() / f"{model_name(args.alpha, args.resolution)}.tflite"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    tmp.write_bytes(build(args.alpha, args.resolution))
    tmp.replace(out)
    print(out)


if __name__ == "__main__":
    main()
