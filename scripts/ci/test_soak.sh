#!/usr/bin/env bash
# CI stage: the seeded sandbox soak (scripts/ci/sandbox_soak.py), MINUTES (default 2) on each isolation level this
# machine gives: the host's levels that start (bubblewrap, Landlock), then, as root with podman, Landlock in a
# default rootful container and as a normal user whose user namespaces are blocked. A broken invariant fails the
# stage by its name, except those listed as known (comma-separated invariant names: reported in the JSON's "known",
# not failing): EXPECT_KNOWN_HOST for the host's levels, EXPECT_KNOWN_LANDLOCK for the container and the normal user.
# Known there by default: scratch_bounded. Without a writable cgroup the zygote samples a session's scratch tree every
# 0.1 s, and a cell that writes faster than that passes scratch_mb between two samples before it is killed (the
# docs' "not promised" for that level says so); the soak writes 96 MB under scratch_mb=32 that way.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MINUTES="${MINUTES:-2}"
SOAK=(scripts/ci/sandbox_soak.py --minutes "$MINUTES" --seed 1 --json --no-record)
HOST_KNOWN=(--expect-known "${EXPECT_KNOWN_HOST:-}")
LANDLOCK_KNOWN=(--expect-known "${EXPECT_KNOWN_LANDLOCK-scratch_bounded}")
start=$(date +%s)

levels=$(PYTHONPATH="$ROOT" "$PY" scripts/ci/sandbox_soak.py --list-levels)
for level in $levels; do
    echo "== soak: $level on the host"
    PYTHONPATH="$ROOT" "$PY" "${SOAK[@]}" "${HOST_KNOWN[@]}" --level "$level"
done

if [ "$(id -u)" = 0 ] && command -v podman >/dev/null && command -v runc >/dev/null; then
    echo "== soak: auto in a default rootful container (podman, runc)"
    podman --runtime runc run --rm --ulimit nofile=4096:4096 --ulimit nproc=8192:8192 \
        -w "$ROOT" -e PYTHONPATH="$ROOT" --rootfs /:O "$PY" "${SOAK[@]}" "${LANDLOCK_KNOWN[@]}" --level auto
fi

if [ "$(id -u)" = 0 ]; then
    # The directories under mode-700 /root the user needs: the interpreter's install and, if there, the checkout.
    KEEP=$("$PY" - "$ROOT" <<'PY'
import os, sys
from pathlib import Path
root, keep = Path("/root"), []
for path in (Path(os.path.realpath(sys.executable)), Path(sys.argv[1])):
    if root in path.parents:
        keep.append(str(root / path.relative_to(root).parts[0]))
print(":".join(dict.fromkeys(keep)) or "-")
PY
)
    echo "== soak: auto as a normal user (uid 65534), user namespaces blocked"
    status=0
    "$PY" scripts/ci/as_normal_user.py 65534 1 "$KEEP" env HOME=/tmp PYTHONPATH="$ROOT" PATH="$PATH" \
        "$PY" "${SOAK[@]}" "${LANDLOCK_KNOWN[@]}" --level auto || status=$?
    if [ "$status" = 90 ]; then
        echo "soak: no normal user here (the namespaces cannot be made: a container); not run"
    elif [ "$status" != 0 ]; then
        exit "$status"
    fi
fi
echo "CI: soak stage took $(( $(date +%s) - start )) s"
