"""Keys and upkeep of the precompiled headers ``sandbox.build`` makes (one directory per key under
the build cache's ``pch``): what makes a ``.gch`` usable for a compile goes into its key, and one
a compiler could not read is discarded for every later build.

GCC checks a precompiled header against the compile's flags and macros, and skips one made for
others (``-Winvalid-pch`` says so): that costs only time. It does not check the files the header
included, nor which compiler of the same name wrote it, and it stops with an error at a damaged
one. So the key holds the compiler's own identity, the flags, torch's version, commit and the
stamps of its headers, the header and its text; and a build that stops at one of our headers is
built again without (``HookedBuilder.load_inline``), its header discarded here.
"""
from __future__ import annotations

import hashlib
import re
import json
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock

_COMPILER_IDS: dict[str, str] = {}


def compiler_identity(compiler: str) -> str:
    """What the compiler says it is (``--version``'s first line and ``-dumpmachine``), once per process:
    a precompiled header is only valid for the compiler that wrote it, and an upgrade in place keeps
    the compiler's name."""
    if compiler not in _COMPILER_IDS:
        import subprocess

        parts = []
        for flag in ("--version", "-dumpmachine"):
            try:
                out = subprocess.run([compiler, flag], capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired) as exc:
                out = f"unknown: {exc}"
            parts.append((out.strip().splitlines() or [""])[0])
        _COMPILER_IDS[compiler] = " | ".join(parts)
    return _COMPILER_IDS[compiler]


def torch_headers_identity() -> list[Any]:
    """The installed torch's headers, as a key: its version and commit, its include directory, and
    the size and modification time of the headers every build starts with (a reinstall in place of
    another build of the same version changes them; GCC does not check a precompiled header's
    included files itself)."""
    import torch
    from torch.utils import cpp_extension as ce

    include = Path(ce._TORCH_PATH) / "include"
    stamps = []
    for rel in ("torch/extension.h", "torch/csrc/api/include/torch/version.h", "ATen/core/TensorBody.h",
                "c10/macros/cmake_macros.h", "pybind11/pybind11.h"):
        try:
            st = (include / rel).stat()
            stamps.append([rel, st.st_size, st.st_mtime_ns])
        except OSError:
            stamps.append([rel, None, None])
    return [torch.__version__, getattr(torch.version, "git_version", ""), str(include), stamps]


_STD_RE = re.compile(r"cflags = common_cflags \+ \[[^\]]*'(-std=c\+\+\w+)'")
_ANY_STD_RE = re.compile(r"'(-std=c\+\+\w+)'")


def cxx_std_of(source: str) -> Optional[str]:
    """The ``-std=`` flag in the source of torch's ``_write_ninja_file_to_build_library``: the one it
    gives a C++ file (``cflags = common_cflags + ['-fPIC', '-std=c++NN'] + ...``), else its first."""
    found = _STD_RE.search(source) or _ANY_STD_RE.search(source)
    return found.group(1) if found else None


_TORCH_STD: list[str] = []


def torch_cxx_std() -> str:
    """The C++ standard the installed torch compiles an extension's C++ file with: ``-std=c++17`` up
    to some 2.x releases, ``-std=c++20`` after. A header precompiled under another standard is
    skipped by GCC (``not used because `__cpp_impl_three_way_comparison' not defined``), silently
    but for the time: a GPU host's torch used c++17 while every header was made with c++20."""
    if not _TORCH_STD:
        import inspect

        from torch.utils import cpp_extension as ce

        try:
            std = cxx_std_of(inspect.getsource(ce._write_ninja_file_to_build_library))
        except (AttributeError, OSError, TypeError):
            std = None
        _TORCH_STD.append(std or "-std=c++17")
    return _TORCH_STD[0]


def pch_key(compiler: str, flags: list[str], header: str, text: Optional[str]) -> str:
    """The name of a precompiled header's directory: everything that makes one usable for a compile
    (the compiler, the flags, torch's headers, the header and its text)."""
    blob = json.dumps([compiler_identity(compiler), compiler, flags, torch_headers_identity(), header, text, 2])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def discard_pch(root: Path, why: str) -> None:
    """Never use the precompiled header in ``root`` again (this process or another): its ``.gch``
    files removed, a ``failed`` note left in their place, under the lock its builders take."""
    with FileLock(str(root) + ".lock"):
        for gch in root.rglob("*.gch"):
            gch.unlink(missing_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / "failed").write_text(why[-4000:])


_LEADING_LINE_RE = re.compile(r'^[ \t]*(?:#[ \t]*include[ \t]*<[^<>"]+>[ \t]*)?(?://.*)?$')


def leading_includes(text: str) -> tuple[list[str], list[str]]:
    """``text``'s lines split after its leading block: the lines before the first one that is not
    blank, a ``//`` comment or an ``#include <...>`` (the block ends on its last include)."""
    lines = text.split("\n")
    n = 0
    for i, line in enumerate(lines):
        if not _LEADING_LINE_RE.match(line):
            break
        if "#" in line.split("//")[0]:
            n = i + 1
    return lines[:n], lines[n:]


def prefix_header(block: list[str]) -> tuple[str, str]:
    """The name and text of a header holding a C++ file's leading include block: precompiled, the
    file starts with it in the block's place, its other lines where they were (the block's lines
    left blank: ``__LINE__`` in what follows, TORCH_CHECK's messages, stays the same). The header
    holds the block's include lines only: blank lines and comments, which the file loses with the
    block either way, do not make another header (a salt or note atop each candidate's source made
    every block new, so none was ever seen twice)."""
    text = "\n".join(line.split("//")[0].strip() for line in block if "#" in line.split("//")[0]) + "\n"
    return f"kernelloop/prefix_{hashlib.sha256(text.encode()).hexdigest()[:16]}.h", text


def seen_before(root: Path, name: str) -> bool:
    """Whether a prefix header named ``name`` was asked for before (a note under ``root`` made on the
    first ask): precompiling one costs more than one compile saves, so only a recurring one is."""
    note = root / "seen" / Path(name).name
    if note.exists():
        return True
    note.parent.mkdir(parents=True, exist_ok=True)
    note.touch()
    return False


_SKIPPED_RE = re.compile(r"warning: (\S+\.gch): not used because (.*?) \[-Winvalid-pch\]")


def headers_used(build_dir: Path, source: str = "main.cpp", timeout: float = 300.0) -> dict[str, Any]:
    """Which precompiled headers a finished build's C++ file takes: the file parsed again as its
    ``build.ninja`` compiles it (``-fsyntax-only``, with ``-Winvalid-pch -H``). ``used`` lists the
    ``.gch`` files GCC read, ``skipped`` each one it found but refused, with its reason. A header
    refused costs only time and GCC says nothing without the warning: this is how a build's
    flags drifting from a header's (another ``-std``) is seen."""
    import shlex
    import subprocess

    build_dir = Path(build_dir)
    values = dict(re.findall(r"^(\w+) = (.*)$", (build_dir / "build.ninja").read_text(), re.M))
    cmd = [values["cxx"], *shlex.split(values.get("cflags", "")), "-fsyntax-only", "-Winvalid-pch", "-H",
           "-c", source, *shlex.split(values.get("post_cflags", ""))]
    out = subprocess.run(cmd, cwd=build_dir, capture_output=True, text=True, timeout=timeout)
    used = [line[2:].strip() for line in out.stderr.splitlines() if line.startswith("! ")]
    skipped = [f"{Path(g).name}: {why}" for g, why in _SKIPPED_RE.findall(out.stderr)]
    return {"used": used, "skipped": skipped, "ok": out.returncode == 0}

