"""Candidate bindings without pybind11: the raw binding header and the glue library.

Where a candidate asks ``load_inline`` to bind its ``functions``, torch writes a
``PYBIND11_MODULE`` into the C++ file. pybind11's headers alone make GCC generate ~107 KB of
code in every translation unit that includes them: with the lean binding header precompiled,
an empty module still costs ~4 s of one core, the floor of every build (issue 36).

The raw binding binds the same functions through the CPython API instead:

* ``RAW_BINDING[device]`` (``templates/raw_binding.h.j2``): Python.h, the minimal torch prelude of
  ``sandbox.lite_headers`` and small casters (tensors, numbers, bools, strings, sequences,
  optionals, ``IntArrayRef``, ``Scalar``; results: tensors, numbers, lists, tuples) with the
  conversions a ``load_inline`` binding accepts. A type they lack does not compile (the error
  names ``kl_glue``) and the build tries the pybind11 binding next (``sandbox.header_tries.next_try``).
* the glue library (``templates/pyglue.cpp.j2``), built once per torch install (in the user's cache,
  ``kernelloop.paths.cache_dir()``, whatever build cache a builder uses) with torch's own
  ``load_inline``: tensor <-> PyObject, and each call run under the handling
  ``torch::wrap_pybind_function`` gives (C++ warnings as Python warnings, c10 errors as their
  Python exceptions), so a candidate's errors read the same.
* ``module_definition``: the method table and ``PyInit_<name>`` appended where torch would have
  put its ``PYBIND11_MODULE``; the functions are called positionally, as torch binds them.

The candidate's own code and flags are unchanged: only the binding's code differs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import jinja2
from filelock import FileLock

RAW_BINDING = {"cuda": "kernelloop/raw_binding.h", "cpu": "kernelloop/raw_binding_cpu.h"}
RAW_NOTE = "C++ bindings through the CPython API and kernelloop's glue in place of pybind11"
GLUE_ERROR_MARK = "kl_glue"     # in a compiler's error: the raw binding's own, not the candidate's
VERSION = 1

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@functools.lru_cache(maxsize=None)
def raw_binding_text(device: str, prelude: str) -> str:
    """The raw binding header for builds with CUDA sources (``cuda``) or C++ sources only (``cpu``),
    after ``prelude`` (``sandbox.lite_headers.minimal_prelude``); rendered once per process (every
    build reads it: the lite headers' key, the binding's precompiled header)."""
    return _ENV.get_template("raw_binding.h.j2").render(guard=f"KERNELLOOP_RAW_BINDING_{device.upper()}_H",
                                                         prelude=prelude)


def function_docs(functions: Any) -> Optional[dict[str, str]]:
    """``load_inline``'s ``functions`` as torch reads them (a name, a list of names, or names to
    docstrings); None where it binds nothing or the value is not one of those."""
    if isinstance(functions, str):
        return {functions: functions}
    if isinstance(functions, (list, tuple)) and all(isinstance(f, str) for f in functions):
        return {f: f for f in functions}
    if isinstance(functions, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in functions.items()):
        return dict(functions)
    return None


def module_definition(functions: dict[str, str]) -> str:
    """The method table and module init that bind ``functions`` (name -> docstring)."""
    return _ENV.get_template("raw_module.cpp.j2").render(
        functions=[(name, json.dumps(doc)) for name, doc in functions.items()])


def glue_library(cache_root: Path, load_inline: Any) -> Optional[tuple[str, str]]:
    """The glue library for the installed torch (directory, file name), built on first use with
    torch's own ``load_inline`` (``load_inline``: the function itself, where the sandbox has
    replaced it) under a lock and moved into place whole; None where it does not build (the
    pybind11 binding is used then, and the reason is kept in ``<key>.failed`` beside it)."""
    import torch
    from torch.utils import cpp_extension as ce

    source = _ENV.get_template("pyglue.cpp.j2").render()
    key = hashlib.sha256(repr((VERSION, source, torch.__version__, getattr(torch.version, "git_version", ""),
                               ce._TORCH_PATH, ce.get_cxx_compiler())).encode()).hexdigest()[:16]
    name = f"kl_pyglue_{key}"
    root = Path(cache_root) / "pyglue"
    final = root / key
    library = final / f"{name}.so"
    if library.exists():
        return str(final), library.name
    if (root / f"{key}.failed").exists():
        return None
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if library.exists():
            return str(final), library.name
        work = root / f".{key}.{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            load_inline(name=name, cpp_sources=[source], functions=None, build_directory=str(work),
                        is_python_module=False, no_implicit_headers=True, verbose=False)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the pybind11 binding in use
            (root / f"{key}.failed").write_text(f"{type(exc).__name__}: {exc}"[-4000:])
            shutil.rmtree(work, ignore_errors=True)
            return None
        for f in list(work.iterdir()):
            if f.name != f"{name}.so":
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        os.replace(work, final)
    return str(final), library.name


def glue_ldflags(glue: tuple[str, str]) -> list[str]:
    """What links a candidate's extension to the glue library (found again at load through its rpath)."""
    directory, file_name = glue
    return [f"-L{directory}", f"-l:{file_name}", f"-Wl,-rpath,{directory}"]
