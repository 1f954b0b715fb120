"""`LocalSandbox`: stateful Python sessions in forked, isolated, resource-limited processes on this machine."""

from __future__ import annotations

import base64
import itertools
import os
import tempfile
import threading
import weakref
from collections.abc import Iterable

from ..base import ExecResult, SessionBase, check_pairs, refusal
from ..isolation import (
    SANDBOX_SCRATCH_ROOT,
    IsolationLevel,
    Launch,
    choose_level,
    isolation_modes,
    isolation_summary,
    needed_under_temp,
    warn_once,
)
from ..isolation.fsuid import needed as fsuid_needed
from .admission import InFlight
from .batch import Batch
from .cgroups import SandboxCgroups
from .channel import SessionProcess
from .jail_supply import JailSupply
from .node import local_ranks, node_share_cpus, node_share_memory_mb, raise_open_file_limit
from .results import CallResults
from .zygote import _WORKER, SandboxStartError, UnsafeSandboxError, _Zygote

__all__ = ["LocalSandbox", "LocalSession"]

DEFAULT_PRELOAD = ("math", "fractions", "itertools", "functools", "collections", "random", "numpy", "sympy")


class LocalSession(SessionBase):
    """One stateful interpreter (one completion's notebook), bound to its own process in a `LocalSandbox`.

    Created by `LocalSandbox.session()`; the process is forked lazily at the first `run`. After a limit or a crash the
    session is *broken*: its process is gone, and every later `run` returns `ok=False` saying so.
    """

    _ids = itertools.count()

    def __init__(self, sandbox: LocalSandbox):
        super().__init__(sandbox)
        self._name = f"s{os.getpid()}-{next(self._ids)}"
        self._proc: SessionProcess | None = None
        self._finalizer: weakref.finalize | None = None
        self._in_use = threading.Lock()  # held while a cell runs: one cell at a time, even across threads

    def close(self) -> None:
        """Ends the session: its process exits and its scratch directory is removed. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def _mark_broken(self, reason: str) -> None:
        self._broken = reason
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._proc is not None:
            self._proc.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "live" if self._proc else "new"
        return f"LocalSession({self._name}, {state}, calls={self.calls})"


class LocalSandbox(JailSupply, CallResults):
    """A pool of isolated, resource-limited, stateful Python interpreters on this machine.

    One pre-started *zygote* process (inside bubblewrap when it works) imports the usual modules once, then forks one
    *jail* per session, ahead of demand: a process that is pid 1 of its own pid namespace, with its own mount, network
    and IPC namespaces (private size-bounded /tmp and pseudo-terminals, loopback only), memory, pids, freezer and cpu
    cgroups where the machine allows (one CPU at most per session, all sessions together under `total_memory_mb`),
    its own unprivileged uid, rlimits, a cleaned environment and a seccomp filter. State never leaks between sessions,
    a crash, timeout or memory blow-up only breaks that session, and whatever a cell starts (threads, child
    processes) is stopped when the cell returns: a call is over only once its jail holds nothing but the parked
    interpreter. The host, out of the cells' reach, reports every result: a cell cannot end its call early, exceed
    the output limit, its CPU budget (all its processes together) or its timeout, or outlive its session.

    `run_many` executes a batch concurrently: up to `num_workers` cells use the CPUs at once, and cells that are
    blocked (sleeping, waiting) do not hold a slot, so a slow cell never holds up the rest.

    Nothing starts before the first cell runs (or `reserve`); `close()` (or the interpreter's exit) stops every
    process.
    `isolation_report()` says which protections are in force on this machine.

    Args:
        num_workers (`int`, *optional*):
            Cells allowed to compute at once. Default: the CPUs this process may use (affinity mask, cgroup CPU
            quota), divided among the ranks a launcher started on this node (`LOCAL_WORLD_SIZE`), at least 1.
        timeout_s (`float`, defaults to `5.0`): Wall-clock limit of one cell, counted from its start.
        memory_mb (`int`, defaults to `1024`):
            Address-space limit of each process of a session and, where a memory cgroup is writable, the memory bound
            of the whole session (its processes and its /tmp together).
        cpu_time_s (`float`, *optional*): CPU seconds one cell may use (default: `timeout_s + 1`).
        max_processes (`int`, defaults to `64`): Processes and threads a session may have at once (pids cgroup).
        max_file_size_mb (`int`, defaults to `16`): Largest file a cell may write.
        max_open_files (`int`, defaults to `64`): Open file descriptors per process.
        max_output_chars (`int`, defaults to `4096`): Longer output keeps its beginning and end around a marker.
        show_last_expression (`bool`, defaults to `True`):
            Like a notebook, show the repr of a trailing expression when the cell printed nothing.
        isolation (`str`, defaults to `"auto"`):
            `"bwrap"` (bubblewrap namespaces), `"landlock"` (no privilege needed: Landlock, seccomp, rlimits, a uid per
            session where the trainer is root), `"none"` (rlimits, uids and a network namespace where the kernel
            allows) or `"auto"` (bubblewrap if it works, else Landlock, else refuse as root and warn otherwise). A
            named level that does not work raises `SandboxStartError`.
        network (`bool`, defaults to `False`): Let cells use the network.
        preload (`tuple[str, ...]`): Modules the zygote imports once so that sessions import them for free.
        scratch_mb (`int`, defaults to `1024`): Size bound of each session's private `/tmp` (and `/dev/shm`).
        max_files (`int`, defaults to `65536`): Files (inodes) each of a session's private temp directories may hold.
        allow_root_without_isolation (`bool`, defaults to `False`):
            As root, run cells even when bubblewrap does not work (they would then see the host file system with
            root's reach, bar the per-session uid). Without it, that situation raises `UnsafeSandboxError`.
        spares (`int`, *optional*): Jails kept started ahead of demand (default: `max(4, num_workers)`).
        total_memory_mb (`int`, *optional*):
            Memory bound of all sessions together (their common cgroup, where the machine has one): the sandbox's
            jails are killed before the trainer runs out of memory. Default: half of what this machine (or the
            container it runs in) allows, divided among the ranks on this node (`LOCAL_WORLD_SIZE`). An OOM kill
            that is not a session's own limit is an `infra_error`.

    Example:
        ```python
        with LocalSandbox(num_workers=2, timeout_s=5.0) as sandbox:
            session = sandbox.session()
            session.run("x = 6 * 7\\nprint(x)").output  # "42\\n"
        ```
    """

    reserve_idle_s = 60.0  # jails reserved beyond `spares` are released once none was taken for this long
    call_observer = None  # told each call's wait and latency when set (`host.batch.CallObserver`)
    # Set where every session's `memory_mb` is reserved out of `total_memory_mb` (the sandbox server): a session
    # killed because the sandbox's memory was full then stayed within its own bound, and that is an `infra_error`.
    # Unset (a trainer's own sandbox, whose sessions together may ask for more than the whole), the session holding
    # the most is the one that filled it, and it is that session's own `MemoryError`.
    memory_reserved = False

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        cpu_time_s: float | None = None,
        max_processes: int = 64,
        max_file_size_mb: int = 16,
        max_open_files: int = 64,
        max_output_chars: int = 4096,
        show_last_expression: bool = True,
        isolation: str = "auto",
        network: bool = False,
        preload: Iterable[str] = DEFAULT_PRELOAD,
        scratch_mb: int = 1024,
        max_files: int = 65536,
        allow_root_without_isolation: bool = False,
        spares: int | None = None,
        total_memory_mb: int | None = None,
    ):
        if isolation not in isolation_modes():
            raise ValueError(f"isolation must be one of {isolation_modes()}, got {isolation!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        # Defaults are this rank's share of the node (`node.py`): 8 ranks together claim the node once, not 8 times.
        self.num_workers = max(1, num_workers or node_share_cpus())
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.cpu_time_s = float(cpu_time_s if cpu_time_s is not None else timeout_s + 1)
        self.max_processes = int(max_processes)
        self.max_file_size_mb = int(max_file_size_mb)
        self.max_open_files = int(max_open_files)
        self.max_output_chars = int(max_output_chars)
        self.show_last_expression = bool(show_last_expression)
        self.isolation = isolation
        self.network = bool(network)
        self.preload = tuple(preload)
        self.scratch_mb = int(scratch_mb)
        self.max_files = int(max_files)
        self.allow_root_without_isolation = bool(allow_root_without_isolation)
        self.spares = int(spares) if spares is not None else max(4, self.num_workers)
        self.total_memory_mb = int(total_memory_mb) if total_memory_mb is not None else node_share_memory_mb()
        self._drop_privileges = os.geteuid() == 0  # until the level in force says (`IsolationLevel.drops_privileges`)
        self._cgroups: SandboxCgroups | None = None
        # Jails handed out by the zygote, not yet given a session.
        self._ready: list[tuple[_Zygote, SessionProcess]] = []
        self._ready_lock = threading.Lock()
        # Sessions given a process, while the trainer references them: `close()` ends each, so that none keeps the
        # trainer's descriptors (or its jail) past the sandbox.
        self._with_process: weakref.WeakSet[LocalSession] = weakref.WeakSet()
        self._zygote: _Zygote | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.in_flight = InFlight()  # cells running now, over every thread's batches
        self._host_scratch: str | None = None
        self._finalizer = weakref.finalize(self, LocalSandbox._shutdown, [None], None, os.getpid())
        self.isolation_used: str | None = None  # what `isolation="auto"` resolved to, once started
        self._launch: Launch | None = None
        self._level: IsolationLevel | None = None  # the level in force, once started

    # ------------------------------------------------------------------------------------------------ lifecycle

    def isolation_report(self) -> dict:
        """What isolation is actually in force (starts the sandbox): for logs, and for tests to skip honestly.

        `missing` lists, in words, each protection of the isolation contract that does not hold on this machine."""
        zygote = self._start()
        kinds = self._cgroups.kinds
        report = {
            "isolation": self.isolation_used,
            "own_uid_per_session": zygote.own_uid_per_session,
            "network_isolated": zygote.network_isolated or self._launch.ip_sockets_refused,  # Landlock: no IP socket
            "private_filesystem": self._level.private_filesystem,
            "jail_per_session": zygote.jail,
            "memory_cgroup": bool(kinds & {"memory1", "memory"}),
            "pids_cgroup": "pids" in kinds,
            "freezer_cgroup": bool(kinds & {"freezer", "v2"}),
            "cpu_cgroup": "cpu" in kinds,
            "seccomp": self._launch.seccomp()[0] is not None,
            "landlock": self._launch.landlock is not None,
            "landlock_abi": int((self._launch.landlock or {}).get("abi", 0)),
            "filesystem_confined": self._level.filesystem_confined,
        }
        missing = list(self._cgroups.missing) + list(self._launch.missing)
        if not zygote.jail:
            missing.append("per-session jail (private /tmp, network, IPC and pid namespaces)")
        if not report["own_uid_per_session"] and not any(m.startswith("own uid") for m in missing):
            missing.append("own uid per session (sessions can signal each other)")
        if (
            not report["network_isolated"]
            and not report["landlock"]
            and not any(m.startswith("network") for m in missing)
        ):
            missing.append("network isolation")
        if not report["seccomp"]:
            missing.append(f"seccomp filter: {self._launch.seccomp()[1]}")
        return {**report, "missing": missing, "summary": isolation_summary(report)}

    def _start(self) -> _Zygote:
        """Starts the zygote on first use (or after it died): no processes exist before that."""
        with self._lock:
            if self._closed:
                raise RuntimeError("LocalSandbox is closed")
            if self._zygote is not None and self._zygote.alive:
                return self._zygote
            if self._cgroups is None:
                raise_open_file_limit()
                self._cgroups = SandboxCgroups(
                    f"retool-sandbox-{os.getpid()}-{id(self):x}",
                    self.total_memory_mb,
                    cpu_weight=self.num_workers,
                    ranks=local_ranks()[1],
                )
            command, scratch_root = self._isolation_command()
            program, why_not = self._launch.seccomp()
            kinds = self._cgroups.kinds
            if program is None:
                warn_once(f"LocalSandbox: no seccomp filter for sessions: {why_not}.")
            config = {
                "memory_mb": self.memory_mb,
                "cpu_time_s": self.cpu_time_s,
                "max_processes": self.max_processes,
                "max_file_size_mb": self.max_file_size_mb,
                "max_open_files": self.max_open_files,
                "max_output_chars": self.max_output_chars,
                "show_last_expression": self.show_last_expression,
                "preload": list(self.preload),
                "scratch_root": scratch_root,
                "jail_scratch_root": SANDBOX_SCRATCH_ROOT,
                "scratch_mb": self.scratch_mb,
                "max_files": self.max_files,
                "network": self.network,
                "jail": self._level.jails(),
                "needed_under_temp": needed_under_temp(_WORKER),
                "drop_uid": self._drop_privileges,
                "watch_by_fsuid": self._drop_privileges and fsuid_needed(),  # root without CAP_SYS_PTRACE
                "landlock": self._launch.landlock,
                # No memory or pids cgroup to bound a session as a whole: the zygote samples its processes instead.
                "session_watchdog": not (kinds & {"memory1", "memory", "v2"}) or "pids" not in kinds,
                "cgroups": self._cgroups.roots,
                "seccomp": base64.b64encode(program).decode() if program else None,
                "spares": self.spares,
                "reserve_idle_s": self.reserve_idle_s,
            }
            old = self._zygote
            self._zygote = _Zygote(command, config)
            if old is not None:
                old.terminate()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(
                self, LocalSandbox._shutdown, [self._zygote], self._host_scratch, os.getpid(), self._cgroups
            )
            return self._zygote

    def _isolation_command(self) -> tuple[list[str], str]:
        """Picks the isolation level (`isolation.choose_level`) and asks it what it means here: the zygote's command
        and where sessions' scratch directories live. Refuses where the level asked for does not run, and where the
        level in force refuses root without the user's opt-in."""
        writable = tuple(path for _, path in self._cgroups.roots)
        choice = choose_level(self.isolation, self.network)
        level, why = choice.level, choice.why
        if level is None:
            raise SandboxStartError(f"isolation={self.isolation!r} does not work here: {why}")
        refusal = None if self.allow_root_without_isolation else level.root_refusal(why, choice.fell_back)
        if refusal is not None:
            raise UnsafeSandboxError(refusal)
        launch = level.launch(_WORKER, self.network, writable, why)
        self._level, self._launch = level, launch
        self.isolation_used = level.name
        self._drop_privileges = level.drops_privileges(launch, _WORKER)
        warning = level.warning(why, self._drop_privileges)
        if warning is not None:
            warn_once(warning)
        if launch.scratch_root is not None:  # a scratch root inside the level's own private file system
            return launch.command, launch.scratch_root
        if self._host_scratch is None:
            self._host_scratch = tempfile.mkdtemp(prefix="retool-sandbox-")
            os.chmod(self._host_scratch, 0o711)
        return launch.command, os.path.join(self._host_scratch, "s")

    @staticmethod
    def _shutdown(zygote_box: list, host_scratch: str | None, owner_pid: int, cgroups=None) -> None:
        if os.getpid() != owner_pid:
            return  # a forked child of the trainer (a data loader worker, say) exiting: the sandbox is not its to stop
        zygote = zygote_box[0]
        if zygote is not None:
            zygote.terminate()
        if cgroups is not None:
            cgroups.remove()
        if host_scratch:
            import shutil

            shutil.rmtree(host_scratch, ignore_errors=True)

    def close(self) -> None:
        """Stops every session and the zygote; removes all scratch directories. Idempotent. A session the caller
        still holds answers "this session is closed" from then on, and keeps none of the trainer's descriptors."""
        with self._lock:
            self._closed = True
        with self._ready_lock:
            ready, self._ready = self._ready, []
            sessions = list(self._with_process)
        for _, proc in ready:
            proc.close()
        for session in sessions:
            session.close()
        self._finalizer()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- sessions

    def session(self) -> LocalSession:
        """A new, empty session (no process until its first `run`)."""
        if self._closed:
            raise RuntimeError("LocalSandbox is closed")
        return LocalSession(self)

    # ------------------------------------------------------------------------------------------------- running

    def run_many(self, pairs: Iterable[tuple[LocalSession, str]]) -> list[ExecResult]:
        """Runs `(session, code)` pairs concurrently; results come back in input order.

        Cells of different sessions run in parallel; several cells of one session run one after the other, in order.
        """
        pairs = check_pairs(pairs)
        for i, (session, _) in enumerate(pairs):
            if not isinstance(session, LocalSession) or session._sandbox is not self:
                raise ValueError(f"run_many item {i}: the session does not belong to this LocalSandbox")
        return Batch(self, pairs).run()

    def refuse(self, session: LocalSession) -> ExecResult | None:
        """The result of a call that cannot run (closed or broken session, closed sandbox), or None."""
        return refusal(session._closed or self._closed, session._broken)
