#!/usr/bin/env bash
# Fetch the wheels the GPU host lacks (it has torch, ninja, jinja2, typer, rich, matplotlib,
# filelock, httpx, pytest but no network) into .whl/, an ignored folder that travels with
# `carry` (.gitignore ignores it). Run once here; every GPU session then installs them with scripts/gpu_env.sh.
# einops is no dependency of kernelloop's: KernelBench's level3/48-49 (Mamba2) import it, as KernelBench requires.
#   bash scripts/fetch_wheels.sh ray   # also Ray and the dependencies the GPU image lacks into .whl-ray/
#                                      # (scripts/gpu_ray.sh): Ray's wheel repacked (scripts/repack_ray_wheel.py,
#                                      # 79 MB -> about 42 MB) so .whl, .whl-ray and .kb travel in one call
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions sqlalchemy greenlet tenacity openai distro jiter sniffio anyio httpx2 httpcore2 h11 certifi idna truststore nvidia-ml-py einops; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg" || python3 -m pip download -q --no-deps -d .whl "$pkg"
done
ls -1 .whl
if [ "${1:-}" = "ray" ]; then
  RAY_VERSION=${RAY_VERSION:-2.60.0}
  rm -rf .whl-ray /tmp/ray-wheel-full && mkdir -p .whl-ray /tmp/ray-wheel-full
  # the image has Ray's other needs (click, msgpack, protobuf, pyyaml, requests, attrs, filelock, packaging)
  for pkg in "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing rpds-py; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d /tmp/ray-wheel-full "$pkg" || python3 -m pip download -q --no-deps -d /tmp/ray-wheel-full "$pkg"
  done
  for w in /tmp/ray-wheel-full/*.whl; do
    case "$(basename "$w")" in
      ray-*) python3 scripts/repack_ray_wheel.py "$w" ".whl-ray/$(basename "$w")" ;;
      *) cp "$w" .whl-ray/ ;;
    esac
  done
  du -sh .whl-ray; ls -1 .whl-ray
fi
