"""A model as it travels to workers: its file's bytes, loaded once per process.

A compiled module cannot leave the process that compiled it (its command streams are registered there), and a
cluster node does not see the driver's files. So a task carries the model file's bytes (put once in Ray's
object store, shared by every task) and each process writes them to a private file once and imports them once;
every later task in the process finds the module (and what was built from it) in this module's caches.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelImportError

_FILES: dict[str, Path] = {}
_MODULES: dict[str, object] = {}
_DIRECTORY: list[tempfile.TemporaryDirectory] = []


@dataclass(frozen=True)
class ModelFile:
    """A model file's name and bytes; ``sha256`` identifies it in caches and resume directories."""

    name: str
    data: bytes = field(repr=False)
    sha256: str

    @classmethod
    def read(cls, path: str | Path) -> "ModelFile":
        from ..frontend import LOADERS

        path = Path(path)
        if path.suffix.lower() not in LOADERS:
            raise ModelImportError(f"{path.name}: unknown model type {path.suffix!r} (known: {', '.join(LOADERS)})")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelImportError(f"cannot read {path}: {exc.strerror}") from None
        return cls(path.name, data, hashlib.sha256(data).hexdigest())

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix.lower()

    def path(self) -> Path:
        """This process's copy of the file (written on first use)."""
        path = _FILES.get(self.sha256)
        if path is None:
            if not _DIRECTORY:
                _DIRECTORY.append(tempfile.TemporaryDirectory(prefix="npu-models-"))
            path = Path(_DIRECTORY[0].name) / f"{self.sha256[:16]}{self.suffix}"
            path.write_bytes(self.data)
            _FILES[self.sha256] = path
        return path

    def load(self):
        """The Relax module (``npu_backend.load_model``), imported once per process."""
        module = _MODULES.get(self.sha256)
        if module is None:
            from ..frontend import load_model

            module = _MODULES[self.sha256] = load_model(self.path())
        return module

    def source(self) -> "ModelFile":
        """The model a reference runtime runs: for a ``.npuq`` file, the float model it was quantized from."""
        if self.suffix != ".npuq":
            return self
        from ..quantization.stored import float_model_bytes

        data, suffix = float_model_bytes(self.path())
        return ModelFile(f"{Path(self.name).stem}.float{suffix}", data, hashlib.sha256(data).hexdigest())
