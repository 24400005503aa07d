"""Repack Ray's wheel without what a cluster of Python workers never loads, so that it fits one
device call's 64 MiB beside the project's other wheels (79 MB -> about 42 MB): the Java jar
(``ray/jars``), the dashboard's web front end (``ray/dashboard/client``; the dashboard is off) and
the libraries built on Ray core that kernelloop does not use (RLlib, Serve, Tune, Train, Ray LLM).
Every other member is copied as it is, and the dropped lines leave the wheel's RECORD (so pip
installs it without complaint). Checked: a head and a worker node of Ray with these removed run
tests/test_ray_executor.py.

    python scripts/repack_ray_wheel.py IN.whl OUT.whl
"""
from __future__ import annotations

import sys
import zipfile

DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/", "ray/llm/")


def repack(src: str, dst: str) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename.startswith(DROP):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROP)).encode()
            zout.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)


if __name__ == "__main__":
    repack(sys.argv[1], sys.argv[2])
