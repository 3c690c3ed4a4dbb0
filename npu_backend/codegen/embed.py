"""Command streams embedded in a C source module: the runtime module ``relax.ext.npu`` returns.

Why C source: a TVM runtime module that must survive ``export_library`` and ``tvm.runtime.load_module``
in another process has to be either compiled into the shared library or binary-serialized by a C++
loader. A Python package can only do the former. Each NPU region becomes one exported function,
``__tvm_ffi_<symbol>`` (tvm-ffi's symbol convention, which the Relax VM finds among the library's
functions), holding its serialized stream as a string literal (gcc takes a 3 MB literal in well under
a second; the same bytes as an initializer list take several). The function forwards to the driver,
the global function ``npu_backend.run_stream`` that ``import npu_backend`` registers (the
hardware's driver, here the simulator): the module carries its streams, the process supplies the
device. In-process, ``relax.VirtualMachine`` builds the same library through ``Executable.jit``, so a
C compiler is needed, as it is for TVM's own ``export_library``.
"""

from __future__ import annotations

import hashlib
import re

import tvm

from ..errors import InternalError
from ..runtime import DRIVER

_PRELUDE = """\
#include <stdint.h>
#include <tvm/ffi/c_api.h>
#ifdef __cplusplus
#define NPU_EXPORT extern "C" TVM_FFI_DLL_EXPORT
#else
#define NPU_EXPORT TVM_FFI_DLL_EXPORT
#endif

#define NPU_EXTRA_ARGS 4
#define NPU_MAX_TENSORS {max_tensors}

/* Forward one region call to the driver: (symbol, stream SHA-256, stream address, stream size, tensors...).
   The stream goes by address: the driver copies its bytes only for a digest it has not prepared yet. */
static int npu_call(const char* symbol, const char* digest, const char* stream, int64_t size,
                    const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {{
  static TVMFFIObjectHandle driver = 0;
  TVMFFIAny packed[NPU_EXTRA_ARGS + NPU_MAX_TENSORS];
  int32_t i;
  if (!driver) {{
    TVMFFIByteArray name = {{"{driver}", {driver_length}}};
    if (TVMFFIFunctionGetGlobal(&name, &driver) != 0) return -1;
    if (!driver) {{
      TVMFFIErrorSetRaisedFromCStr("RuntimeError",
          "no NPU driver in this process: import npu_backend before running a module with NPU regions");
      return -1;
    }}
  }}
  if (num_args > NPU_MAX_TENSORS) {{
    TVMFFIErrorSetRaisedFromCStr("ValueError", "too many tensors for an NPU region");
    return -1;
  }}
  for (i = 0; i < NPU_EXTRA_ARGS; ++i) {{
    packed[i].zero_padding = 0;
    packed[i].v_int64 = 0;
  }}
  packed[0].type_index = kTVMFFIRawStr;
  packed[0].v_c_str = symbol;
  packed[1].type_index = kTVMFFIRawStr;
  packed[1].v_c_str = digest;
  packed[2].type_index = kTVMFFIOpaquePtr;
  packed[2].v_ptr = (void*)stream;
  packed[3].type_index = kTVMFFIInt;
  packed[3].v_int64 = size;
  for (i = 0; i < num_args; ++i) packed[NPU_EXTRA_ARGS + i] = args[i];
  return TVMFFIFunctionCall(driver, packed, NPU_EXTRA_ARGS + num_args, result);
}}
"""

_REGION = """
static const char stream_{index}[] =
{literal};

NPU_EXPORT int __tvm_ffi_{symbol}(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {{
  (void)self;
  return npu_call("{symbol}", "{digest}", stream_{index}, (int64_t)(sizeof(stream_{index}) - 1), args, num_args,
                  result);
}}
"""

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ESCAPED = [f"\\x{b:02x}" for b in range(256)]
_LINE = 64
"""Bytes per line of a string literal (adjacent literals concatenate: one literal, readable source)."""


def _literal(data: bytes) -> str:
    lines = ['"' + "".join(map(_ESCAPED.__getitem__, data[i:i + _LINE])) + '"'
             for i in range(0, len(data), _LINE)]
    return "\n".join(lines) or '""'


def stream_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def embed_streams(streams: dict[str, bytes], max_tensors: int) -> tvm.runtime.Module:
    """A C source module with one exported function per region symbol, each carrying its stream.

    ``max_tensors`` bounds a region's inputs plus outputs (the forwarding buffer lives on the stack).
    """
    parts = [_PRELUDE.format(driver=DRIVER, driver_length=len(DRIVER), max_tensors=max(1, max_tensors))]
    for index, (symbol, data) in enumerate(streams.items()):
        if not _SYMBOL.match(symbol):
            raise InternalError(f"region symbol {symbol!r} is not a C identifier")
        parts.append(_REGION.format(index=index, symbol=symbol, digest=stream_digest(data),
                                    literal=_literal(data)))
    create = tvm.get_global_func("runtime.CSourceModuleCreate")
    return create("".join(parts), "c", list(streams), [])
