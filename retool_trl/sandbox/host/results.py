"""How the local sandbox turns what it saw of a call into the `ExecResult` the model reads: a settled call's status and
output, a limit (wall clock, CPU budget), or a death as the zygote accounts for it. Output and error text are bounded
together; a failure is the session's own (a limit, a crash) or the sandbox's (`infra_error`), never guessed.
"""

from __future__ import annotations

import signal

from ..base import ExecResult, cut_output, signal_death_line


class CallResults:
    """Mixed into `LocalSandbox`: the results of calls. Uses its `max_output_chars`, `timeout_s`, `cpu_time_s`,
    `memory_mb`, `memory_reserved`, `max_processes`, `scratch_mb`, `max_files` and `_kill(session)`."""

    def result_of_reply(self, session, reply: dict, duration: float) -> ExecResult:
        """Turns a settled call (its status and output, or the zygote's account of a death) into the `ExecResult`
        the model sees."""
        try:
            head, tail, total = str(reply["head"]), str(reply["tail"]), int(reply["total"])
            crash = reply.get("crash")
            error = str(reply["error"]) if reply.get("error") else ""
            ok = bool(reply["ok"]) if crash is None else False
        except (KeyError, TypeError, ValueError):
            return self.result_of_crash(session, duration, "the interpreter sent an invalid reply")
        if crash is not None:
            result = self.result_of_crash(session, duration, crash=crash if isinstance(crash, dict) else {})
            return ExecResult(
                self._bounded(head, tail, total, result.output),
                ok=False,
                timed_out=result.timed_out,
                duration_s=duration,
                infra_error=result.infra_error,
            )
        output = self._bounded(head, tail, total, error)
        fatal = reply.get("fatal")
        if fatal:
            self._kill(session)
            session._mark_broken(str(fatal))
        return ExecResult(output, ok=ok, timed_out=fatal == "cpu time limit", duration_s=duration)

    def _bounded(self, head: str, tail: str, total: int, error: str) -> str:
        """The cell's output followed by its error text, `max_output_chars` at most together (markers included).

        The error keeps its end (its last line says what happened) and gets at least half the bound when both are
        long; the output keeps its beginning and end around a marker."""
        limit = self.max_output_chars
        if not error:
            return cut_output(head, tail, total, limit)
        keep_error = min(len(error), max(limit // 2, limit - total))
        output = cut_output(head, tail, total, limit - keep_error)
        return output + cut_output(error, error, len(error), keep_error, "tail")

    def _sessions_are_pid_one(self) -> bool:
        """Whether each session's interpreter is pid 1 of its own pid namespace (a jail), where no process of the
        session can send it SIGKILL: only then is a SIGKILL someone else's doing."""
        zygote = getattr(self, "_zygote", None)
        return bool(zygote is not None and getattr(zygote, "jail", False))

    def result_of_cpu_limit(self, session, duration: float) -> ExecResult:
        """The jail's processes together used more CPU than a call may: the session is killed and broken."""
        self._kill(session)
        session._mark_broken("timeout")
        line = f"TimeoutError: CPU time limit of {self.cpu_time_s:g} s exceeded (all the session's processes together)"
        return ExecResult(line, ok=False, timed_out=True, duration_s=duration)

    def result_of_timeout(self, session, duration: float) -> ExecResult:
        """The call ran past its wall-clock limit: the session is killed and broken."""
        self._kill(session)
        session._mark_broken("timeout")
        return ExecResult(
            f"TimeoutError: execution exceeded {self.timeout_s:g} s", ok=False, timed_out=True, duration_s=duration
        )

    def result_of_crash(
        self, session, duration: float, why: str | None = None, crash: dict | None = None
    ) -> ExecResult:
        """The session process died (or misbehaved) during a cell: say why, in the cell's own terms.

        `crash` is the zygote's account of the death (its own wait status, out of the cell's reach); without one
        the zygote itself was lost, which is the sandbox's failure, not the cell's."""
        self._kill(session)
        timed_out, infra = False, False
        if why is not None:
            line = f"SystemError: {why}"
        elif crash is None:
            line, infra = "SystemError: the sandbox lost the interpreter process", True
        elif crash.get("setup_failed"):  # it died before any cell ran: the jail's failure, not a cell's
            line = f"SystemError: the sandbox could not set up the session's jail: {crash['setup_failed']}"
            infra = True
        elif "signal" in crash:
            sig = int(crash["signal"])
            if sig == signal.SIGXCPU:
                line, timed_out = f"TimeoutError: CPU time limit of {self.cpu_time_s:g} s exceeded", True
            elif sig == signal.SIGKILL and crash.get("evicted") and self.memory_reserved:
                # Within its own reserved bound: the memory was full of others' (or the sandbox's own) use.
                line, infra = (
                    (
                        "SystemError: the sandbox's memory was full although this session stayed within its own "
                        f"{self.memory_mb} MB (the session was killed)"
                    ),
                    True,
                )
            elif sig == signal.SIGKILL and crash.get("evicted"):  # the sandbox's bound, reached mostly by this one
                line = (
                    "MemoryError: the sandbox's memory was full and this session held the most of it (files in "
                    "its /tmp and /dev/shm count; the session was killed)"
                )
            elif sig == signal.SIGKILL and crash.get("oom"):
                line = f"MemoryError: memory limit of {self.memory_mb} MB exceeded (the session was killed)"
            elif sig == signal.SIGKILL and crash.get("limit") == "processes":
                line = (
                    f"RuntimeError: more than {self.max_processes} processes and threads at once (the session was "
                    "killed)"
                )
            elif sig == signal.SIGKILL and crash.get("limit") == "scratch":
                line = (
                    f"OSError: the session's files passed {self.scratch_mb} MB or {self.max_files} files (the "
                    "session was killed)"
                )
            elif sig == signal.SIGKILL and crash.get("own_limit"):
                # The kernel enforced a hard limit the cell lowered itself: the cell's failure, scored as such.
                limit = crash["own_limit"]
                line = f"TimeoutError: the interpreter passed the {limit} limit the cell set itself (SIGKILL)"
                timed_out = True
            elif sig == signal.SIGKILL and not self._sessions_are_pid_one():
                # Without a pid namespace of its own the cell can SIGKILL its interpreter itself: were that the
                # sandbox's failure, a snippet could leave its completion unscored (no -1) at will.
                line = "SystemError: the interpreter process was killed (SIGKILL)"
            elif sig == signal.SIGKILL:  # pid 1 of its own namespace, which nothing inside can SIGKILL: from outside
                line, infra = "SystemError: the interpreter process was killed from outside (SIGKILL)", True
            else:
                line = signal_death_line(sig)
        else:
            line = f"SystemExit: the interpreter process exited with code {int(crash.get('exit', -1))}"
        session._mark_broken("infrastructure error" if infra else "timeout" if timed_out else "crash")
        return ExecResult(line, ok=False, timed_out=timed_out, duration_s=duration, infra_error=infra)
