"""Where kernelloop's data directories (prompts/, tasks/) and caches live.

Works from a source checkout, an editable install and a regular install alike: the
checkout's directories are preferred, the installed package data is the fallback.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _data_dir(name: str) -> Path:
    candidate = _REPO_ROOT / name
    if candidate.is_dir():
        return candidate
    return Path(str(resources.files(f"kernelloop.{name}")))


def prompts_dir() -> Path:
    return _data_dir("prompts")


def tasks_dir() -> Path:
    return _data_dir("tasks")


def cache_dir() -> Path:
    """Build cache, device probes and other re-creatable state (KERNELLOOP_CACHE)."""
    root = os.environ.get("KERNELLOOP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernelloop")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def code_version() -> str:
    """The git commit of the checkout (with '+dirty' when modified), else the package version."""
    import subprocess

    from kernelloop import __version__
    try:
        sha = subprocess.run(["git", "-C", str(_REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(_REPO_ROOT), "status", "--porcelain", "-uno"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__
