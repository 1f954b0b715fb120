"""What a cell's result is, read from a plain SandboxFusion service's reply: the replay program's own report (its last
JSON line), worded as `LocalSandbox` words it, or, where the program could not report, what the service says of the
process. Runs in the trainer."""

from __future__ import annotations

import json
import signal

from ..base import ExecResult, SessionBase, cut_output, signal_death_line, truncate_output


class ReplyReading:
    """Turns a service's response into the cell's `ExecResult`, and marks the session broken where its state is
    lost (a `RemoteSandbox`'s `timeout_s`, `cpu_time_s` and `max_output_chars` word it)."""

    def _result(self, session: SessionBase, code: str, response: dict, duration: float) -> ExecResult:
        """The `ExecResult` of a cell from the service's response: from the program's report, as `LocalSandbox`
        words it, or, when the program could not report, from what the service says of the process."""
        run = response.get("run_result") or {}
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        status, return_code = run.get("status"), run.get("return_code")
        if status == "TimeLimitExceeded":  # the replay or the interpreter's start took the service's whole limit
            return self._broken_result(session, "timeout", self._timeout_line(), duration, timed_out=True)
        report = _last_json_line(stdout) if status == "Finished" and return_code == 0 else None
        if report is None:
            # The program itself died (killed by the service or a cell's doing that reached it) or never ran.
            tail = truncate_output(stderr, self.max_output_chars, "tail")
            reason = f"exited with code {return_code}" if return_code is not None else f"ended with status {status}"
            line = f"SystemError: the interpreter process {reason}"
            return self._broken_result(
                session, "crash", tail + ("" if not tail or tail.endswith("\n") else "\n") + line, duration
            )
        if "replay_failed" in report:
            line = (
                f"SessionError: replaying earlier cell {report['replay_failed']} failed ({report.get('error')}); "
                "the session state is lost\n"
            )
            return self._broken_result(session, "replay failure", line, duration)
        if report.get("timeout"):
            return self._broken_result(session, "timeout", self._timeout_line(), duration, timed_out=True)
        try:
            output = cut_output(str(report["head"]), str(report["tail"]), int(report["total"]), self.max_output_chars)
            error, error_total = str(report.get("error") or ""), int(report.get("error_total") or 0)
        except (KeyError, TypeError, ValueError):
            invalid = "SystemError: the interpreter sent an invalid reply"
            return self._broken_result(session, "crash", invalid, duration)
        crash = report.get("crash")
        if isinstance(crash, dict):
            line, timed_out, infra = _crash_line(crash, self.cpu_time_s)
            session._broken = "infrastructure error" if infra else "timeout" if timed_out else "crash"
            return ExecResult(output + line, ok=False, timed_out=timed_out, duration_s=duration, infra_error=infra)
        if error:  # the traceback keeps its end: the last line says what happened
            output += cut_output(error, error, max(error_total, len(error)), self.max_output_chars, "tail")
        ok, fatal = report.get("ok") is True, report.get("fatal")
        if fatal:
            session._broken = str(fatal)
        elif ok:
            session._cells.append(code)
            session._numbers.append(session.calls)
            session._replay_s += float(report.get("duration_s") or 0.0)
        return ExecResult(output, ok=ok, timed_out=fatal == "cpu time limit", duration_s=duration)

    def _timeout_line(self) -> str:
        return f"TimeoutError: execution exceeded {self.timeout_s:g} s"

    @staticmethod
    def _broken_result(
        session: SessionBase, reason: str, output: str, duration: float, timed_out: bool = False
    ) -> ExecResult:
        session._broken = reason
        return ExecResult(output, ok=False, timed_out=timed_out, duration_s=duration)


def _last_json_line(stdout: str) -> dict | None:
    """The program's report: the last line of the service's stdout, if it is a JSON object."""
    try:
        report = json.loads(stdout.rstrip("\n").rpartition("\n")[2])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _crash_line(crash: dict, cpu_time_s: float) -> tuple[str, bool, bool]:
    """(line, timed_out, infra_error) for a cell whose process died, in `LocalSandbox`'s words."""
    if "signal" in crash:
        sig = int(crash["signal"])
        if sig == signal.SIGXCPU:
            return f"TimeoutError: CPU time limit of {cpu_time_s:g} s exceeded", True, False
        if sig == signal.SIGKILL:
            # The cell can send it to itself (the service gives it no pid namespace of its own), so it is the cell's
            # crash: were it the sandbox's failure, a snippet could leave its completion unscored (no -1) at will.
            # An outside kill (the service machine's OOM killer) reads the same and is scored like the cell's.
            return "SystemError: the interpreter process was killed (SIGKILL)", False, False
        return signal_death_line(sig), False, False
    return f"SystemExit: the interpreter process exited with code {int(crash.get('exit', -1))}", False, False
