"""Freezing one session's cgroup (v1 `freezer.state`, v2 `cgroup.freeze`). Jail side, stdlib-only: the zygote thaws
the jails it kills, and the host (`host/cgroup_control.py`, `host/parking.py`) freezes and thaws parked sessions with
the same two functions.
"""

import os


def freezer_control(cgroups: dict) -> tuple[str, bytes, bytes] | None:
    """The file that freezes one session's cgroup, with what to write to freeze and to thaw it (v1 `freezer.state`,
    v2 `cgroup.freeze`), from its `{kind: directory}`; None where the session has no freezer.

    The kernel marks every process of the cgroup as the write returns: one that is stopped or asleep stays so, and
    one woken (a timer's SIGCONT) freezes before it runs a user instruction, so a parked session needs no wait for
    the state to read FROZEN."""
    if "freezer" in cgroups:
        return os.path.join(cgroups["freezer"], "freezer.state"), b"FROZEN", b"THAWED"
    if "v2" in cgroups:
        return os.path.join(cgroups["v2"], "cgroup.freeze"), b"1", b"0"
    return None


def set_frozen(cgroups: dict, frozen: bool) -> bool:
    """Freezes or thaws one session's cgroup without waiting; False where it has no freezer or the write failed
    (the zygote thaws a jail it kills: a frozen process would not die until thawed)."""
    control = freezer_control(cgroups)
    if control is None:
        return False
    try:
        with open(control[0], "wb", buffering=0) as f:
            f.write(control[1] if frozen else control[2])
    except OSError:
        return False
    return True
