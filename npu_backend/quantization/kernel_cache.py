"""The calibration kernels (:mod:`.kernels`), compiled once per machine rather than once per process.

LLVM takes 3.4 s to compile the seven kernels a MobileNetV2 calibration uses (1.1-1.2 s for each depthwise one),
paid again by every process: every ``npu quantize``, every first calibration in a notebook. That was a third of a
fresh process's whole calibration of MobileNetV2-224 (11.2 s against 6.4 s for the next one in the same process).
So each compiled kernel is exported as a shared library into a cache directory and loaded from there (well under a
millisecond) by later processes.

A library is named by a hash of everything its code depends on: the kernel's TIR (its printed TVMScript, which
holds the loop, the types and the sizes' symbols), the target (the CPU and the attributes such as ``-fma``) and
TVM's version. A kernel whose definition changes is therefore compiled afresh; stale libraries are simply never
read again. A library is written under a temporary name and renamed into place, so a reader never sees half of
one, and two processes that compile the same kernel at once both write a whole file.

The cache is a convenience, never a condition: where the directory cannot be written, or the library cannot be
exported (``export_library`` links with the system's C compiler, which a machine may lack), or a cached file
does not load, the kernel is compiled in memory as it was before. Where: :data:`CACHE_ENV` if set (``off``
turns the cache off), else ``$XDG_CACHE_HOME/npu_backend/kernels``, else ``~/.cache/npu_backend/kernels``. The
libraries are machine code loaded into the process, so the directory must be as trusted as the installed
package itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

CACHE_ENV = "NPU_BACKEND_CACHE"
"""Environment variable naming the cache directory; ``off`` (or ``0``, ``none``, empty) disables the cache."""

_DISABLED = ("", "0", "off", "none", "false")


def cache_dir() -> Path | None:
    """Where compiled kernels are kept (None: nowhere, compile in memory)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _DISABLED else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "npu_backend" / "kernels"


def library_path(directory: Path, name: str, module, target) -> Path:
    """The file that holds ``module`` (an IRModule with the one function ``name``) compiled for ``target``."""
    import tvm

    key = hashlib.sha256("\n".join((tvm.__version__, str(target), module.script())).encode()).hexdigest()
    return directory / f"{name}-{key[:24]}.so"


def compiled(name: str, module, target):
    """The function ``name`` of ``module`` built for ``target``: loaded from the cache when it is there, else
    compiled (and written to the cache when it can be)."""
    import tvm

    directory = cache_dir()
    if directory is None:
        return tvm.compile(module, target=target)[name]
    path = library_path(directory, name, module, target)
    if path.is_file():
        with contextlib.suppress(Exception):  # damaged, or not a library this TVM can load: compile it again
            return tvm.runtime.load_module(str(path))[name]
    library = tvm.compile(module, target=target)
    _store(library, path)
    return library[name]


def _store(library, path: Path) -> None:
    """Export ``library`` to ``path`` whole or not at all (see the module docstring); a failure only means the
    next process compiles the kernel again."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=path.parent)
        os.close(handle)
        library.export_library(temporary)
        os.replace(temporary, path)
        temporary = None
    except Exception:  # no C compiler, a read-only or full disk: the kernel still runs, compiled in memory
        pass
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
