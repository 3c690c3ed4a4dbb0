"""npu sweep / npu_backend.sweep in this process: the figures of each combination against single runs and an
independent build, quantization settings from a grid, the grid's validation, the outputs, peak SRAM."""

import csv
import io
import json

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.cli import main
from npu_backend.codegen import lower_module
from npu_backend.distributed.grid import load_grid
from npu_backend.distributed.sweep import peak_sram_bytes
from npu_backend.errors import NpuError
from npu_backend.quantization import QConfig, calibrate
from simulator.config import PRESETS, ConfigError
from simulator.isa import (Command, CommandStream, DmaCopy, FeatureMap, MemorySpace, Opcode, Pooling)

DIGITS = FIXTURES / "digits"
MODELS = [DIGITS / "cnn_tflite_ptq.tflite", DIGITS / "mobilenet_tflite_ptq.tflite"]
PRESET_NAMES = ["npu-256", "npu-1024", "npu-tiny"]


@pytest.fixture(scope="module")
def swept():
    return npu_backend.sweep(MODELS, PRESET_NAMES, workers=0)


def test_rows_are_models_times_presets_in_order(swept):
    assert [(r["model"], r["preset"]) for r in swept.rows] == [(m.name, p) for m in MODELS for p in PRESET_NAMES]
    assert all(r["error"] is None and r["npu_ops"] > 0 and r["quantization"] == "-" for r in swept.rows)


def test_sweep_equals_six_single_runs(swept):
    singles = [row for m in MODELS for p in PRESET_NAMES
               for row in npu_backend.sweep([m], [p], workers=0).figures()]
    assert [{**row, "pareto": None} for row in swept.figures()] == [{**row, "pareto": None} for row in singles]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.stem)
def test_figures_match_an_independent_build(swept, model):
    """Build each combination with the public API, profile one inference, lower the streams ourselves."""
    mod = npu_backend.load_model(model)
    x = np.random.default_rng(7).standard_normal((1, 8, 8, 1)).astype(np.float32)
    for name in PRESET_NAMES:
        preset = PRESETS[name]
        vm = relax.VirtualMachine(npu_backend.build(mod, preset=preset), tvm.cpu())
        with npu_backend.profile() as prof:
            vm["main"](tvm.runtime.tensor(x))
        row = next(r for r in swept.rows if (r["model"], r["preset"]) == (model.name, name))
        assert (row["cycles"], row["macs"], row["dram_bytes"]) == (prof.total_cycles, prof.total_macs,
                                                                   prof.total_dram_bytes)
        assert row["mac_utilisation"] == prof.total_macs / (prof.total_cycles * preset.mac_rows * preset.mac_cols)
        assert row["latency_us"] == prof.total_cycles / preset.clock_mhz
        streams = lower_module(npu_backend.partition_for_npu(mod, preset))
        assert 0 < row["peak_sram_bytes"] == max(peak_sram_bytes(s) for s in streams.values()) <= preset.sram_bytes


def test_bigger_array_fewer_cycles_and_the_pareto_column(swept):
    for model in MODELS:
        rows = {r["preset"]: r for r in swept.rows if r["model"] == model.name}
        assert rows["npu-tiny"]["cycles"] > rows["npu-256"]["cycles"] > rows["npu-1024"]["cycles"]
        assert all(r["pareto"] for r in rows.values())  # each preset buys its cycles with more MAC units
    by_sram = npu_backend.sweep(MODELS[:1], PRESET_NAMES, workers=0, axis="sram")
    cnn = {r["preset"]: r for r in by_sram.rows}
    assert cnn["npu-256"]["peak_sram_bytes"] == cnn["npu-1024"]["peak_sram_bytes"]  # a tiny model fits any SRAM
    assert [cnn[p]["pareto"] for p in PRESET_NAMES] == [False, True, False]  # npu-1024: same SRAM, fewer cycles


def test_peak_sram_is_the_highest_byte_any_command_touches():
    dma_in = DmaCopy(MemorySpace.DRAM, 0, 0, MemorySpace.SRAM, 0, 100, row_bytes=30, rows=3, dst_stride=40)
    pool = Pooling(FeatureMap(300, 2, 2, 4), FeatureMap(200, 1, 1, 4), 2, 2, 2, 2, 0, 0, 0, 0)
    dma_out = DmaCopy(MemorySpace.SRAM, 0, 1000, MemorySpace.DRAM, 1, 0, row_bytes=8)

    def peak(*payloads):
        commands = tuple(Command(Opcode.DMA_COPY if isinstance(p, DmaCopy) else Opcode.MAX_POOL2D, p)
                         for p in payloads)
        return peak_sram_bytes(CommandStream("s", PRESETS["npu-256"], (), commands))

    assert peak(dma_in) == 100 + 2 * 40 + 30
    assert peak(dma_in, pool) == 300 + 16
    assert peak(dma_in, pool, dma_out) == 1008


GRID = """
models = ["{model}"]
presets = ["npu-256"]
[[preset]]
name = "npu-256-acc16"
base = "npu-256"
accumulator_bits = 16
[[quantization]]
name = "w8"
[[quantization]]
name = "w4"
weight_bits = 4
[calibration]
data = "{data}"
key = "calibration"
limit = 12
"""


