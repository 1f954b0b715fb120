"""Where a session's uid cannot read the interpreter's folders by their modes (a virtual environment or interpreter
under a mode-700 /root, as in most container images): the import system is pointed at them through O_PATH
descriptors opened while still root (`/proc/self/fd/N` leads straight to the directory, so no capability is kept to
get past the modes, and Landlock still rules what lies below). The zygote does it once for every session
(`share_reach`); a session does it itself where the zygote could not.
Stdlib-only: the zygote imports it as a sibling script module.
"""

import fcntl
import json
import linecache
import os
import sys

from landlock import open_rule_paths  # a sibling script module

SHOWN_PATHS = {}  # "/proc/self/fd/N" -> the path it stands for (`reach_through_descriptors`)


def keep_unreachable(held, unreachable):
    """`{path: descriptor}` of the `held` paths (path -> O_PATH descriptor, opened as root) that `unreachable(path)`
    says the session's uid cannot reach, an ancestor standing for its subpaths; every other descriptor is closed."""
    kept = {}
    for path in sorted(held, key=len):
        fd = held[path]
        if any(path == old or path.startswith(old.rstrip("/") + "/") for old in kept) or not unreachable(path):
            os.close(fd)
        else:
            kept[path] = fd
    return kept


def cannot_stat(path):
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


# Descriptors the zygote opened for every session (`share_reach`): each jail keeps them through its fork.
SHARED_DESCRIPTORS = []
_SHARED_REACH = False  # whether the zygote did the rewrite of `reach_through_descriptors` for every session


def shared_by_zygote():
    """Whether the zygote pointed the import system at the root-only paths for every session (`share_reach`)."""
    return _SHARED_REACH


def share_reach(config, probe_uid):
    """In the zygote, once, before any session: where sessions drop to a uid of their own under Landlock, finds the
    read paths such a uid cannot reach (a child takes `probe_uid`, a uid of the sessions' range that owns nothing,
    and looks), keeps an O_PATH descriptor of each, and points the import system at them here, where every session
    inherits the rewrite (`reach_through_descriptors`). Each session rewrote them itself before: it wrote into,
    and so copied, the pages of every preloaded module (over a thousand with numpy and sympy), which halved how many
    sessions a second started in a container."""
    global _SHARED_REACH
    if not (config.get("landlock") and config.get("drop_uid")):
        return
    held = open_rule_paths(config["landlock"])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(probe_uid, probe_uid, probe_uid)
            os.setresuid(probe_uid, probe_uid, probe_uid)
            os.write(write_end, json.dumps([path for path in held if cannot_stat(path)]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        data = answer.read()
    os.waitpid(pid, 0)
    try:
        blocked = set(json.loads(data)) if data else None
    except ValueError:  # cut short
        blocked = None
    if blocked is None:  # the probe failed: each session looks for itself, as before
        for fd in held.values():
            os.close(fd)
        return
    kept = keep_unreachable(held, blocked.__contains__)
    for path, fd in kept.items():  # past the jail's own descriptors (0-5), which each jail sets up after its fork
        kept[path] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 6)
        os.close(fd)
    SHARED_DESCRIPTORS[:] = sorted(kept.values())
    reach_through_descriptors(kept)
    _SHARED_REACH = True


def close_all_but(low, keep):
    """Closes every descriptor from `low` on except those in `keep`."""
    for fd in sorted(k for k in keep if k >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def reach_through_descriptors(kept):
    """Points the interpreter at the read paths the sessions' uid cannot reach by the file modes (a virtual
    environment or interpreter under a mode-700 /root, as in most container images) through descriptors opened
    while still root (`kept`, path -> O_PATH descriptor): `/proc/self/fd/N` leads straight to the directory, so no
    capability is kept to get past the modes, and Landlock still rules what lies below. The path strings the
    import system keeps (sys.path, each module's `__path__`, `__file__` and spec, `sys.executable` and the
    prefixes) are rewritten."""
    mapped = {path: f"/proc/self/fd/{fd}" for path, fd in kept.items()}
    if not mapped:
        return
    SHOWN_PATHS.update({reached: path for path, reached in mapped.items()})

    def fix(value):
        if isinstance(value, str):
            for old, new in mapped.items():
                if value == old or value.startswith(old.rstrip("/") + "/"):
                    return new + value[len(old) :]
        return value

    def fix_list(values):
        if isinstance(values, list):
            values[:] = [fix(v) for v in values]
        elif isinstance(getattr(values, "_path", None), list):  # a namespace package's _NamespacePath
            values._path[:] = [fix(v) for v in values._path]

    sys.path[:] = [fix(p) for p in sys.path]
    for name in ("executable", "_base_executable", "prefix", "exec_prefix", "base_prefix", "base_exec_prefix"):
        if isinstance(getattr(sys, name, None), str):
            setattr(sys, name, fix(getattr(sys, name)))
    for module in list(sys.modules.values()):
        try:
            fix_list(module.__dict__.get("__path__"))
            if isinstance(module.__dict__.get("__file__"), str):
                module.__file__ = fix(module.__file__)
            spec = module.__dict__.get("__spec__")
            if spec is not None:
                if isinstance(spec.origin, str):
                    spec.origin = fix(spec.origin)
                fix_list(spec.submodule_search_locations)
        except Exception:  # noqa: BLE001, S112 - an odd module object: its later imports may fail, nothing else
            continue
    sys.path_importer_cache.clear()
    import importlib

    importlib.invalidate_caches()
    # Tracebacks name library files by the paths they were compiled from: their source lines are read through the
    # descriptors too, under the names the traceback shows.
    update = linecache.updatecache

    def updatecache(filename, module_globals=None):
        lines = update(filename, module_globals)
        reachable = fix(filename)
        if not lines and reachable != filename:
            lines = update(reachable, module_globals)
            if lines:
                linecache.cache[filename] = linecache.cache.pop(reachable)
        return lines

    linecache.updatecache = updatecache
