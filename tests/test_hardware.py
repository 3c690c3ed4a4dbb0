"""Hardware as a value: streams carry the configuration's numbers, validation compares them, presets come
from code or files, and the compiler plans against whatever configuration it is given."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from layer_streams import layer_stream, random_params
from npu_backend.params import NpuOp
from relax_idioms import ConvIdiom
from simulator import ConfigError, StreamError, decode_stream, encode_stream, get_config, run_stream, validate_stream
from simulator.config import PRESETS, NpuConfig, load_config, register_preset, resolve_config

BASE = get_config("npu-256")
CUSTOM = dataclasses.replace(BASE, name="lab-npu", sram_bytes=8 * 1024, mac_rows=4, output_lanes=2)


def _stream(config):
    p = random_params(np.random.default_rng(5), NpuOp.CONV2D, (1, 12, 12, 8), out_channels=16)
    return layer_stream(p, config)


def test_a_stream_carries_its_hardware_numbers_and_fingerprint():
    """A configuration that is no preset survives encoding whole; the decoder checks the fingerprint."""
    decoded = decode_stream(encode_stream(_stream(CUSTOM)))
    assert decoded.config == CUSTOM and decoded.config.fingerprint == CUSTOM.fingerprint
    assert "lab-npu" not in PRESETS


def test_validation_compares_values_not_names():
    stream = _stream(CUSTOM)
    validate_stream(stream, dataclasses.replace(CUSTOM, name="same-chip-other-label"))
    impostor = dataclasses.replace(BASE, name="lab-npu")  # the name the stream says, other numbers
    with pytest.raises(StreamError, match="mac_rows: 4 != 16; sram_bytes: 8192 != 262144; output_lanes: 2 != 8"):
        validate_stream(stream, impostor)
    with pytest.raises(StreamError, match="mac_rows: 4 != 16"):
        run_stream(stream, {"ifm": np.zeros((1, 12, 12, 8), np.int8)}, impostor)


def test_the_stream_runs_on_its_own_configuration_by_default():
    stream = _stream(CUSTOM)
    _, stats = run_stream(encode_stream(stream), {"ifm": np.zeros((1, 12, 12, 8), np.int8)})
    assert stats.config == CUSTOM


def test_a_tampered_fingerprint_or_configuration_is_a_stream_error():
    """The checksum catches any flipped byte of a 2.x stream; 1.3 streams have no checksum, and there the
    fingerprint still ties the numbers to the configuration."""
    for version, message in (((1, 3), "does not match the configuration's numbers"), ((2, 0), "checksum mismatch")):
        data = encode_stream(dataclasses.replace(_stream(CUSTOM), version=version))
        fingerprint = CUSTOM.fingerprint.encode()
        at = data.index(fingerprint)
        flipped = bytearray(data)
        flipped[at] = ord("0") if fingerprint[0:1] != b"0" else ord("1")
        with pytest.raises(StreamError, match=message):
            decode_stream(bytes(flipped))


def test_a_stream_of_format_1_2_names_a_preset():
    old = dataclasses.replace(_stream(BASE), version=(1, 2))
    decoded = decode_stream(encode_stream(old))
    assert decoded.config == BASE and decoded.version == (1, 2)
    unknown = dataclasses.replace(_stream(CUSTOM), version=(1, 2))  # an old writer naming a preset we lack
    with pytest.raises(StreamError, match="unknown NPU preset 'lab-npu'"):
        decode_stream(encode_stream(unknown))


@pytest.mark.parametrize("field, value, message", [
    ("sram_align", 24, "sram_align 24 is not a power of two"),
    ("sram_bytes", 1000, "sram_bytes 1000 is not a multiple of sram_align"),
    ("mac_rows", 0, "mac_rows must be positive"),
    ("mac_rows", 2.5, "mac_rows must be an integer"),
    ("accumulator_bits", 12, r"accumulator_bits must be in \[14, 32\], got 12"),
    ("dram_bytes_per_cycle", float("inf"), "dram_bytes_per_cycle must be positive and finite"),
    ("lut_entries", -256, "lut_entries must be positive"),
])
def test_an_invalid_configuration_names_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(BASE, **{field: value})


def test_presets_register_by_value(monkeypatch):
    monkeypatch.setattr("simulator.config.PRESETS", dict(PRESETS))
    assert register_preset(CUSTOM) is CUSTOM and get_config("lab-npu") == CUSTOM
    assert register_preset(dataclasses.replace(CUSTOM)) == CUSTOM  # the same numbers again: fine
    with pytest.raises(ConfigError, match="preset 'lab-npu' already exists with other values: sram_bytes"):
        register_preset(dataclasses.replace(CUSTOM, sram_bytes=16 * 1024))


def test_configuration_files_inherit_from_a_preset(tmp_path, monkeypatch):
    monkeypatch.setattr("simulator.config.PRESETS", dict(PRESETS))
    toml = tmp_path / "edge.toml"
    toml.write_text('base = "npu-256"\nsram_bytes = 65536\nclock_mhz = 800\n')
    config = load_config(toml)
    assert (config.name, config.sram_bytes, config.clock_mhz, config.mac_rows) == ("edge", 65536, 800, 16)
    assert get_config("edge") == config and resolve_config(str(toml)) == config
    as_json = tmp_path / "same.json"
    as_json.write_text(json.dumps({"name": "edge", **config.values()}))
    assert load_config(as_json, register=False) == config


@pytest.mark.parametrize("text, message", [
    ('base = "npu-256"\nsram_kib = 64\n', "unknown field.s. sram_kib"),
    ('mac_rows = 16\n', "missing field.s. accumulator_bits"),
    ('base = "npu-9000"\n', "unknown NPU preset 'npu-9000'"),
    ('base = "npu-256"\nmac_rows = "sixteen"\n', "mac_rows must be an integer"),
    ('base = "npu-256"\nmac_rows = \n', "not valid TOML"),
])
def test_a_bad_configuration_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, register=False)


def test_partition_and_build_take_an_npu_config():
    """The compiler plans for the configuration it is given: here an 8 KiB SRAM forces tiles, the region
    records the configuration, its stream carries it, and the result equals the one-tile build's."""
    idiom = ConvIdiom(x_shape=(1, 16, 16, 16), out_channels=32)
    small = npu_backend.partition_for_npu(idiom.module(), CUSTOM)
    region = next(f for f in small.functions.values() if f.attrs is not None and f.attrs.get("Codegen") == "npu")
    assert NpuConfig.from_json(str(region.attrs["npu.config"])) == CUSTOM
    assert str(region.attrs["global_symbol"]).startswith("npu_lab_npu_")
    (stream,) = npu_backend.codegen.lower_module(small).values()
    assert stream.config == CUSTOM
    assert sum(c.opcode.name == "CONV2D" for c in stream.commands) > 1
    x = np.random.default_rng(0).integers(-128, 128, idiom.x_shape, dtype=np.int8)
    outputs = []
    for config in (CUSTOM, "npu-256"):
        vm = relax.VirtualMachine(npu_backend.build(idiom.module(), preset=config), tvm.cpu())
        outputs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(*outputs)


def test_the_cli_takes_a_configuration_file(tmp_path, capsys):
    from npu_backend.cli import main

    from conftest import FIXTURES

    model = str(FIXTURES / "tflite" / "conv2d_3x3_s1_same.tflite")
    path = tmp_path / "fast.toml"
    path.write_text('base = "npu-256"\nclock_mhz = 1000\n')
    assert main(["partition", model, "--preset", str(path)]) == 0
    assert "operators on the NPU (fast)" in capsys.readouterr().out
    path.write_text('base = "npu-256"\nclock = 1000\n')
    assert main(["partition", model, "--preset", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("npu: error:") and "unknown field(s) clock" in err[0]