def test_float_model_is_quantized_per_setting_on_each_presets_accumulators(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(GRID.format(model=DIGITS / "cnn_float.tflite", data=DIGITS / "digits_split.npz"))
    result = npu_backend.sweep(grid=grid, workers=0)
    assert [(r["preset"], r["quantization"]) for r in result.rows] == [
        ("npu-256", "w8"), ("npu-256", "w4"), ("npu-256-acc16", "w8"), ("npu-256-acc16", "w4")]
    calibration = np.load(DIGITS / "digits_split.npz")["calibration"][:12]
    acc16 = load_grid(grid).presets[1]
    calibrated = calibrate(npu_backend.load_model(DIGITS / "cnn_float.tflite"), calibration, QConfig(
        preset=acc16, accumulator_bits=16))
    assert calibrated.npu_config == acc16  # the preset's own accumulators, not QConfig's default 32 bits
    vm = relax.VirtualMachine(npu_backend.build(calibrated.module, preset=acc16), tvm.cpu())
    with npu_backend.profile() as prof:
        vm["main"](tvm.runtime.tensor(calibration[:1]))
    row = result.rows[2]
    assert (row["cycles"], row["overflows"]) == (prof.total_cycles, prof.total_overflows)
    assert row["overflows"] > 0 and result.rows[0]["overflows"] == 0
    assert all(r["calibrate_seconds"] > 0 for r in result.rows)


def test_command_writes_csv_json_and_plot(tmp_path, capsys):
    edge = tmp_path / "edge.toml"
    edge.write_text('base = "npu-256"\nsram_bytes = 65536\n')
    out = tmp_path / "out"
    assert main(["sweep", "--models", str(MODELS[0]), "--presets", "npu-tiny", str(edge), "-o", str(out),
                 "--workers", "0"]) == 0
    printed = capsys.readouterr().out
    assert "edge" in printed and f"written: {out / 'sweep.csv'}" in printed
    rows = list(csv.DictReader(io.StringIO((out / "sweep.csv").read_text())))
    figures = json.loads((out / "sweep.json").read_text())
    assert [r["preset"] for r in rows] == [r["preset"] for r in figures["rows"]] == ["npu-tiny", "edge"]
    assert [int(r["cycles"]) for r in rows] == [r["cycles"] for r in figures["rows"]]
    assert figures["rows"][1]["sram_bytes"] == 65536 and figures["pareto_axis"] == "mac_units"
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text, message", [
    ("modles = []", "unknown key(s) modles"),
    ("presets = 'npu-256'", "presets must be a list of strings"),
    ("presets = ['npu-9']", "unknown NPU preset 'npu-9'"),
    ("[[preset]]\nbase = 'npu-256'\nsram_bytes = 65536", "[[preset]] #1 needs a name"),
    ("[[preset]]\nname = 'x'\nbase = 'npu-256'\nsram_bytes = 1000", "sram_bytes 1000 is not a multiple of sram_align"),
    ("[[preset]]\nname = 'x'\nbase = 'npu-256'\nmac_colums = 4", "unknown field(s) mac_colums"),
    ("[[quantization]]\nweight_bits = 9", "QConfig.weight_bits: 9 is not an integer from 2 to 8"),
    ("[[quantization]]\nwieght_bits = 4", "unknown QConfig field(s) wieght_bits"),
    ("[[quantization]]\npreset = 'npu-256'", "'preset' is set by the sweep"),
    ("[[quantization]]\nname = 'a'\n[[quantization]]\nname = 'a'", "share a name"),
    ("[calibration]\nkey = 'x'", "[calibration] takes data (required)"),
    ("seed = 'zero'", "seed must be an integer"),
    ("presets = [", "not valid TOML"),
])
def test_bad_grid_is_one_line(tmp_path, text, message, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_grid(grid)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert main(["sweep", "--models", str(MODELS[0]), "--grid", str(grid), "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("npu: error: ")


def test_what_cannot_be_swept_is_refused(tmp_path):
    with pytest.raises(NpuError, match="nothing to sweep: give presets"):
        npu_backend.sweep(MODELS, [], workers=0)
    with pytest.raises(NpuError, match="cnn_float.tflite is a float model: give"):
        npu_backend.sweep([DIGITS / "cnn_float.tflite"], ["npu-256"], workers=0)
    with pytest.raises(NpuError, match="two presets share a name"):
        npu_backend.sweep(MODELS, ["npu-256", "npu-256"], workers=0)
    with pytest.raises(NpuError, match="unknown Pareto axis"):
        npu_backend.sweep(MODELS, ["npu-256"], workers=0, axis="area")


def test_resumed_sweep_reuses_finished_combinations(swept, tmp_path):
    first = npu_backend.sweep(MODELS, PRESET_NAMES, workers=0, resume=tmp_path)
    assert first.figures() == swept.figures() and len(list(tmp_path.glob("task-*.json"))) == 6
    (tmp_path / "task-000004.json").unlink()
    again = npu_backend.sweep(MODELS, PRESET_NAMES, workers=0, resume=tmp_path)
    assert again.figures() == swept.figures()
    unchanged = [i for i in range(6) if i != 4]
    assert [again.rows[i]["compile_seconds"] for i in unchanged] == [first.rows[i]["compile_seconds"]
                                                                     for i in unchanged]  # read back, not rerun
    with pytest.raises(NpuError, match="holds results of other work"):
        npu_backend.sweep(MODELS, PRESET_NAMES[:2], workers=0, resume=tmp_path)
