#!/usr/bin/env bash
# CI stage: the tests where users train, beyond this machine's root with bubblewrap.
#   1. the README's test command (the whole fast suite) inside a default rootful container (podman + runc: the
#      runtime's seccomp profile and capabilities, read-only cgroups, no nested container, no normal user to make), on
#      this machine's files through an overlay (--rootfs /:O), so the checkout and venv are reused; what the container
#      cannot give is a skip that names it, anything else fails the stage;
#   2. as a normal user with user namespaces allowed (bubblewrap through one), and blocked (max_user_namespaces=0 in
#      a user namespace of its own, as RHEL's default or Ubuntu's AppArmor rule leave a user);
#   3. on the host, the tests that set up those conditions themselves and compare the levels.
# A protection the kernel cannot give there is a skip that names it; a broken contract fails the stage.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CONTRACT_TESTS=(tests/sandbox/jail/test_hostile_cells.py tests/sandbox/jail/test_jail.py
    tests/sandbox/jail/test_sealed_filesystem.py tests/sandbox/host/test_local_pool.py
    tests/sandbox/jail/test_cells_sharing_an_owner.py tests/sandbox/jail/test_session_privileges.py
    tests/sandbox/jail/test_session_bounds_without_cgroups.py)
PYTEST=(-m pytest -q -p no:cacheprovider -rs)

if [ "$(id -u)" != 0 ]; then
    echo "test_containers: needs root (to start a rootful container and to become a normal user); not run" >&2
    exit 1
fi
if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q podman runc >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q podman runc >/dev/null; }
fi

stage() { echo "== test_containers: $1"; }
start=$(date +%s)

stage "default rootful container (podman, runc): the README's test command"
container_start=$(date +%s)
podman --runtime runc run --rm --ulimit nofile=4096:4096 --ulimit nproc=8192:8192 \
    -w "$ROOT" -e PYTHONPATH="$ROOT" --rootfs /:O "$PY" "${PYTEST[@]}" -x
echo "CI: the test command in a default container took $(( $(date +%s) - container_start )) s"

# What the normal user needs: the interpreter's install and the checkout (as_normal_user.py shows them under a
# mode-700 /root, and lets the user through any other folder on the way that others cannot enter, a `mktemp -d` one).
NEEDED="$("$PY" -c 'import os, sys; print(os.path.realpath(sys.executable))'):$ROOT"
for block in 0 1; do
    stage "normal user (uid 65534), user namespaces $([ $block = 1 ] && echo blocked || echo allowed)"
    "$PY" scripts/ci/as_normal_user.py 65534 "$block" "$NEEDED" env HOME=/tmp PYTHONPATH="$ROOT" PATH="$PATH" \
        "$PY" "${PYTEST[@]}" "${CONTRACT_TESTS[@]}"
done

stage "levels and container probe, from the host"
PYTHONPATH="$ROOT" "$PY" "${PYTEST[@]}" tests/sandbox/isolation/test_levels.py tests/sandbox/isolation/test_container.py
echo "CI: container and normal-user stage took $(( $(date +%s) - start )) s"
