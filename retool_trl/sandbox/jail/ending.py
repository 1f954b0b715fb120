"""How the zygote ends its jails: a closed session retired (frozen until a quiet moment, or killed), every dead child
reaped without blocking, the host told how each session died (the zygote's own wait status), and what a dead jail
leaves (cgroups, scratch, stray processes) removed. Runs in the zygote (`worker.py`); stdlib and this folder only.
"""

import os
import signal
import time

import watchdog
from freezer import set_frozen
from reaping import death_cause, own_limit_reached, rmdir_quietly
from watchdog import enforce, kill_strays
from wire import frame

RETIRE_WAIT_S = 0.5  # the longest a closed session waits frozen for a quiet moment to be killed (see `retire`)
_SETUP_ERROR_CHARS = 400


class JailEnding:
    """The ending half of the zygote (its `jails`, `spares`, `dying`, `graveyard`, `removers`, `killed_for`,
    `selector` and `config`): everything after a jail's session closed or its process died."""

    def report_death(self, jail, status, own_limit=None):
        """Tells the host how its session died: the zygote's own wait status, out of the cells' reach."""
        cause = death_cause(status, jail.cgroups, own_limit)
        if jail.evicted:
            cause.update(oom=True, evicted=True)
        if (bound := self.killed_for.get(jail.pid)) and cause.get("signal") == signal.SIGKILL:  # kept by the watchdog
            cause.update(oom=True) if bound == "memory" else cause.update(limit=bound)
        if not jail.set_up:  # died before its first cell could run: the jail itself failed
            cause["setup_failed"] = self.setup_error(jail)
        try:
            jail.host.sendall(frame({"crash": cause}))
        except OSError:
            pass  # the host has already given up on this session

    def setup_error(self, jail):
        """The last line of what a jail that failed to set up printed (its traceback, before any cell ran)."""
        try:
            size = os.fstat(jail.output).st_size
            text = os.pread(jail.output, 4096, max(0, size - 4096)).decode("utf-8", "replace")
        except OSError:
            text = ""
        lines = text.strip().splitlines()
        return lines[-1][:_SETUP_ERROR_CHARS] if lines else "no error message"

    def kill(self, jail):
        # pid 1 of its namespace: the kernel takes the rest of the jail along (without one: its process group).
        # Once reaped its pid may belong to another process: only a jail not yet reaped is signalled.
        for kill in (os.kill, os.killpg) if jail.pid in self.jails else ():
            try:
                kill(jail.pid, signal.SIGKILL)
            except OSError:
                pass
        set_frozen(jail.cgroup_kinds, False)  # the host parks sessions frozen: a frozen process dies once thawed
        self.forget(jail)

    def retire(self, jail):
        """A closed session. Its death costs about 4 ms of kernel CPU (unmapping numpy and sympy...), which in a burst
        of first calls on 2 CPUs doubled their latency: where a freezer holds it, it waits frozen for the zygote's
        next quiet moment (`end_dying`), less when memory is tight (`relieve`); else it is killed at once."""
        if jail.pid in self.jails and set_frozen(jail.cgroup_kinds, True):
            self.forget(jail)
            self.dying.append((time.monotonic(), jail))
        else:
            self.kill(jail)

    def end_dying(self, quiet, most=16):
        """Kills closed sessions waiting (`retire`), `most` per turn of the loop (a request waits for no more): all
        once no request and no close came for `_REFILL_AFTER_S` (`quiet`), else those that waited `RETIRE_WAIT_S`."""
        for _ in range(most):
            if not self.dying or not quiet and time.monotonic() - self.dying[0][0] < RETIRE_WAIT_S:
                break
            self.kill(self.dying.pop(0)[1])

    def relieve(self, memory):
        """The sandbox's memory is tight: closed sessions go first (their memory is nobody's any more), then the
        memory watch evicts the session holding the most."""
        closed = [jail.pid for _, jail in self.dying]
        self.end_dying(quiet=True, most=len(closed))
        # Waited for as any victim is (their memory is free once they are reaped), then the watch goes on as ever:
        # closes that keep coming cannot put its eviction off for longer than their deaths take.
        memory.doomed.update(closed)
        memory.relieve(self.jails)

    def forget(self, jail):
        if jail.closed:
            return
        for fd in (jail.ready_r, jail.host):
            if fd is not None:
                try:
                    self.selector.unregister(fd)
                except (KeyError, ValueError):
                    pass
        jail.close_fds()

    def reap(self):
        """Reaps every dead child without ever blocking, so any number of deaths at once cost one pass."""
        while True:
            try:  # looked at before it is reaped: a SIGKILLed jail's own limits are readable only until then
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            killed = info.si_code == os.CLD_KILLED and info.si_status == signal.SIGKILL and info.si_pid in self.jails
            own_limit = own_limit_reached(info.si_pid) if killed else None
            pid, status = os.waitpid(info.si_pid, 0)
            jail = self.jails.pop(pid, None)
            if jail is None:
                self.removers.discard(pid)
                continue  # a scratch remover, or a process of a dead session that came back to us
            if pid in self.spares:
                self.spares.remove(pid)
            if jail.ready_r is not None:
                self.on_ready(jail)  # a jail that wrote its "set up" byte and died at once
            if jail.host is not None and not jail.closed:
                self.report_death(jail, status, own_limit)
            self.killed_for.pop(pid, None)
            self.forget(jail)
            self.graveyard.extend(jail.cgroups)
            if jail.scratch:
                self.remove_later(jail.scratch)
        self.graveyard = [path for path in self.graveyard if not rmdir_quietly(path)]
        if not self.config["jail"]:  # without a pid namespace, what a dead session left comes back to us: ended
            kill_strays(self.pid, set(self.jails) | self.removers)

    def watch(self):
        """Where no cgroup bounds a session as a whole, or its scratch: the watchdog's sample (`watchdog.py`)."""
        self.watched_at = time.monotonic()
        live = [(jail.pid, jail.watched_scratch, jail.uid) for jail in self.jails.values() if not jail.closed]
        self.killed_for.update(enforce(live, self.bounds))
        kill_strays(self.pid, set(self.jails) | self.removers)  # what a killed session forked after the sample

    def remove_later(self, path):
        """Removes a scratch directory in a child: a million files cost that child, not the other sessions. An empty
        one, as most are, is removed here: a fork of the zygote (numpy and sympy mapped) costs more than the whole
        removal, and at a few hundred sessions a second the forks took a sixth of the zygote's time."""
        try:
            os.rmdir(path)  # the session's own directory, in a root-owned 0711 one: the session cannot swap it
            return
        except OSError:
            pass
        try:
            if (pid := os.fork()) == 0:
                watchdog.remove_scratch(path)
                os._exit(0)
            self.removers.add(pid)
        except OSError:
            watchdog.remove_scratch(path)

    def shutdown(self):
        for jail in list(self.jails.values()):
            self.kill(jail)
        deadline = time.monotonic() + 5
        while self.jails and time.monotonic() < deadline:  # cgroups left are the host's to remove
            self.reap()
            time.sleep(0.002)
        kill_strays(self.pid, self.removers)
        # Scratch removers (levels without a jail) are reaped too, or they become zombies of whoever adopts them (the
        # trainer itself when it is pid 1 of a container).
        while time.monotonic() < deadline and _reaped_or_waited():
            pass


def _reaped_or_waited():
    """Reaps one dead child or waits 2 ms for one; False once there is no child left."""
    try:
        if os.waitpid(-1, os.WNOHANG)[0] == 0:
            time.sleep(0.002)
        return True
    except ChildProcessError:
        return False
