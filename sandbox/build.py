"""Building candidates' extensions: content-hashed, cached, lock-safe and fast.

Candidates call ``torch.utils.cpp_extension.load_inline`` at import. Inside a sandbox
worker that function is replaced by ``HookedBuilder.load_inline``, which

* names the extension and its build directory by a hash of everything that shapes the
  binary (sources, functions, flags, torch version, CUDA arch), so an identical candidate
  is a cache hit and costs nothing;
* holds an ``fcntl`` lock per build directory (released by the OS when a killed build
  dies) and clears torch's own ``lock`` baton left by a killed build, so a stale lock
  never hangs a later build;
* applies the build-speed levers: a precompiled ``torch/extension.h`` of its own for the
  C++ side (one per flag set, built atomically), no implicit torch headers on CUDA sources
  that do not use torch, minimal headers in CUDA sources that do (``header_tries``: the
  candidate's own headers again where those do not build), one CUDA architecture (the
  GPU's), bounded ninja jobs;
* imports an already-built extension directly, without asking torch or ninja again;
* records each build (name, seconds, cached, log) and wraps the returned module so the
  harness can count calls into the candidate's own functions.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from filelock import FileLock

from sandbox.header_tries import (EXTENSION_INCLUDE_RE, OWN_NOTE, HeaderTry, binding_tries, header_tries,
                                  next_try)
from sandbox.pch import discard_pch, leading_includes, pch_key, prefix_header, seen_before, torch_cxx_std
from sandbox.pyglue import RAW_BINDING, RAW_NOTE, function_docs, glue_ldflags, module_definition

LOG_CAP = 20_000
_TORCH_USE_RE = re.compile(r"\b(torch::|at::|c10::|TORCH_CHECK|AT_DISPATCH|#\s*include\s*<(torch|ATen|c10)/)")
_PYBIND_NAME_RE = re.compile(r"PYBIND11_MODULE\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,")
# what a compiler says of a precompiled header it found but could not read (a truncated or damaged
# file: GCC stops there, where it skips one made for other flags); never the candidate's error
# (GCC: "error: while reading precompiled header"; not any line naming a .gch, which a candidate's own
# compile error carries beside -Winvalid-pch's notes: that would discard a good header for everyone)
_PCH_UNREADABLE_RE = re.compile(r"while reading precompiled header|precompiled header[^\n]*(?:corrupt|malformed)"
                                r"|(?:cannot|could not) (?:read|open)[^\n]*\.gch\b")     # GCC: "cannot read x.h.gch"
PCH_NOTE = "a precompiled header could not be read: discarded, built again without it"
PREFIX_NOTE = "the C++ file's leading includes precompiled"


_GLOBAL_FN_RE = re.compile(r"__global__\s+(?:static\s+)?[\w:<>\s\*]*?\b([A-Za-z_]\w*)\s*\(")
_LAUNCH_BOUNDS_RE = re.compile(r"__launch_bounds__\s*\([^)]*\)")


def kernel_names(sources: list[str]) -> list[str]:
    """Names of the ``__global__`` functions the sources declare. ``__launch_bounds__(...)`` may
    stand before or after the return type (the builtin generator writes it after), so it is
    removed first rather than matched in one place."""
    return sorted({m.group(1) for s in sources for m in _GLOBAL_FN_RE.finditer(_LAUNCH_BOUNDS_RE.sub(" ", s))})


NVCC_THREADS = "2"


def _with_nvcc_threads(flags: list[str]) -> list[str]:
    """nvcc's flags with ``--threads 2``: nvcc then runs the device compiler (cicc) beside the
    host front end (cudafe++) instead of after it, which cuts a one-kernel build by a fifth
    (15.4 s to 12.6 s on a 2-core host). A candidate's own choice stands."""
    if any(f in ("-t", "--threads") or f.startswith(("-t=", "--threads=")) for f in flags):
        return flags
    return [*flags, "--threads", NVCC_THREADS]


