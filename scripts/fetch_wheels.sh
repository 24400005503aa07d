#!/usr/bin/env bash
# Fetch the wheels the GPU host lacks (it has torch, ninja, jinja2, typer, rich, matplotlib,
# filelock, httpx, pytest but no network) into .whl/, an ignored folder that travels with
# `carry` (.gitignore ignores it). Run once here; every GPU session then installs them with scripts/gpu_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions sqlalchemy greenlet tenacity openai distro jiter sniffio anyio httpx2 httpcore2 h11 certifi idna truststore; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg" || python3 -m pip download -q --no-deps -d .whl "$pkg"
done
ls -1 .whl
