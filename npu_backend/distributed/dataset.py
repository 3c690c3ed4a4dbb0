"""An evaluation data set: the model's inputs batched on axis 0, optional labels, cut into shards.

Data comes as an ``.npz`` file (or the same arrays in a dict): one array per model input (for a single-input
model the array named like the input, the one ``key`` names, or the only array besides the labels), each a batch
of samples on axis 0, and optionally an array of integer class labels.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import NpuError


@dataclass(frozen=True)
class InputSpec:
    """One model input as the data must match it (read from the module's ``main``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, module) -> tuple["InputSpec", ...]:
        return tuple(cls(p.name, tuple(int(d) for d in p.ty.shape.values), str(p.ty.dtype))
                     for p in module["main"].params)


@dataclass(frozen=True)
class Shard:
    """Samples ``start .. start + len`` of every input, each array ``(samples, *input shape)``."""

    index: int
    start: int
    inputs: tuple[np.ndarray, ...] = field(repr=False)

    @property
    def units(self) -> int:
        """Samples in the shard (what a progress bar counts)."""
        return len(self.inputs[0])


@dataclass(frozen=True)
class Dataset:
    inputs: tuple[np.ndarray, ...] = field(repr=False)
    """One array per model input: ``(samples, *input shape)`` in the input's dtype."""
    labels: np.ndarray | None = field(repr=False)
    """Integer class per sample, or None."""
    source: str

    @property
    def size(self) -> int:
        return len(self.inputs[0])

    def digest(self) -> str:
        """SHA-256 of the inputs (shapes, dtypes, bytes): what a resume directory's shards were computed on."""
        h = hashlib.sha256()
        for array in self.inputs:
            h.update(f"{array.dtype}{array.shape}".encode())
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()

    def shards(self, size: int) -> list[Shard]:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise NpuError(f"the shard size must be a positive integer, got {size!r}")
        return [Shard(k, start, tuple(a[start:start + size] for a in self.inputs))
                for k, start in enumerate(range(0, self.size, size))]


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file (or a single ``.npy``, under its stem)."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".npy":
            return {path.stem: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        why = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
        raise NpuError(f"cannot read data {path}: {why}") from None
    except AttributeError:  # np.load returned a single array for a file named .npz
        raise NpuError(f"cannot read data {path}: not an .npz archive") from None


def _batched(array: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    """``array`` as ``(samples, *spec.shape)``: a batch on axis 0 of the input, or of its batch-1 slices."""
    shape = spec.shape
    if array.ndim == len(shape) + 1 and array.shape[1:] == shape:
        batched = array
    elif shape and shape[0] == 1 and array.ndim == len(shape) and array.shape[1:] == shape[1:]:
        batched = array.reshape((array.shape[0], *shape))
    else:
        raise NpuError(f"{where} has shape {list(array.shape)}; the model's input {spec.name} is {list(shape)} "
                       "(give a batch of them on axis 0)")
    return _as_dtype(batched, spec, where)


def _as_dtype(array: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    target = np.dtype(spec.dtype)
    if array.dtype == target:
        return array
    if array.dtype.kind not in "iuf":
        raise NpuError(f"{where} is {array.dtype}, not numbers")
    if target.kind == "f":
        return array.astype(target)
    if array.dtype.kind == "f":
        raise NpuError(f"{where} is {array.dtype} but the model's input {spec.name} is {target}: quantize the data "
                       "first, or evaluate the float model")
    info = np.iinfo(target)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise NpuError(f"{where} holds values outside {target} (the model's input {spec.name})")
    return array.astype(target)


def _labels(arrays: dict, key: str, samples: int, source: str) -> np.ndarray:
    if key not in arrays:
        raise NpuError(f"{source} has no array {key!r} for the labels (it holds {', '.join(arrays)})")
    labels = np.asarray(arrays[key])
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise NpuError(f"labels {key!r} must be one integer class per sample, got {labels.dtype}{list(labels.shape)}")
    if len(labels) != samples:
        raise NpuError(f"labels {key!r} hold {len(labels)} classes for {samples} samples")
    return labels.astype(np.int64)


def load_dataset(data, specs: tuple[InputSpec, ...], key: str | None = None, labels: str | None = None,
                 limit: int | None = None) -> Dataset:
    """The evaluation data for a model whose inputs are ``specs``.

    ``data`` is a path to an ``.npz`` (or ``.npy``), a dict of arrays, or an array (single-input models). ``key``
    picks a single input's array; ``labels`` names the array of classes; ``limit`` keeps the first samples.
    """
    if isinstance(data, (str, Path)):
        source, arrays = str(data), read_arrays(data)
    elif isinstance(data, dict):
        source, arrays = "the data", dict(data)
    elif isinstance(data, np.ndarray):
        source, arrays = "the data", {key or specs[0].name: data}
    else:
        raise NpuError(f"data must be an .npz path, a dict of arrays or an array, not {type(data).__name__}")
    if key is not None and key == labels:
        raise NpuError(f"array {key!r} cannot be both the input and the labels")
    candidates = {k: v for k, v in arrays.items() if k != labels}
    if len(specs) == 1:
        spec = specs[0]
        pick = key or (spec.name if spec.name in candidates else None) or (
            next(iter(candidates)) if len(candidates) == 1 else None)
        if pick not in candidates:
            held = ", ".join(arrays) or "nothing"
            raise NpuError(f"{source} holds {held}: say which array is the input with --key" if key is None
                           else f"{source} has no array {key!r} (it holds {held})")
        inputs = (_batched(np.asarray(candidates[pick]), spec, f"array {pick!r}"),)
    else:
        missing = [s.name for s in specs if s.name not in candidates]
        if missing:
            raise NpuError(f"{source} lacks arrays for inputs {', '.join(missing)} (one array per model input, "
                           "by name)")
        inputs = tuple(_batched(np.asarray(candidates[s.name]), s, f"array {s.name!r}") for s in specs)
    sizes = {len(a) for a in inputs}
    if len(sizes) != 1:
        raise NpuError(f"the model's inputs hold different numbers of samples ({sorted(sizes)})")
    samples = sizes.pop()
    label_values = _labels(arrays, labels, samples, source) if labels is not None else None
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise NpuError(f"the sample limit must be a positive integer, got {limit!r}")
        inputs = tuple(a[:limit] for a in inputs)
        label_values = None if label_values is None else label_values[:limit]
    if len(inputs[0]) == 0:
        raise NpuError(f"{source} holds no samples")
    return Dataset(inputs, label_values, source)