def build_cache_dir() -> Path:
    from kernelloop.paths import cache_dir

    d = cache_dir() / "builds"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cuda_arch_list() -> Optional[str]:
    """The CUDA architectures to build for (torch's ``TORCH_CUDA_ARCH_LIST`` syntax), first of:

    1. ``KERNELLOOP_CUDA_ARCH`` (``--arch``; the sandbox also hands its choice to its workers
       this way, so a build worker, which runs with the GPU hidden, builds what the candidate
       worker will look up);
    2. the GPUs this process sees, each once, e.g. ``9.0a``: only the GPU that runs the code,
       never a container's long default list. Hopper and newer get their arch-specific target
       (``sm_90a``: wgmma, setmaxnreg), since the binary only ever runs on that GPU;
    3. ``TORCH_CUDA_ARCH_LIST``, where no GPU is visible;
    4. None (torch 2.13 then fails with an IndexError, so the sandbox refuses earlier).
    """
    if os.environ.get("KERNELLOOP_CUDA_ARCH"):
        return os.environ["KERNELLOOP_CUDA_ARCH"]
    try:
        import torch

        if torch.cuda.is_available():
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            return ";".join(f"{major}.{minor}{'a' if major >= 9 else ''}" for major, minor in caps)
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or None


def _as_list(x: Any) -> list[str]:
    if x is None:
        return []
    if isinstance(x, str):
        return [x]
    return [str(s) for s in x]


@dataclass
class BuildRecord:
    name: str
    requested_name: str
    directory: str
    seconds: float
    cached: bool
    ok: bool
    log: str = ""
    cuda: bool = False
    kernel_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# Bound at import, before any candidate code runs: whether a profiler records (the profile step's
# labels), and the label itself. A label costs ~6 us per call even with no profiler running.
_profiler_enabled = torch._C._autograd._profiler_enabled
_record_function = torch.profiler.record_function


