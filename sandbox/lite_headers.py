"""Lighter copies of torch's factory headers, made from the installed torch, for CUDA builds.

nvcc parses a ``.cu`` file's headers three times (cudafe++, cicc, then the host compiler), so
every header a candidate's torch wrapper pulls in costs three times over. The minimal prelude
(``MINIMAL_TORCH_PRELUDE``, here) includes ``ATen/core/Tensor.h`` and the factories a
wrapper calls (``torch::empty_like`` ...). Each factory header ``ATen/ops/<op>.h`` is small, but
it includes ``ATen/Context.h``, ``ATen/DeviceGuard.h`` and other headers its inline functions do
not use, which more than doubles what is parsed (on a 2-core host: 243k preprocessed lines and
7.3 s against 161k lines and 3.0 s).

This module writes, once per torch install, a directory that shadows those factory headers:
the same file, read from the installed torch, with only the includes its functions need. The
functions are torch's own text, so a call binds to the same overload and the same operator as
with the full header. Only the minimal try of a build puts the directory on the include path;
a candidate that needs a name the lighter headers lack fails that try and is built again with
fuller headers (see ``sandbox.header_tries``).

The directory also holds ``kernelloop/lean_binding.h``, what the minimal try puts at the top of
the C++ file that ``load_inline`` generates in place of ``torch/extension.h``: pybind11 with
torch's tensor casters (``torch/csrc/utils/pybind.h``), ``torch::wrap_pybind_function`` and the
minimal prelude. Precompiled, it is a quarter of the size of ``torch/extension.h``'s and the C++
file builds in a third of the time (4.4 s against 11-12 s on a 2-core host).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from sandbox.pyglue import RAW_BINDING, raw_binding_text

FACTORY_OPS = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
               "full_like")
# What the factories' inline functions use: Tensor, TensorOptions and its helpers, Scalar.
KEPT_INCLUDES = {"ATen/core/Tensor.h", "c10/core/Scalar.h", "c10/core/TensorOptions.h", "c10/util/Deprecated.h",
                 "optional", "string_view"}
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"].*$', re.MULTILINE)
# What a kernel wrapper needs: tensors and their methods, the usual factories, TORCH_CHECK,
# AT_DISPATCH; ``torch::`` names resolve to ATen's as torch/types.h makes them.
MINIMAL_TORCH_PRELUDE = "\n".join([
    "#include <ATen/core/Tensor.h>", "#include <ATen/Dispatch.h>", "#include <c10/cuda/CUDAStream.h>",
    *(f"#include <ATen/ops/{op}.h>" for op in FACTORY_OPS),
    "namespace torch { using namespace at; }"])
LEAN_BINDING = {"cuda": "kernelloop/lean_binding.h", "cpu": "kernelloop/lean_binding_cpu.h"}
VERSION = 3


def minimal_prelude(device: str) -> str:
    """``MINIMAL_TORCH_PRELUDE`` for builds with CUDA sources (``cuda``) or C++ sources only (``cpu``:
    no CUDA stream header, which needs the CUDA toolkit's headers)."""
    return "\n".join(line for line in MINIMAL_TORCH_PRELUDE.splitlines() if device == "cuda" or "c10/cuda/" not in line)


def lean_binding_text(device: str) -> str:
    """The lean binding header for builds with CUDA sources (``cuda``) or C++ sources only (``cpu``)."""
    guard = f"KERNELLOOP_LEAN_BINDING_{device.upper()}_H"
    return "\n".join([f"#ifndef {guard}", f"#define {guard}", "#include <torch/csrc/utils/pybind.h>",
                      "#include <torch/csrc/Exceptions.h>", minimal_prelude(device), "#endif", ""])


def lighten(text: str, op: str) -> Optional[str]:
    """``ATen/ops/<op>.h`` without the includes its functions do not need; None where the file
    does not look like torchgen's (then the real header is used)."""
    includes = _INCLUDE_RE.findall(text)
    if f"ATen/ops/{op}_ops.h" not in includes or "ATen/core/Tensor.h" not in includes:
        return None
    return _INCLUDE_RE.sub(lambda m: m.group(0) if m.group(1) in KEPT_INCLUDES or m.group(1).startswith("ATen/ops/")
                           else f"// kernelloop: dropped #include <{m.group(1)}>", text)


def lite_include_dir(cache_root: Path) -> Optional[str]:
    """The shadow include directory for the installed torch (made on first use, atomically), or
    None where torch's headers are not as expected."""
    from torch.utils import cpp_extension as ce

    import torch

    ops_dir = Path(ce._TORCH_PATH) / "include" / "ATen" / "ops"
    sources = {op: ops_dir / f"{op}.h" for op in FACTORY_OPS}
    if not all(p.is_file() for p in sources.values()):
        return None
    key = hashlib.sha256(repr((VERSION, lean_binding_text("cuda"), raw_binding_text("cuda", minimal_prelude("cuda")),
                               torch.__version__, str(ops_dir),
                               [p.stat().st_mtime_ns for p in sources.values()])).encode()).hexdigest()[:16]
    root = Path(cache_root) / "lite-headers" / key
    if (root / ".done").exists():
        return str(root)
    if (root / "unusable").exists():
        return None
    tmp = root.with_name(f".{key}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "ATen" / "ops").mkdir(parents=True)
    for op, path in sources.items():
        light = lighten(path.read_text(), op)
        if light is None:
            root.mkdir(parents=True, exist_ok=True)
            (root / "unusable").write_text(f"{path} is not a torchgen factory header as expected\n")
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        (tmp / "ATen" / "ops" / f"{op}.h").write_text(light)
    (tmp / "kernelloop").mkdir()
    for device, header in LEAN_BINDING.items():
        (tmp / header).write_text(lean_binding_text(device))
    for device, header in RAW_BINDING.items():
        (tmp / header).write_text(raw_binding_text(device, minimal_prelude(device)))
    (tmp / ".done").touch()
    try:
        os.replace(tmp, root)       # another process may have made it first: theirs is the same
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root) if (root / ".done").exists() else None
