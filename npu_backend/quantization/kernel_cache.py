"""The calibration kernels (:mod:`.kernels`), compiled once per machine rather than once per process.

LLVM takes 3.4 s to compile the seven kernels a MobileNetV2 calibration uses (1.1-1.2 s for each depthwise one),
paid again by every process: every ``npu quantize``, every first calibration in a notebook. That was a third of a
fresh process's whole calibration of MobileNetV2-224 (11.2 s against 6.4 s for the next one in the same process).
So each compiled kernel is exported as a shared library into a cache directory and loaded from there (well under a
millisecond) by later processes.

A library is named by a hash of everything its code depends on: the kernel's TIR (its printed TVMScript, which
holds the loop, the types, the constants at full precision and the sizes' symbols), the target (the CPU and the
attributes such as ``-fma``), the machine, TVM's version and tvm-ffi's (a separate package, whose calling
convention the library's entry point follows). A kernel whose definition changes is therefore compiled afresh;
stale libraries are simply never read again. A library is written under a temporary name, flushed to disk and
renamed into place, so a reader never sees part of one, and two processes that compile the same kernel at once
both write a whole file; a temporary left by a killed process is removed by a later store.

The cache is a convenience, never a condition: where the directory cannot be found or written, the library
cannot be exported (``export_library`` links with the system's C compiler, which a machine may lack), or a
cached file does not load, the kernel is compiled in memory as it was before, and the first such failure of a
process is logged (a cache that always fails costs every process the compile time). Where: :data:`CACHE_ENV` if
set (``off`` turns the cache off), else ``$XDG_CACHE_HOME/npu_backend/kernels``, else
``~/.cache/npu_backend/kernels``. The libraries are machine code loaded into the process: one is loaded only if
it and its directory belong to this user and no one else may write them (the directory is made private).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

CACHE_ENV = "NPU_BACKEND_CACHE"
"""Environment variable naming the cache directory; ``off`` (or ``0``, ``none``, empty) disables the cache."""

_DISABLED = ("", "0", "off", "none", "false")
STALE_SECONDS = 3600
"""Age past which a temporary file in the cache is taken for one a killed process left."""

_log = logging.getLogger(__name__)
_warned = False


def cache_dir() -> Path | None:
    """Where compiled kernels are kept (None: nowhere, compile in memory)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _DISABLED else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "npu_backend" / "kernels"


def key(module, target) -> str:
    """What a compiled ``module`` depends on, hashed (see the module docstring)."""
    import tvm
    import tvm_ffi

    parts = (tvm.__version__, tvm_ffi.__version__, platform.machine(), str(target), module.script())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def library_path(directory: Path, name: str, module, target) -> Path:
    """The file that holds ``module`` (an IRModule with the one function ``name``) compiled for ``target``."""
    return directory / f"{name}-{key(module, target)[:24]}.so"


def compiled(name: str, module, target):
    """The function ``name`` of ``module`` built for ``target``: loaded from the cache when it is there, else
    compiled (and written to the cache when it can be)."""
    import tvm

    path = None
    try:
        directory = cache_dir()
        path = None if directory is None else library_path(directory, name, module, target)
        if path is not None and path.is_file() and _trusted(path):
            return tvm.runtime.load_module(str(path))[name]
    except Exception as error:  # noqa: BLE001 - no home directory, an unreadable file, a damaged library
        _cache_failed(f"reading {path or 'the cache directory'}", error)
    library = tvm.compile(module, target=target)
    if path is not None:
        _store(library, path)
    return library[name]


def _trusted(path: Path) -> bool:
    """Whether ``path`` and its directory belong to this user, writable by no one else (where the platform has
    owners); a library anyone else could have written is never loaded."""
    if not hasattr(os, "getuid"):
        return True
    for item in (path.parent, path):
        status = item.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            _cache_failed(f"reading {path}", PermissionError(f"{item} is not this user's alone"))
            return False
    return True


def _store(library, path: Path) -> None:
    """Export ``library`` to ``path`` whole or not at all (see the module docstring); a failure only means the
    next process compiles the kernel again."""
    temporary = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale(path.parent)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=path.parent)
        os.close(handle)
        library.export_library(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, 0o755)
        os.replace(temporary, path)
        temporary = None
    except Exception as error:  # noqa: BLE001 - no C compiler, a read-only or full disk: compiled in memory
        _cache_failed(f"writing {path}", error)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _remove_stale(directory: Path) -> None:
    """Delete the temporaries that processes killed while exporting left behind."""
    now = time.time()
    for leftover in directory.glob(".*.so"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > STALE_SECONDS:
                leftover.unlink()


def _cache_failed(action: str, error: BaseException) -> None:
    """Log the first failure of a process at warning level, later ones at debug."""
    global _warned
    level = logging.DEBUG if _warned else logging.WARNING
    _warned = True
    _log.log(level, "compiled-kernel cache: %s failed (%s: %s); compiling in memory (%s=off turns the cache off)",
             action, type(error).__name__, error, CACHE_ENV)
