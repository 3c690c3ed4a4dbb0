"""The ``relax.ext.npu`` codegen: NPU regions -> command streams bound to runtime symbols.

Importing this package registers nothing; :func:`register_codegen` (called by
``import npu_backend``) does.
"""

import tvm

from simulator.stream import encode_stream

from ..runtime import install_stream, is_installed
from .lower import lower_module, lower_region, npu_regions


def npu_codegen(functions, options, constant_names):
    """Called by ``relax.transform.RunCodegen`` with every ``Codegen="npu"`` function.

    Each region becomes a serialized command stream installed under the
    region's symbol, which the Relax VM calls through ``call_dps_packed``.
    The symbol is derived from the region's content and hardware, so a region
    whose stream is already installed (compiled before in this process, or
    loaded from a compiled directory by :func:`npu_backend.compiled.load_compiled`)
    is not lowered again. No TVM runtime module is produced: the streams run on
    the simulator in this process (see README, "Deployment").
    """
    for func in functions:
        symbol = str(func.attrs["global_symbol"])
        if not is_installed(symbol):
            install_stream(symbol, encode_stream(lower_region(func, symbol)))
    return []


def register_codegen() -> None:
    tvm.register_global_func("relax.ext.npu", npu_codegen, override=True)


__all__ = ["npu_codegen", "register_codegen", "lower_module", "lower_region", "npu_regions"]
