#!/usr/bin/env bash
# The GPU check in one call (issue 46 item 6; replaces gpu_pending.sh): decode ms/step (static,
# compiled) at the 3B setting, vlmrl's step against TRL's on a shortened setting (step, training
# phase and its MFU, peak memory), and the tests marked gpu, printed as ONE table with the targets,
# in under 8 minutes on an H100 or H200; the table as a RESULTS.md section, and each part's output,
# in $OUT. The parts and their limits: benchmarks/gpu_check.py.
#
#   here, once:    benchmarks/gpu_check.sh wheels         (the wheels the GPU image lacks, 23 MB, into .whl/)
#   on the GPU:    benchmarks/gpu_check.sh                (a device call with carry [".whl"], timeout_s 600)
#   rehearsal:     benchmarks/gpu_check.sh --device cpu   (this machine, tiny size; tests/test_gpu_check.py)
#
# The GPU image has torch 2.11 (CUDA), accelerate, peft and pytest, and no package index: the other
# packages are installed from .whl/ into /tmp/site. On the CPU the current Python's packages are used.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="transformers==5.24.0 tokenizers==0.23.3 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 rapidfuzz==3.14.6 fsspec==2026.9.0 liger-kernel==0.8.5"

if [[ ${1:-} == wheels ]]; then
    set -e
    exclude="$(git rev-parse --git-dir)/info/exclude"  # the wheels travel as a carried, ignored folder
    mkdir -p "$(dirname "$exclude")"
    grep -qsx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    exit
fi

device=cuda
for arg in "$@"; do [[ $arg == cpu || $arg == --device=cpu ]] && device=cpu; done
if [[ $device == cuda ]]; then
    python=python3
    ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/: run 'benchmarks/gpu_check.sh wheels' here and carry .whl" >&2; exit 2; }
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site:$PWD/src
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
else
    python=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export PYTHONUNBUFFERED=1
exec "$python" benchmarks/gpu_check.py "$@"
