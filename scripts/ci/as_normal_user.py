#!/usr/bin/env python3
"""Runs a command as a normal user of this host, the way a trainer runs on a shared workstation or a Slurm node.

    python scripts/ci/as_normal_user.py UID BLOCK_USERNS NEEDED_PATHS COMMAND...

Must start as root. NEEDED_PATHS (":"-separated; "-": none) are what the user must reach: the interpreter's
install and the checkout. In a private mount namespace, /root is replaced by an empty, traversable tmpfs that shows
only the folders of NEEDED_PATHS under it (e.g. /root/.pyenv), so that the user can start the same interpreter and
nothing else of /root is visible. Any other folder on the way to a needed path that other users cannot enter (a clone
in a `mktemp -d` folder, mode 700) is made traversable (o+x: entered, not listed) while the command runs, and its
mode restored after. With BLOCK_USERNS=1 the command also runs in a user namespace of its own whose
`user.max_user_namespaces` is 0 (the limit is per user namespace), so it cannot make user namespaces, as a user of
RHEL's default or Ubuntu 24.04's AppArmor rule cannot. Exits 90 where the namespaces cannot be made or the limit
cannot be set (a container).
"""

import ctypes
import os
import stat
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000
# Shell run in the new namespaces: private mounts, /root reduced to the KEEP directories, then the user.
SETUP = """
set -e
mount --make-rprivate /
if [ "$KEEP" != - ]; then
    i=0
    for dir in $(echo "$KEEP" | tr : ' '); do
        mkdir -p /tmp/.keep-$i && mount --bind "$dir" /tmp/.keep-$i && i=$((i+1))
    done
    mount -t tmpfs -o mode=755,size=1m tmpfs /root
    i=0
    for dir in $(echo "$KEEP" | tr : ' '); do
        mkdir -p "$dir" && mount --move /tmp/.keep-$i "$dir" && i=$((i+1))
    done
fi
exec setpriv --reuid="$RUN_UID" --regid="$RUN_UID" --clear-groups --inh-caps=-all --bounding-set=-all "$@"
"""


def plan(needed: list[str]) -> tuple[list[str], dict[Path, int]]:
    """`(keep, closed)`: the folders right under /root that hold a needed path (shown on the tmpfs), and the mode
    bits other users lack on the way: o+x on each folder above a needed path, o+rx on a needed folder itself (Python
    lists the folders it imports from)."""
    root, keep, closed = Path("/root"), [], {}
    for path in (Path(os.path.realpath(p)) for p in needed):
        if root in path.parents:
            keep.append(str(root / path.relative_to(root).parts[0]))
        for folder in (path, *path.parents):
            if folder in (root, Path("/")) or not folder.is_dir():
                continue
            wanted = stat.S_IROTH | stat.S_IXOTH if folder == path else stat.S_IXOTH
            lacking = wanted & ~os.stat(folder).st_mode
            if lacking:
                closed[folder] = closed.get(folder, 0) | lacking
    return list(dict.fromkeys(keep)), closed


def main() -> int:
    uid, block, needed, argv = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4:]
    keep, closed = plan([] if needed == "-" else needed.split(":"))
    modes = {folder: stat.S_IMODE(os.stat(folder).st_mode) for folder in closed}
    try:
        for folder, bits in closed.items():
            os.chmod(folder, modes[folder] | bits)
        return run(uid, block, ":".join(keep) or "-", argv)
    finally:
        for folder, mode in modes.items():
            os.chmod(folder, mode)


def run(uid: int, block: bool, keep: str, argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    go_r, go_w = os.pipe()  # parent -> child: the maps are written
    made_r, made_w = os.pipe()  # child -> parent: the namespaces exist
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(made_r)
        if libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if block else 0)) != 0:
            os._exit(90)
        os.write(made_w, b"1")
        os.read(go_r, 1)
        if block:
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            try:
                with open("/proc/sys/user/max_user_namespaces", "w") as f:
                    f.write("0")
            except OSError:  # /proc/sys is read-only (a container): the limit cannot be set here
                os._exit(90)
        os.environ.update(KEEP=keep, RUN_UID=str(uid))
        os.execvp("sh", ["sh", "-c", SETUP, "sh", *argv])
    os.close(go_r)
    os.close(made_w)
    if os.read(made_r, 1) and block:
        # Only a parent with CAP_SETUID in the initial namespace may map two ids: root (to write the limit) and the
        # user (to run as).
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("allow")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{uid} {uid} 1\n")
    try:
        os.write(go_w, b"1")
    except BrokenPipeError:  # the child could not make the namespaces and has exited (90)
        pass
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
