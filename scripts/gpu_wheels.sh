#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_check.sh installs on a GPU machine that cannot download:
# speculators and the pure-Python (and a few binary) packages the pipeline imports that such a machine
# lacks (it has torch with CUDA, transformers, safetensors, tqdm, accelerate, triton, tokenizers).
# Versions are those of the CPU environment (requirements.txt, `pip freeze` of .venv) for Python 3.12 on
# x86_64 Linux. Output (git-ignored): .whl/ (the wheels, 78 MB: pyarrow alone is 55 MB) and
# .whl-packed/site.tar.xz (the same installed into one folder with pip --target, xz-compressed: 52 MiB,
# which fits the 64 MiB a device run carries); gpu_check.sh unpacks the latter, or installs the former.
#   bash scripts/gpu_wheels.sh            # a few minutes (xz on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=${DEST:-.whl}
# speculators' import chain (speculators.models.eagle3 -> speculators.train.data) pulls datasets,
# openai, aiohttp and hs-connectors at import time, measured with a meta-path hook; their closure
# minus what torch + transformers already bring:
WHEELS=(
  speculators==0.9.0 datasets==5.1.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 aiohttp==3.14.5 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  hs-connectors==0.9.0 protobuf==7.36.2 loguru==0.7.3 pydantic==2.14.4 pydantic_core==2.50.5
  pydantic-settings==2.16.3 python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 typer==0.29.2 click==8.5.1
  shellingham==1.5.4 psutil==7.2.2 anyio==4.16.0 h11==0.16.0 idna==3.20 truststore==0.10.5
  httpx2==2.16.2 httpcore2==2.16.2
)
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${WHEELS[@]}"
PLAT=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
  "${PLAT[@]}" --target "$TMP/site" --find-links "$DEST" "${WHEELS[@]}"
mkdir -p .whl-packed
tar cf - -C "$TMP/site" . | xz -T0 -6 > .whl-packed/site.tar.xz.tmp
mv .whl-packed/site.tar.xz.tmp .whl-packed/site.tar.xz
echo "$(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1); packed: $(du -sh .whl-packed | cut -f1)"
