"""The on-disk cache of compiled calibration kernels: later processes load what the first compiled, a changed
kernel or target is compiled afresh, and a cache that cannot be used never stops a kernel from running."""

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import tvm

from npu_backend.quantization import kernel_cache, kernels


def _module(lanes_scale: float = 1.0):
    """A small kernel: ``out = x * lanes_scale`` over ``n`` float32 values (the constant makes distinct TIR)."""
    from tvm.script import tirx as T

    @T.prim_func(check_well_formed=False)
    def scaled(x_h: T.handle, o_h: T.handle):
        n = T.int64()
        X = T.match_buffer(x_h, (n,), "float32")
        O = T.match_buffer(o_h, (n,), "float32")
        for i in range(n):
            O[i] = X[i] * T.float32(lanes_scale)

    return tvm.IRModule({"scaled": scaled.with_attr("global_symbol", "scaled")})


TARGET = tvm.target.Target("llvm")


def _apply(func, values):
    import tvm_ffi

    out = np.empty_like(values)
    func(*(tvm_ffi.from_dlpack(a) for a in (values, out)))
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def _libraries(directory):
    return sorted(p.name for p in directory.glob("*.so")) if directory.exists() else []


def _no_compiling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the cache holds the kernel")

    monkeypatch.setattr(tvm, "compile", refuse)


def test_a_kernel_compiled_once_is_loaded_from_disk_afterwards(cache, monkeypatch):
    values = np.arange(10, dtype=np.float32)
    first = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    assert _libraries(cache) == [kernel_cache.library_path(cache, "scaled", _module(2.0), TARGET).name]
    _no_compiling(monkeypatch)
    loaded = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(loaded, values), values * 2)
    np.testing.assert_array_equal(_apply(first, values), values * 2)


def test_a_changed_kernel_or_target_is_a_different_library(cache):
    kernel_cache.compiled("scaled", _module(2.0), TARGET)
    changed = kernel_cache.compiled("scaled", _module(3.0), TARGET)
    np.testing.assert_array_equal(_apply(changed, np.ones(4, np.float32)), np.full(4, 3, np.float32))
    other_target = tvm.target.Target({"kind": "llvm", "mattr": ["-fma"]})
    assert (kernel_cache.library_path(cache, "scaled", _module(2.0), TARGET)
            != kernel_cache.library_path(cache, "scaled", _module(2.0), other_target))
    assert len(_libraries(cache)) == 2  # no temporary file left beside them


def test_a_damaged_library_is_compiled_again_and_replaced(cache):
    path = kernel_cache.library_path(cache, "scaled", _module(2.0), TARGET)
    cache.mkdir(parents=True)
    path.write_bytes(b"\x7fELF not really a library")
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))
    assert path.stat().st_size > 1000  # a real library in its place
    tvm.runtime.load_module(str(path))


def test_an_unusable_cache_directory_still_runs_the_kernel(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"  # a directory cannot be made under a file, not even by root
    blocker.write_text("")
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(blocker / "kernels"))
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))
    assert list(tmp_path.iterdir()) == [blocker]


def test_a_failed_export_leaves_no_file_and_still_runs(cache, monkeypatch):
    real_compile = tvm.compile

    def without_export(*args, **kwargs):
        library = real_compile(*args, **kwargs)

        class NoLinker:  # as on a machine without a C compiler
            def __getitem__(self, name):
                return library[name]

            def export_library(self, path):
                open(path, "wb").write(b"half")
                raise RuntimeError("no C compiler")

        return NoLinker()

    monkeypatch.setattr(tvm, "compile", without_export)
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))
    assert list(cache.iterdir()) == []  # neither the library nor its temporary


@pytest.mark.parametrize("value", ["off", "0", "", "None"])
def test_the_cache_can_be_turned_off(value, tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, value)
    monkeypatch.chdir(tmp_path)
    assert kernel_cache.cache_dir() is None
    kernel_cache.compiled("scaled", _module(2.0), TARGET)
    assert list(tmp_path.iterdir()) == []


def test_the_default_directory_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "npu_backend" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / ".cache" / "npu_backend" / "kernels"


def test_calibration_kernels_go_through_the_cache(cache, monkeypatch):
    """A calibration kernel compiled in one process is loaded by the next (here: after the in-process table is
    emptied), and computes the same."""
    monkeypatch.setattr(kernels, "_compiled", {})
    values = np.random.default_rng(0).integers(-128, 128, 1000).astype(np.int8)
    want = kernels.byte_counts(values)
    assert any(name.startswith("byte_counts-") for name in _libraries(cache))
    monkeypatch.setattr(kernels, "_compiled", {})
    _no_compiling(monkeypatch)
    np.testing.assert_array_equal(kernels.byte_counts(values), want)
    np.testing.assert_array_equal(want, np.bincount(values.view(np.uint8), minlength=256))


@pytest.mark.parametrize("part", ["tvm", "tvm_ffi", "machine"])
def test_the_key_covers_tvm_tvm_ffi_and_the_machine(part, monkeypatch):
    import platform

    import tvm_ffi

    before = kernel_cache.key(_module(2.0), TARGET)
    if part == "machine":
        monkeypatch.setattr(platform, "machine", lambda: "elsewhere")
    else:
        monkeypatch.setattr(tvm if part == "tvm" else tvm_ffi, "__version__", "0.0.0-other")
    assert kernel_cache.key(_module(2.0), TARGET) != before


def test_an_unreadable_cache_entry_still_runs_the_kernel(cache, monkeypatch):
    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", refuse)
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))


def test_no_home_directory_still_runs_the_kernel(monkeypatch):
    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(kernel_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", homeless)
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no file owners on this platform")
@pytest.mark.parametrize("loosened", ["file", "directory"])
def test_a_library_others_may_write_is_not_loaded(loosened, cache, monkeypatch):
    kernel_cache.compiled("scaled", _module(2.0), TARGET)
    path = kernel_cache.library_path(cache, "scaled", _module(2.0), TARGET)
    target = path if loosened == "file" else cache
    target.chmod(target.stat().st_mode | 0o020)  # group-writable
    compiles = []
    real_compile = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda *a, **k: compiles.append(1) or real_compile(*a, **k))
    func = kernel_cache.compiled("scaled", _module(2.0), TARGET)
    assert compiles == [1]
    np.testing.assert_array_equal(_apply(func, np.ones(3, np.float32)), np.full(3, 2, np.float32))


def test_the_cache_directory_is_private(cache):
    kernel_cache.compiled("scaled", _module(2.0), TARGET)
    assert cache.stat().st_mode & 0o077 == 0


def test_a_killed_exports_temporary_is_removed_later(cache):
    cache.mkdir(parents=True)
    stale, fresh = cache / ".scaled-abc-stale.so", cache / ".scaled-abc-fresh.so"
    for leftover in (stale, fresh):
        leftover.write_bytes(b"part of a library")
    old = time.time() - 2 * kernel_cache.STALE_SECONDS
    os.utime(stale, (old, old))
    kernel_cache.compiled("scaled", _module(2.0), TARGET)
    assert not stale.exists() and fresh.exists()  # one being written by another process right now stays


def test_the_first_failure_is_logged_as_a_warning(cache, monkeypatch, caplog):
    monkeypatch.setattr(kernel_cache, "_warned", False)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("a file where the directory should be")
    with caplog.at_level(logging.DEBUG, logger=kernel_cache.__name__):
        kernel_cache.compiled("scaled", _module(2.0), TARGET)
        kernel_cache.compiled("scaled", _module(3.0), TARGET)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG]
    assert kernel_cache.CACHE_ENV in caplog.records[0].getMessage()
