"""Repack Ray's wheel without its Java jar (``ray/jars/ray_dist.jar``, unused by Python workers),
so it fits one device call's 64 MiB: every other member is copied as it is, and the jar's line
is dropped from the wheel's RECORD (so pip installs it without complaint).

    python scripts/repack_ray_wheel.py IN.whl OUT.whl
"""
from __future__ import annotations

import sys
import zipfile

DROP = ("ray/jars/",)


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
