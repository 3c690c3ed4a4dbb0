import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
FIXTURES = TESTS / "fixtures"


def tflite_manifest() -> list[dict]:
    return json.loads((FIXTURES / "tflite" / "MANIFEST.json").read_text())["models"]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
