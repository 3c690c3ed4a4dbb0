import json
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
FIXTURES = TESTS / "fixtures"


def tflite_manifest(imports: bool = True) -> list[dict]:
    """Fixture models npu_backend.load_tflite imports (or, with False, the ones it rejects): those TVM's own
    importer accepts, and those whose operators npu_backend's converter adds (npu_backend.tflite_import);
    16x8 models (MANIFEST ``activation_type`` int16) only if all their operators are 16x8 ones it imports."""
    from tvm.relax.frontend.tflite.tflite_frontend import OperatorConverter

    from npu_backend.tflite_import import NpuOperatorConverter

    added = NpuOperatorConverter._SUPPORTED_QUANTIZED_OPS - OperatorConverter._SUPPORTED_QUANTIZED_OPS

    def imported(m: dict) -> bool:
        if m.get("activation_type", "int8") == "int16":
            return set(m["operators"]) <= NpuOperatorConverter.SIXTEEN_BY_EIGHT_OPS
        return m["tvm_imports"] or set(m["operators"]) <= added

    models = json.loads((FIXTURES / "tflite" / "MANIFEST.json").read_text())["models"]
    loaded = [m for m in models if imported(m)]
    return loaded if imports else [m for m in models if m not in loaded]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Compiled calibration kernels go to a directory of the test session's own, not the user's cache: the
    suite compiles what it tests, and leaves nothing behind."""
    from npu_backend.quantization.kernel_cache import CACHE_ENV

    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("kernel-cache"))
    yield
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
