"""A KernelBench-style CUDA source split in two: its kernels through nvcc without torch's headers,
its torch wrappers compiled as C++ (``sandbox.header_tries``' first try).

A candidate that writes its torch wrapper in the ``.cu`` file makes nvcc pass over torch's core
headers three times (``gcc -E``, ``cudafe++``, the host compile: about 6 of the file's 8 s, see
docs/builds.md). Split, the kernels' file has no torch in it and builds in about a second, and the
wrappers join the C++ file, which takes its precompiled binding header. The wrapper's launches
``k<<<grid, block[, smem[, stream]]>>>(args)`` become calls of a launch stub written beside the
kernel, with the kernel's own parameter list, so each argument is converted to the parameter's type
exactly where the launch converted it, and the stub launches with the same configuration.

The split is made only where the text is plainly of that shape; ``split_cuda`` returns None for
anything else (and the build goes on with the whole file through nvcc):

* conditional preprocessing (``#if``/``#ifdef``), namespaces, ``extern "C"`` blocks at the top level;
* templated or overloaded kernels launched from host code, kernels named by host code other than
  in a launch (``cudaFuncSetAttribute(k, ...)``), a launch of something that is not a kernel of the
  file;
* device code (kernels, ``__device__`` functions and variables) that names torch (``torch::``,
  ``at::``, ``c10::``, ``AT_``/``TORCH_`` macros), or that comes after host code it might use.

Where the split builds, the kernels are the same source compiled by the same nvcc with the same
flags; where it does not, the next try builds the file whole, so a split never decides a verdict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from sandbox.cpp_text import matching, skip_comment, skip_literal

# includes that only the host side (the torch wrapper) may read, and those only device code needs
_HOST_INCLUDE_RE = re.compile(r'#\s*include\s*[<"](?:torch/|ATen/|c10/|pybind11/|Python\.h)')
_DEVICE_INCLUDE_RE = re.compile(r'#\s*include\s*[<"](?:cub/|thrust/|cooperative_groups|mma\.h|cuda/|cute/|cutlass/'
                                r'|cuda_pipeline|cuda_awbarrier)')
_TORCH_NAME_RE = re.compile(r"\b(?:torch|at|c10)\s*::|\bTORCH_|\bAT_|\bC10_")
_CUDA_QUALIFIER_RE = re.compile(r"\b__(?:global|device|constant|shared|managed)__\b")
_LAUNCH_RE = re.compile(r"\b([A-Za-z_]\w*)\s*(<(?!<<)[^;{}()]*?>)?\s*<<<")
# headers every split file starts with: what torch's headers would have brought the kernels
DEVICE_PRELUDE = ("#include <cuda.h>", "#include <cuda_runtime.h>", "#include <cstddef>", "#include <cstdint>",
                  "#include <cmath>", "#include <cfloat>", "#include <climits>", "#include <limits>",
                  "#include <algorithm>", "#include <type_traits>")
HOST_PRELUDE = ("#include <cuda_runtime.h>",)
STUB_PREFIX = "kl_launch_"


@dataclass(frozen=True)
class Item:
    text: str
    kind: str            # pp | decl | block


@dataclass(frozen=True)
class Kernel:
    name: str
    params: str          # the parameter list as written, between the parentheses
    args: str            # the parameters' names, comma-separated


@dataclass(frozen=True)
class Split:
    device: str          # the kernels' file: prelude, shared items, device items, launch stubs
    host: str            # for the C++ file: shared items, the stubs' declarations, the wrappers
    kernels: tuple[str, ...]


def items(src: str) -> Optional[list[Item]]:
    """The top-level items of a C++/CUDA source, comments dropped: preprocessor lines, declarations
    ending with ``;`` and definitions ending with a brace group (and a ``;`` after it, if any); None
    where the braces do not balance or a raw string literal makes the scan unsure."""
    out: list[Item] = []
    buf: list[str] = []
    depth, i, n = 0, 0, len(src)
    at_line_start = True
    while i < n:
        c = src[i]
        if c == "/":
            j = skip_comment(src, i)
            if j is not None:
                if j < 0:
                    return None
                if src.startswith("/*", i):
                    buf.append(" ")
                i = j
                continue
        if c == "#" and at_line_start and depth == 0 and not "".join(buf).strip():
            j = i
            while True:
                k = src.find("\n", j)
                k = n if k < 0 else k
                if k > j and src[k - 1] == "\\":
                    j = k + 1
                    continue
                break
            out.append(Item(src[i:k].strip(), "pp"))
            buf, i = [], k
            continue
        if c == "R" and src.startswith('R"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            return None
        if c in "\"'":
            j = skip_literal(src, i)
            buf.append(src[i:j])
            i = j
            at_line_start = False
            continue
        if c == "\n":
            at_line_start = True
        elif not c.isspace():
            at_line_start = False
        buf.append(c)
        i += 1
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                # a definition; a type's closing "};" (or "} name;") is one item with it
                j = i
                while j < n and src[j] in " \t\r\n":
                    j += 1
                head = "".join(buf).split("{", 1)[0]
                if re.search(r"\b(?:struct|class|union|enum)\b", head) and "(" not in head.split("=")[0]:
                    k = src.find(";", j)
                    if k < 0:
                        return None
                    buf.append(src[i:k + 1])
                    i = k + 1
                out.append(Item("".join(buf).strip(), "block"))
                buf = []
        elif c == ";" and depth == 0:
            out.append(Item("".join(buf).strip(), "decl"))
            buf = []
    if depth != 0 or "".join(buf).strip():
        return None
    return out


def _head(item: Item) -> str:
    return item.text.split("{", 1)[0] if item.kind == "block" else item.text


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, parentheses and angle brackets of templates."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _kernel(item: Item) -> Optional[Kernel]:
    """A non-template ``__global__`` function's name and parameters; None where it is not one the
    split can stub (templated, unnamed or defaulted parameters, a parameter pack)."""
    head = _head(item).strip()
    if re.match(r"template\b", head) or not head.endswith(")"):
        return None
    depth, i = 0, len(head) - 1
    while i >= 0:                        # the parameter list: the last parenthesised group
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            break
        i -= 1
    m = re.search(r"([A-Za-z_]\w*)\s*$", head[:max(i, 0)])
    if i < 0 or not m:
        return None
    name, params = m.group(1), head[i + 1:-1].strip()
    names = []
    for p in ([] if params in ("", "void") else _split_top_level(params)):
        if "=" in p or "..." in p or "[" in p or "(" in p:
            return None
        pm = re.search(r"([A-Za-z_]\w*)\s*$", p)
        if not pm or (len(p.split()) < 2 and "*" not in p and "&" not in p):
            return None
        names.append(pm.group(1))
    return Kernel(name, params, ", ".join(names))


def _rewrite_launches(text: str, kernels: dict[str, Kernel]) -> Optional[str]:
    """``text`` with each ``k<<<cfg>>>(args)`` replaced by ``kl_launch_k(grid, block, smem, stream,
    args)``; None where a launch is of something else or does not parse."""
    out, pos = [], 0
    for m in _LAUNCH_RE.finditer(text):
        if m.start() < pos:
            continue
        name = m.group(1)
        if m.group(2) or name not in kernels:
            return None
        cfg_start = m.end() - 3
        cfg_end = matching(text, cfg_start, "<<<", ">>>")
        if cfg_end < 0:
            return None
        cfg = _split_top_level(text[cfg_start + 3:cfg_end - 3])
        if not 2 <= len(cfg) <= 4 or not all(cfg):
            return None
        j = cfg_end
        while j < len(text) and text[j].isspace():
            j += 1
        if j >= len(text) or text[j] != "(":
            return None
        args_end = matching(text, j, "(", ")")
        if args_end < 0:
            return None
        args = text[j + 1:args_end - 1].strip()
        smem = cfg[2] if len(cfg) > 2 else "0"
        stream = cfg[3] if len(cfg) > 3 else "0"
        call = f"{STUB_PREFIX}{name}({cfg[0]}, {cfg[1]}, {smem}, {stream}{', ' + args if args else ''})"
        out.append(text[pos:m.start()] + call)
        pos = args_end
    out.append(text[pos:])
    result = "".join(out)
    return None if "<<<" in result else result


def _stub_params(k: Kernel) -> str:
    return f"dim3 kl_grid, dim3 kl_block, size_t kl_smem, cudaStream_t kl_stream{', ' + k.params if k.params and k.params != 'void' else ''}"


def split_cuda(source: str) -> Optional[Split]:
    """``source`` split into the kernels' file and the wrappers' C++ (the module's rules), or None."""
    parsed = items(source)
    if not parsed:
        return None
    device, host = [], []               # (text, for the device file, for the host part)
    kernels: dict[str, Kernel] = {}
    for it in parsed:
        head = _head(it)
        if it.kind == "pp":
            if re.match(r"#\s*(?:if|ifdef|ifndef|elif|else|endif)\b", it.text):
                return None
            if re.match(r"#\s*include\b", it.text):
                if _HOST_INCLUDE_RE.match(it.text):
                    host.append(it.text)
                elif _DEVICE_INCLUDE_RE.match(it.text):
                    device.append(it.text)
                else:
                    device.append(it.text)
                    host.append(it.text)
            elif re.match(r"#\s*pragma\s+once\b", it.text):
                continue
            else:                        # #define, #undef, #pragma: both sides (a macro expands only where used)
                device.append(it.text)
                host.append(it.text)
            continue
        if re.search(r"\bnamespace\b", head) and not re.match(r"\s*using\s+namespace\b", head):
            return None
        if re.match(r'\s*extern\s+"C', head):
            return None
        if _CUDA_QUALIFIER_RE.search(head):
            if _TORCH_NAME_RE.search(it.text):
                return None
            device.append(it.text)
            if re.search(r"\b__global__\b", head) and it.kind == "block":
                k = _kernel(it)
                if k is not None and k.name in kernels:
                    return None          # overloaded kernels: a stub could take the other's arguments
                if k is not None:
                    kernels[k.name] = k
                    device.append(f"void {STUB_PREFIX}{k.name}({_stub_params(k)}) {{\n"
                                  f"  {k.name}<<<kl_grid, kl_block, kl_smem, kl_stream>>>({k.args});\n}}")
                    host.append(f"void {STUB_PREFIX}{k.name}({_stub_params(k)});")
            continue
        if _TORCH_NAME_RE.search(it.text) or re.match(r"\s*using\s+namespace\b", head):
            if re.match(r"\s*using\s+namespace\s+(?!(?:torch|at|c10)\b)", head):
                device.append(it.text)
            host.append(it.text)
            continue
        is_type = re.match(r"\s*(?:typedef\b|using\s+\w+\s*=|(?:template\s*<[^{;]*>\s*)?(?:struct|class|union)\b"
                           r"|enum\b)", head) and (it.kind == "decl" or "(" not in head.split("{")[0]
                                                   or re.match(r"\s*(?:typedef|using)\b", head))
        is_const = re.match(r"\s*(?:static\s+)?(?:constexpr|const)\b", head) and "(" not in head.split("=")[0]
        if is_type or is_const:
            device.append(it.text)
            host.append(it.text)
            continue
        host.append(it.text)           # a host function, or a host variable
    if not kernels:
        return None
    host_text = "\n".join(host)
    rewritten = _rewrite_launches(host_text, kernels)
    if rewritten is None or STUB_PREFIX not in rewritten.replace(f"void {STUB_PREFIX}", ""):
        return None                    # no launch from host code: nothing the split would save
    # a kernel named in host code other than in its launch (a function pointer) stays whole; a
    # host function of the same name (KernelBench's wrappers often overload their kernel's) may
    # name itself where it is defined or declared
    body = re.sub(rf"\b{STUB_PREFIX}\w+", "", rewritten)
    for k in kernels:
        own = re.compile(rf"^[^;{{}}()]*\b{re.escape(k)}\s*\(", re.MULTILINE)
        rest = "\n".join(own.sub("", piece, count=1) for piece in re.split(r"[;{}]", body))
        if re.search(rf"\b{re.escape(k)}\b", rest):
            return None
    return Split(device="\n".join([*DEVICE_PRELUDE, *device, ""]),
                 host="\n".join([*HOST_PRELUDE, rewritten, ""]), kernels=tuple(kernels))
