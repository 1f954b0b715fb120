"""Test support: whether the tests run inside a container, and whether this process can become a normal user, so
that the tests which start a nested container or set up a normal user skip with one line where they cannot."""

from __future__ import annotations

import os
import subprocess

# Words of a container's cgroup path (Docker, podman, Kubernetes, containerd, LXC).
_CONTAINER_CGROUPS = ("docker", "libpod", "kubepods", "containerd", "lxc")


def container_evidence() -> str | None:
    """What says this process runs in a container (None: nothing does). `/.dockerenv` alone is not taken: images
    built with Docker keep it when they boot as a VM."""
    if os.environ.get("container"):
        return f"$container={os.environ['container']}"
    if os.path.exists("/run/.containerenv"):  # podman writes it into every container
        return "/run/.containerenv"
    try:
        with open("/proc/1/cgroup") as handle:
            paths = [line.rstrip("\n").split(":", 2)[-1] for line in handle]
    except OSError:
        return None
    if any(word in path for path in paths for word in _CONTAINER_CGROUPS):
        return "pid 1's cgroup is a container's"
    return None


def setpriv_problem(*caps_options: str) -> str | None:
    """Why `setpriv` cannot drop to uid 65534 with `caps_options` here (a container's bounding set lacks the
    capability to keep), or None when it can."""
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *caps_options, "true"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except OSError as error:
        return f"setpriv cannot run ({error.strerror})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"setpriv cannot make a normal user here ({last[:100]})"
    return None
