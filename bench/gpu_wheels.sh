#!/usr/bin/env bash
# The wheels that bench/gpu_proof.py needs on the lent GPU machines, downloaded (or built) here into .whl/.
#
#     bash bench/gpu_wheels.sh          # on a machine with PyPI, from the repository's root or anywhere in it
#
# Those machines have Python 3.12, torch 2.11.0+cu130, transformers 5.17, accelerate, peft, einops, msgpack, ninja,
# psutil, py-cpuinfo, numpy, pyyaml, pyarrow and pandas, and no network. What the proof needs beyond that travels
# as these wheels (about 10 MiB; a device call carries at most 64 MiB of working tree), all pinned:
#   - Hydra, which composes every `run`: hydra-core, omegaconf, antlr4-python3-runtime (4.9.*, which PyPI has
#     only as a source archive: built here into a pure-Python wheel);
#   - DeepSpeed (a source archive too: built here without its ops, which it compiles at run time where a run
#     needs one; the runner steps torch's own optimizer, so ZeRO-2 and ZeRO-3 need none) and the requirements the
#     machines lack: hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions (pydantic
#     asks for 4.16 or later);
#   - torchao 0.17.0, the release built for torch 2.11 (0.16 for 2.10, 0.18 for 2.12): fp8 training.
# Not carried: datasets (and pyarrow, dill, multiprocess ...), which only data=hub and data.streaming=true use; the
# proof trains on the standard library's source through the runner's own token store.
#
# On the device, from the checkout (nothing installed: the runner runs from the checkout through PYTHONPATH):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#         && export PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu_proof.py
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DEST=.whl

BINARY=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  torchao==0.17.0
  hjson==3.1.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
SOURCE=(
  antlr4-python3-runtime==4.9.3
  deepspeed==0.19.8
)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${BINARY[@]}"
# Pure Python from source archives: the wheel is the same for every Python 3 and platform.
"$PYTHON" -m pip wheel -q --no-deps -w "$DEST" "${SOURCE[@]}"

count=$(ls "$DEST"/*.whl | wc -l)
expected=$(( ${#BINARY[@]} + ${#SOURCE[@]} ))
if [ "$count" -ne "$expected" ]; then
  echo "gpu_wheels: $count wheels in $DEST, expected $expected (one per pin)" >&2
  exit 1
fi
for built in "$DEST"/antlr4_python3_runtime-*.whl "$DEST"/deepspeed-*.whl; do
  case "$built" in
    *-py3-none-any.whl) ;;
    *) echo "gpu_wheels: $built is not a pure-Python wheel" >&2; exit 1 ;;
  esac
done
ls -l "$DEST" | awk 'NR > 1 {printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -sb "$DEST" | cut -f1)
printf '%8.2f MiB  in all (%s)\n' "$(echo "$total / 1048576" | bc -l)" "$DEST"
if [ "$total" -gt $(( 50 * 1048576 )) ]; then
  echo "gpu_wheels: over 50 MiB; the device call carries at most 64 MiB of working tree" >&2
  exit 1
fi
