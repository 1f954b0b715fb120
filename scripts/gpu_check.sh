#!/usr/bin/env bash
# `bash scripts/gpu_check.sh ARGS` runs `scripts/gpu/gpu_check.sh ARGS` (the GPU check; its wheels script and model sit
# beside it in scripts/gpu/). This path stays because the docs and the GPU machine's instructions name it.
exec bash "$(dirname "$0")/gpu/gpu_check.sh" "$@"
