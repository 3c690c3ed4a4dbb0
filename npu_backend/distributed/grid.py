"""The design space of ``npu sweep``: models x hardware presets x quantization settings, read from a TOML grid.

```toml
models = ["cnn_float.tflite"]            # added to --models; paths relative to this file
presets = ["npu-256", "edge.toml"]       # preset names or configuration files, added to --presets

[[preset]]                               # a configuration written here: NpuConfig fields, 'base' inherits
name = "npu-256-64k"
base = "npu-256"
sram_bytes = 65536

[[quantization]]                         # QConfig fields; float models are quantized with each setting
name = "w8"
[[quantization]]
name = "w4-mse"
weight_bits = 4
calibration = "mse"

[calibration]                            # the samples float models are calibrated on
data = "digits_split.npz"
key = "calibration"
limit = 50

seed = 0                                 # of the random input each combination is timed on
```

Every value is checked when the file is read (presets by :class:`~simulator.config.NpuConfig` itself, settings
by :class:`~npu_backend.quantization.QConfig`), so a bad grid fails with one line before any work starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from simulator.config import PRESETS, NpuConfig, get_config, load_config

from ..errors import ConfigError, NpuError

KEYS = ("models", "presets", "preset", "quantization", "calibration", "seed")
CALIBRATION_KEYS = ("data", "key", "limit")


@dataclass(frozen=True)
class Calibration:
    data: Path
    key: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class Grid:
    models: tuple[Path, ...] = ()
    presets: tuple[NpuConfig, ...] = ()
    quantizations: tuple[tuple[str, dict], ...] = ()
    """(name, QConfig fields without ``preset``): the sweep sets the preset of each combination."""
    calibration: Calibration | None = None
    seed: int = 0
    source: str = field(default="the command line", compare=False)


def resolve_preset(value, where: str, base: Path | None = None) -> NpuConfig:
    """A preset name, or a ``.toml``/``.json`` configuration file (relative to ``base``), as a value: workers
    receive the numbers, not a name only this process has registered."""
    if isinstance(value, NpuConfig):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: a preset is a name or a configuration file, not {value!r}")
    if value in PRESETS:
        return PRESETS[value]
    if value.endswith((".toml", ".json")):
        path = Path(value)
        return load_config(path if base is None or path.is_absolute() else base / path, register=False)
    return get_config(value)


def quantization_setting(name: str, fields: dict, where: str) -> tuple[str, dict]:
    """One named QConfig setting, validated by QConfig itself (lists become the tuples it takes)."""
    from ..quantization import QConfig

    if "preset" in fields:
        raise ConfigError(f"{where}: 'preset' is set by the sweep (list presets under 'presets' or [[preset]])")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    known = {f.name for f in dataclasses.fields(QConfig)} - {"preset"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown QConfig field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        QConfig(**fields)
    except NpuError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return name, fields


def _table(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table")
    return value


def _strings(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings")
    return value


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file (the format is in this module's docstring)."""
    path = Path(path)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        values = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
    base = path.parent
    models = tuple(base / m for m in _strings(values.get("models", []), f"{path}: models"))
    presets = [resolve_preset(p, f"{path}: presets", base) for p in _strings(values.get("presets", []),
                                                                             f"{path}: presets")]
    tables = values.get("preset", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{path}: write presets as [[preset]] tables")
    for i, table in enumerate(tables):
        where = f"{path}: [[preset]] #{i + 1}"
        if "name" not in _table(table, where):  # else 'base' would lend its name to other numbers
            raise ConfigError(f"{where} needs a name")
        presets.append(NpuConfig.from_mapping(table, where=where))
    settings = values.get("quantization", [])
    if not isinstance(settings, list):
        raise ConfigError(f"{path}: write quantization settings as [[quantization]] tables")
    quantizations = []
    for i, table in enumerate(settings):
        fields = dict(_table(table, f"{path}: [[quantization]] #{i + 1}"))
        name = fields.pop("name", f"q{i}")
        quantizations.append(quantization_setting(str(name), fields, f"{path}: [[quantization]] {name!r}"))
    names = [n for n, _ in quantizations]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: two [[quantization]] settings share a name ({', '.join(names)})")
    calibration = None
    if "calibration" in values:
        table = _table(values["calibration"], f"{path}: [calibration]")
        extra = sorted(set(table) - set(CALIBRATION_KEYS))
        if extra or "data" not in table:
            raise ConfigError(f"{path}: [calibration] takes data (required), key and limit"
                              + (f"; unknown: {', '.join(extra)}" if extra else ""))
        limit = table.get("limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"{path}: [calibration] limit must be a positive integer")
        calibration = Calibration(base / str(table["data"]), table.get("key"), limit)
    seed = values.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{path}: seed must be an integer")
    return Grid(models, tuple(presets), tuple(quantizations), calibration, seed, str(path))
