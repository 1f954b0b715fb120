#!/usr/bin/env bash
# `bash scripts/test_engines.sh ARGS` runs `scripts/ci/test_engines.sh ARGS`: the engine stage (builds .venv-engines/,
# runs the tests marked `engine`), with the CI's other stages in scripts/ci/. This path stays because the docs name it.
exec bash "$(dirname "$0")/ci/test_engines.sh" "$@"
