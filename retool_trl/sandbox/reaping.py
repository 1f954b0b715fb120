"""How a jail died, and the zygote's quiet cleanup: standard library only (the zygote imports it as a sibling
script module, inside the jail's bubblewrap)."""

import os
import signal


def death_cause(status, cgroups) -> dict:
    """What killed a session process, from its wait status: `{"exit": code}` or `{"signal": n, "oom": bool}`.

    `oom` says whether the session's own memory bound killed it. Any other SIGKILL came from outside the jail
    (nothing inside can kill its pid 1, and there is no hard CPU limit): the machine's or the whole sandbox's OOM
    killer, or an operator, which the host reports as infrastructure.
    """
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"signal": sig, "oom": sig == signal.SIGKILL and oom_killed(cgroups)}
    return {"exit": os.WEXITSTATUS(status)}


def oom_killed(cgroups) -> bool:
    """Whether the OOM killer acted in one of these memory cgroups *because of that cgroup's own limit*.

    The kernel bumps the victim's `oom_kill` counter for any OOM kill, the machine's and a parent cgroup's too; only
    a session that also hit its own limit (v1 `memory.failcnt`, v2 the `oom` count of `memory.events`) was killed by
    it. A charge refused by a parent's limit counts against the parent's `failcnt`, not the session's."""
    for path in cgroups:
        try:
            with open(os.path.join(path, "memory.events")) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            if int(counts.get("oom_kill", 0)) and int(counts.get("oom", 0)):
                return True
            continue
        except OSError:
            pass
        try:
            with open(os.path.join(path, "memory.oom_control")) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            with open(os.path.join(path, "memory.failcnt")) as f:
                failed = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if int(counts.get("oom_kill", 0)) and failed:
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