class CallCounter:
    """Counts calls into candidate extensions; owned by the harness."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_function: dict[str, int] = {}

    def reset(self) -> None:
        self.calls = 0
        self.by_function.clear()


class ExtensionProxy:
    """What a candidate gets back from ``load_inline``: the real module, its calls counted."""

    def __init__(self, module: Any, name: str, counter: CallCounter):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_counter", counter)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._module, attr)
        if not callable(value) or attr.startswith("__"):
            return value
        counter, label = self._counter, f"kernelloop_ext::{attr}"

        def counted(*args, **kwargs):
            counter.calls += 1
            counter.by_function[attr] = counter.by_function.get(attr, 0) + 1
            if not _profiler_enabled():      # timed runs: the call alone (the label cost ~6 us a call)
                return value(*args, **kwargs)
            with _record_function(label):    # the profile step: the candidate's own calls named
                return value(*args, **kwargs)

        counted.__name__ = attr
        return counted

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._module, attr, value)

    def __dir__(self):
        return dir(self._module)


def extension_key(kwargs: dict[str, Any], torch_version: str, arch: Optional[str]) -> str:
    shaping = {k: kwargs.get(k) for k in ("cpp_sources", "cuda_sources", "functions", "extra_cflags",
                                          "extra_cuda_cflags", "extra_ldflags", "extra_include_paths",
                                          "with_cuda", "with_pytorch_error_handling", "is_python_module")}
    shaping["cpp_sources"] = _as_list(shaping["cpp_sources"])
    shaping["cuda_sources"] = _as_list(shaping["cuda_sources"])
    blob = json.dumps({"args": shaping, "torch": torch_version, "arch": arch, "v": 2},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class HookedBuilder:
    """Replaces ``load_inline`` for the lifetime of a worker."""

    def __init__(self, cache_root: Path | None = None, max_jobs: int | None = None,
                 use_pch: bool = True):
        self.cache_root = Path(cache_root) if cache_root else build_cache_dir()
        self.cache_root.mkdir(parents=True, exist_ok=True)
        self.records: list[BuildRecord] = []
        self.counter = CallCounter()
        self.use_pch = use_pch
        self.arch = cuda_arch_list()
        if max_jobs:
            os.environ["MAX_JOBS"] = str(max_jobs)
        if self.arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = self.arch
        self._original: Optional[Callable] = None

    @property
    def pch_root(self) -> Path:
        """Where this builder's precompiled headers live (one directory per ``pch_key``)."""
        return self.cache_root.parent / "pch"

    def install(self) -> None:
        from torch.utils import cpp_extension

        self._original = cpp_extension.load_inline
        cpp_extension.load_inline = self.load_inline  # type: ignore[assignment]

    def pch_plan(self, extra_cflags: list[str], extra_include_paths: list[str], header: str = "torch/extension.h",
                 text: Optional[str] = None, device: str = "cpu") -> tuple[str, list[str], Path]:
        """The compiler and flags a precompiled header is made with, and its directory (``pch_key``)."""
        import sysconfig

        from torch.utils import cpp_extension as ce

        compiler = ce.get_cxx_compiler()
        system = ce.include_paths(device) + [sysconfig.get_path("include", scheme="posix_prefix")]
        flags = (["-DTORCH_API_INCLUDE_EXTENSION_H"] + [f"-I{p}" for p in extra_include_paths]
                 + [x for inc in system for x in ("-isystem", inc)] + ["-fPIC", torch_cxx_std()] + list(extra_cflags))
        return compiler, flags, self.pch_root / pch_key(compiler, flags, header, text)

    def _pch_include_dir(self, extra_cflags: list[str], extra_include_paths: list[str],
                         header: str = "torch/extension.h", text: Optional[str] = None,
                         device: str = "cpu") -> Optional[str]:
        """A precompiled header of our own, one per header and set of compile flags: by default
        torch's ``torch/extension.h``; with ``text``, a header of ours named ``header`` (the lean
        binding header of ``sandbox.lite_headers``).

        torch's own ``use_pch`` keeps one file in its install directory, rewritten in place
        whenever another build's flags differ and deleted by every default ``load_inline``:
        concurrent builds then read a half-written header and the compiler crashes. Ours
        lives in the cache, keyed by the flags, is built under a lock into a temporary file
        and renamed into place, so a reader sees a whole header or none. A directory holding
        ``<header>.gch`` is put first on the include path; GCC takes the header from there when
        it is valid for the compile and reads the header beside it otherwise (for torch's
        header, a shim that sends it on to the real one).
        """
        from torch.utils import cpp_extension as ce

        compiler, flags, root = self.pch_plan(extra_cflags, extra_include_paths, header, text, device)
        target = root / (header + ".gch")
        failed = root / "failed"
        beside = root / header
        if target.exists() and beside.exists():
            return str(root)
        if failed.exists():
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root) + ".lock"):
            if target.exists() and beside.exists():
                return str(root)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.gch")
            if text is None:
                source = Path(ce._TORCH_PATH) / "include" / header
                # Where GCC finds the .gch but cannot use it for a compile (other flags), it reads
                # the header from this directory: the shim sends it on to torch's real header.
                beside_text = f"#pragma once\n#include_next <{header}>\n"
            else:
                source = tmp.with_name(f".{target.name}.{os.getpid()}.h")
                source.write_text(text)
                beside_text = text
            import subprocess

            try:
                proc = subprocess.run([compiler, "-x", "c++-header", str(source), "-o", str(tmp)] + flags,
                                      capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                failed.write_text(str(exc))
                return None
            finally:
                if text is not None:
                    source.unlink(missing_ok=True)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                failed.write_text(proc.stderr[-4000:])
                return None
            beside.write_text(beside_text)
            os.replace(tmp, target)
        return str(root)

    def _lite_dirs(self) -> tuple[str, ...]:
        """The include directory of ``sandbox.lite_headers``, or none where torch's headers are not as expected."""
        from sandbox.lite_headers import lite_include_dir

        lite = lite_include_dir(self.cache_root.parent)
        return (lite,) if lite else ()

    def _binding_pch(self, header: str, device: str, extra_cflags: list[str], include_paths: list[str]) -> Optional[str]:
        """The directory of the lean or raw binding header ``header``, precompiled (on first need)."""
        from sandbox.lite_headers import lean_binding_text, minimal_prelude
        from sandbox.pyglue import raw_binding_text

        text = (raw_binding_text(device, minimal_prelude(device)) if header in RAW_BINDING.values()
                else lean_binding_text(device))
        return self._pch_include_dir(extra_cflags, include_paths, header, text, device=device) or None

    def _glue(self, docs: Optional[dict[str, str]], is_python_module: bool,
              with_pytorch_error_handling: bool) -> Optional[list[str]]:
        """The link flags of the raw binding's glue library where it can bind the functions ``docs``
        names as load_inline would (a Python module, torch's error handling), else None."""
        from sandbox.pyglue import glue_library

        if os.environ.get("KERNELLOOP_RAW_BINDING", "1") == "0":       # pybind11 bindings only (to compare)
            return None
        if not (is_python_module and with_pytorch_error_handling and docs):
            return None
        from kernelloop.paths import cache_dir

        # Per torch install, not per build cache: a builder with a cache of its own (a bench's cold
        # cache, a test's) links the one glue its torch already has (its key names the install).
        glue = glue_library(cache_dir(), self._original)
        return glue_ldflags(glue) if glue else None

    def _prefix_pch(self, sources: list[str], extra_cflags: list[str], include_paths: list[str],
                    lite: list[str], device: str) -> tuple[list[str], Optional[str]]:
        """The C++ sources with their leading include block (beyond the lean binding header) taken
        from a precompiled header of its own, and that header's directory; the sources unchanged
        and None where the block is the lean header alone, is new (``seen_before``) or does not
        precompile. The file's text is the same token for token, on the same lines: only the
        compiler's reading of the headers is saved (on an H100 candidate's wrapper, the CUDA context
        headers: a third of the C++ file's compile)."""
        block, rest = leading_includes("\n".join(sources))   # as load_inline joins them
        if sum(1 for line in block if "#" in line.split("//")[0]) < 2:
            return sources, None
        header, text = prefix_header(block)
        if not seen_before(self.pch_root, header):
            return sources, None
        found = self._pch_include_dir(extra_cflags, [*lite, *include_paths], header, text, device=device)
        if not found:
            return sources, None
        return ["\n".join([f"#include <{header}>", *[""] * (len(block) - 1), *rest])], found

    def load_inline(self, name: str, cpp_sources: Any, cuda_sources: Any = None, functions: Any = None,
                    extra_cflags: Any = None, extra_cuda_cflags: Any = None, extra_ldflags: Any = None,
                    extra_include_paths: Any = None, build_directory: Any = None, verbose: bool = False,
                    with_cuda: Any = None, is_python_module: bool = True,
                    with_pytorch_error_handling: bool = True, keep_intermediates: bool = True,
                    use_pch: bool = False, no_implicit_headers: bool = False, **unused: Any) -> Any:
        import torch

        assert self._original is not None
        cpp = _as_list(cpp_sources)
        cuda = _as_list(cuda_sources)
        kwargs = dict(cpp_sources=cpp, cuda_sources=cuda, functions=functions,
                      extra_cflags=_as_list(extra_cflags), extra_cuda_cflags=_as_list(extra_cuda_cflags),
                      extra_ldflags=_as_list(extra_ldflags), extra_include_paths=_as_list(extra_include_paths),
                      with_cuda=with_cuda, is_python_module=is_python_module,
                      with_pytorch_error_handling=with_pytorch_error_handling)
        key = extension_key(kwargs, torch.__version__, self.arch if cuda else None)
        literal = next((m.group(1) for s in cpp + cuda for m in _PYBIND_NAME_RE.finditer(s)
                        if m.group(1) != "TORCH_EXTENSION_NAME"), None)
        ext_name = literal or f"kl_{key[:20]}"
        directory = self.cache_root / f"{ext_name}_{key[:20]}" if literal else self.cache_root / ext_name
        directory.mkdir(parents=True, exist_ok=True)

        # Levers. No implicit torch headers on CUDA sources that do not use torch.
        uses_torch = any(_TORCH_USE_RE.search(s) for s in cuda)
        # where the lean binding header may go first: load_inline's implicit torch/extension.h,
        # or the candidate's own (the builtin proposer includes it and asks for no implicit headers)
        lean_cpp = cpp if not no_implicit_headers or any(EXTENSION_INCLUDE_RE.search(s) for s in cpp) else None
        if not no_implicit_headers and cuda and not uses_torch:
            no_implicit_headers = True
            cpp = ["#include <torch/extension.h>"] + cpp
            cuda = ["#include <cuda.h>", "#include <cuda_runtime.h>"] + cuda
        include_paths = list(kwargs["extra_include_paths"])
        declared = kernel_names(cuda)

        t0 = time.perf_counter()
        marker = directory / ".built"
        library = directory / f"{ext_name}.so"
        cached = marker.exists() and library.exists()
        with FileLock(str(directory) + ".lock"):
            stale = directory / "lock"      # torch's FileBaton left by a killed build
            if stale.exists():
                stale.unlink()
            if cached:
                from torch.utils import cpp_extension as ce

                module = ce._import_module_from_library(ext_name, str(directory), is_python_module)
                # how it was built (the marker keeps the first build's notes: split, lighter headers, binding)
                self.records.append(BuildRecord(ext_name, name, str(directory), time.perf_counter() - t0, True, True,
                                                "", bool(cuda), declared, marker.read_text().splitlines()))
                return ExtensionProxy(module, ext_name, self.counter) if is_python_module else module
            # Lighter torch headers first where the CUDA sources use torch (see header_tries);
            # the candidate's own headers decide the verdict wherever the lighter ones fail.
            device = "cuda" if cuda else "cpu"
            lite_dirs: tuple[str, ...] = ()
            glue = None
            docs = function_docs(functions)
            if uses_torch or lean_cpp is not None:
                lite_dirs = self._lite_dirs()
                if lite_dirs and lean_cpp is not None:
                    glue = self._glue(docs, is_python_module, with_pytorch_error_handling)
            if uses_torch:
                tries = header_tries(cuda, no_implicit_headers, lite_dirs, lean_cpp, glue)
            else:
                tries = binding_tries(HeaderTry("", cuda, no_implicit_headers), lean_cpp, lite_dirs, device, glue)
            notes: list[str] = []
            i: Optional[int] = 0
            with_pch = self.use_pch
            while i is not None:
                attempt = tries[i]
                pch_root = str(self.pch_root) + os.sep
                own_paths = [p for p in attempt.include_paths if with_pch or not p.startswith(pch_root)]
                paths = [*own_paths, *include_paths]
                if with_pch and not attempt.lean_binding:     # made on first need: a minute the first time
                    pch_dir = self._pch_include_dir(kwargs["extra_cflags"], include_paths)
                    paths = [*own_paths, *([pch_dir] if pch_dir else []), *include_paths]
                cpp_now = [*attempt.cpp_prefix, *(cpp if attempt.cpp is None else attempt.cpp)]
                bound = functions
                if attempt.raw:       # the bindings written here, not by torch's pybind11 module
                    cpp_now, bound = [*cpp_now, module_definition(docs or {})], None
                if with_pch and attempt.binding_header:
                    binding_pch = self._binding_pch(attempt.binding_header, device, kwargs["extra_cflags"],
                                                    [*own_paths, *include_paths])
                    paths = [*([binding_pch] if binding_pch else []), *paths]
                    cpp_now, prefix_dir = self._prefix_pch(cpp_now, kwargs["extra_cflags"], include_paths,
                                                           [p for p in own_paths if not p.startswith(pch_root)], device)
                    if prefix_dir:
                        paths = [prefix_dir, *paths]
                        if PREFIX_NOTE not in notes:
                            notes.append(PREFIX_NOTE)
                used_pch = [p for p in paths if p.startswith(pch_root)]
                try:
                    module = self._original(     # copies: load_inline adds its headers and bindings in place
                        name=ext_name, cpp_sources=cpp_now,
                        cuda_sources=list(attempt.cuda) or None,
                        functions=bound, extra_cflags=kwargs["extra_cflags"] or None,
                        extra_cuda_cflags=_with_nvcc_threads(kwargs["extra_cuda_cflags"]) if cuda else None,
                        extra_ldflags=[*kwargs["extra_ldflags"], *attempt.ldflags] or None,
                        extra_include_paths=paths or None,
                        build_directory=str(directory), verbose=False, with_cuda=with_cuda,
                        is_python_module=is_python_module, with_pytorch_error_handling=with_pytorch_error_handling,
                        keep_intermediates=keep_intermediates, use_pch=False,
                        no_implicit_headers=attempt.no_implicit_headers)
                except Exception as exc:
                    from torch.utils import cpp_extension as ce

                    if used_pch and _PCH_UNREADABLE_RE.search(str(exc)):
                        # the compiler stopped at a precompiled header of ours: the same try again
                        # without any, so the verdict is the candidate's code's alone
                        for d in used_pch:
                            discard_pch(Path(d), f"unreadable in a build of {ext_name}:\n{exc}")
                        with_pch = False
                        notes.append(PCH_NOTE)
                        ce.JIT_EXTENSION_VERSIONER.entries.pop(ext_name, None)
                        continue
                    nxt = next_try(tries, i, str(exc))
                    if nxt is None:
                        self.records.append(BuildRecord(ext_name, name, str(directory), time.perf_counter() - t0,
                                                        False, False, str(exc)[-LOG_CAP:], bool(cuda), declared,
                                                        notes))
                        raise
                    notes.append(f"not {attempt.note}: tried {tries[nxt].note or OWN_NOTE}")
                    # torch would version the rebuild (``name_v1``): the library then no
                    # longer has the name a later cache hit imports
                    ce.JIT_EXTENSION_VERSIONER.entries.pop(ext_name, None)
                    i = nxt
                else:
                    if attempt.note:
                        notes.append(attempt.note)
                    if attempt.raw and attempt.note != RAW_NOTE:
                        notes.append(RAW_NOTE)
                    i = None
            marker.write_text("".join(f"{n}\n" for n in notes))
        self.records.append(BuildRecord(ext_name, name, str(directory), time.perf_counter() - t0, cached, True,
                                        "", bool(cuda), declared, notes))
        if not is_python_module:
            return module
        return ExtensionProxy(module, ext_name, self.counter)


_ERROR_RE = re.compile(r"^(?P<file>[^\s:]+\.(?:cpp|cu|cuh|h)):(?P<line>\d+)(?::\d+)?:\s*(?:fatal\s+)?error\b.*$"
                       r"|^(?P<file2>[^\s(]+\.cu)\((?P<line2>\d+)\):\s*error.*$", re.MULTILINE)


def first_compiler_error(log: str, candidate_source: str, build_dirs: list[str]) -> tuple[Optional[str], Optional[int]]:
    """The first compiler error line, and the line of the candidate file it points at.

    The build directory's ``main.cpp``/``cuda.cu`` line named by the error is looked up in
    the candidate's source text; where that line occurs once (or first), its number is
    the candidate line.
    """
    m = _ERROR_RE.search(log)
    if not m:
        alt = re.search(r"^.*\berror\b.*$", log, re.MULTILINE | re.IGNORECASE)
        return (alt.group(0).strip()[:500] if alt else None), None
    text = m.group(0).strip()
    fname = m.group("file") or m.group("file2")
    line = int(m.group("line") or m.group("line2"))
    src_line: Optional[str] = None
    for d in build_dirs:
        path = Path(fname) if os.path.isabs(fname) else Path(d) / Path(fname).name
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            if 0 < line <= len(lines):
                src_line = lines[line - 1].strip()
                break
    if src_line:
        for i, cand_line in enumerate(candidate_source.splitlines(), start=1):
            if cand_line.strip() == src_line:
                return text[:500], i
    return text[:500], None
