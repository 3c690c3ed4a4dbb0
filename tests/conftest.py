import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
FIXTURES = TESTS / "fixtures"


def tflite_manifest(tvm_imports: bool = True) -> list[dict]:
    """Fixture models TVM's importer accepts (or, with False, the ones it rejects)."""
    models = json.loads((FIXTURES / "tflite" / "MANIFEST.json").read_text())["models"]
    return [m for m in models if m["tvm_imports"] == tvm_imports]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
