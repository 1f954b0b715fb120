"""How a jail died, and the zygote's quiet cleanup: standard library only (the zygote imports it as a sibling
script module, inside the jail's bubblewrap)."""

import os
import signal


def death_cause(status, cgroups) -> dict:
    """What killed a session process, from its wait status: `{"exit": code}` or `{"signal": n, "oom": bool}`.

    `oom` says whether the kernel's OOM killer acted in the jail's memory cgroup (the session's memory bound). Any
    other SIGKILL came from outside the jail (nothing inside can kill its pid 1, and there is no hard CPU limit),
    which the host reports as infrastructure.
    """
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"signal": sig, "oom": sig == signal.SIGKILL and oom_killed(cgroups)}
    return {"exit": os.WEXITSTATUS(status)}


def oom_killed(cgroups) -> bool:
    """Whether the kernel's OOM killer acted in any of these memory cgroups (v1 `memory.oom_control`, v2
    `memory.events`)."""
    for path in cgroups:
        for name in ("memory.oom_control", "memory.events"):
            try:
                with open(os.path.join(path, name)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
            except OSError:
                continue
            if int(counts.get("oom_kill", 0)):
                return True
    return False


def rmdir_quietly(path) -> bool:
    """Removes an empty directory (a cgroup); False while it is still busy."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
