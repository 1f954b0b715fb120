"""The program `RemoteSandbox` sends to the code execution service for each cell (stdlib only, any Python >= 3.8).

It replays the session's earlier cells silently, then forks: the child runs the new cell the way a local session
process does (output kept bounded, the same limits and messages) while the parent, out of the cell's way, holds the
cell to its own time limit and reports what happened as one JSON line on the service's stdout. Why each part:

- the service (SandboxFusion) sets the stack limit to its memory limit, so every thread would reserve that much
  address space: numeric libraries get one thread each (set before any cell imports them), and Python threads and
  child processes get the usual 8 MiB stack back;
- the service's time limit counts the interpreter's start and the replay: the cell's own limit is kept here;
- the service stops reading a process's output at about 200 KB (and then reports a time-out), and replaces the whole
  output when it is not valid UTF-8: what the cell writes never reaches the service, only a bounded, valid report.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

__all__ = ["build_driver"]

_DRIVER = r"""
import os
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_name] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")
import ast, base64, json, linecache, re, resource, select, signal, sys, tempfile, threading, time, traceback
from collections import deque

C = json.loads(base64.b64decode("@PAYLOAD@"))
STACK = 8 << 20


def limit(kind, value):
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    if soft == resource.RLIM_INFINITY or soft > value:
        try:
            resource.setrlimit(kind, (value, hard))
        except (ValueError, OSError):
            pass


limit(resource.RLIMIT_STACK, STACK)  # for the cells' child processes
limit(resource.RLIMIT_AS, C["memory_mb"] << 20)  # also where the service ignores its memory limit
try:
    threading.stack_size(STACK)
except (ValueError, RuntimeError):
    pass
sys.argv = [""]


@CELL_IO@


class CPUTimeExceeded(BaseException):
    pass


def on_sigxcpu(*_):
    raise CPUTimeExceeded


def valid(text):
    # As the client's ExecResult does: a lone surrogate (in an exception's message, say) becomes U+FFFD.
    return re.sub("[\ud800-\udfff]", "\ufffd", text)


def format_exception_here(exc, last_line=None):
    return format_exception(exc, [main.__code__.co_filename], last_line)


def register(source, name):
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


def run_cell(ns, source, name):
    # The child: the cell with a fresh CPU budget; returns its status (the output is on fd 1).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, on_sigxcpu)
    limit(resource.RLIMIT_CPU, int(C["cpu_time_s"]) + 1)
    limit(resource.RLIMIT_FSIZE, C["max_file_size_mb"] << 20)
    capture = Capture(C["max_output_chars"])
    sys.stdout = sys.stderr = capture
    error, fatal, ok = None, None, True
    try:
        register(source, name)
        tree = ast.parse(source, name)
        last = None
        if C["show"] and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), ns)
            if value is not None and capture.total == 0 and os.fstat(1).st_size == 0:
                capture.write(repr(value) + "\n")
    except MemoryError as exc:
        ok, fatal = False, "memory limit"
        error = format_exception_here(exc, "MemoryError: memory limit of %d MB exceeded" % C["memory_mb"])
    except CPUTimeExceeded as exc:
        ok, fatal = False, "cpu time limit"
        error = format_exception_here(exc, "TimeoutError: CPU time limit of %g s exceeded" % C["cpu_time_s"])
    except SystemExit as exc:
        ok = exc.code in (None, 0)
        error = "SystemExit: %s\n" % (exc.code,)
    except BaseException as exc:
        ok, error = False, format_exception_here(exc)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    text = capture.text()
    try:
        os.write(1, text.encode("utf-8", "replace"))
    except OSError:
        pass
    # The client keeps the end of a traceback (its last line says what happened): send no more than it keeps.
    error, keep = valid(error or ""), C["max_output_chars"]
    return {
        "ok": ok,
        "error": error[len(error) - keep :] if len(error) > keep else error,
        "error_total": len(error),
        "fatal": fatal,
        "skipped": max(0, capture.total - len(text)),
    }


def read_output(fd, skipped, limit):
    # The bounded head and tail of what the cell wrote, as the local sandbox reads them, then only the characters
    # that the client's truncation can keep (`keep` from each end).
    size = os.fstat(fd).st_size
    if size <= 2 * limit:
        head = tail = os.pread(fd, size, 0).decode("utf-8", "replace")
        total = len(head) + skipped
    else:
        head = os.pread(fd, limit, 0).decode("utf-8", "replace")
        tail = os.pread(fd, limit, size - limit).decode("utf-8", "replace")
        total = len(head) + len(tail) + size - 2 * limit + skipped
    keep = C["max_output_chars"]
    return head[:keep], tail[len(tail) - keep :] if len(tail) > keep else tail, total


def wait(pid, timeout):
    # The child's wait status, or None when it is still running after `timeout` seconds.
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
        finally:
            os.close(fd)
        return os.waitpid(pid, 0)[1] if ready else None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


def new_file():
    try:
        return os.memfd_create("retool-cell")
    except (AttributeError, OSError):
        return os.dup(tempfile.TemporaryFile().fileno())


def main():
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    report = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    sys.stdout = sys.stderr = Capture(1)  # what the cells saw when they first ran, but keeping nothing
    cells, numbers = C["cells"], C["numbers"]
    for i, source in zip(numbers, cells[:-1]):
        try:
            register(source, "<cell-%d>" % i)
            exec(compile(source, "<cell-%d>" % i, "exec"), ns)
        except SystemExit as exc:
            if exc.code not in (None, 0):  # a cell that ended with sys.exit(0) succeeded, and ends there again
                return report, {"replay_failed": i, "error": "SystemExit"}
        except BaseException as exc:
            return report, {"replay_failed": i, "error": type(exc).__name__}
    out, status = new_file(), new_file()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            report.close()  # the cell cannot write on the report's line
            try:
                os.setpgid(0, 0)  # so that what the cell starts can be killed with it
            except OSError:
                pass
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.write(status, json.dumps(run_cell(ns, cells[-1], "<cell-%d>" % numbers[-1])).encode())
        except BaseException:
            code = 70
        os._exit(code)
    wait_status = wait(pid, C["timeout_s"])
    duration = time.monotonic() - start
    if wait_status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the cell started
    except OSError:
        pass
    if wait_status is None:
        return report, {"timeout": True}
    result = {"duration_s": duration}
    try:
        reported = json.loads(os.pread(status, 1 << 24, 0) or b"null")
    except ValueError:
        reported = None
    if isinstance(reported, dict):
        result.update(reported)
    if os.WIFSIGNALED(wait_status):
        result["crash"] = {"signal": os.WTERMSIG(wait_status)}
    elif os.WEXITSTATUS(wait_status) != 0 or not isinstance(reported, dict):
        result["crash"] = {"exit": os.WEXITSTATUS(wait_status)}
    skipped = result.get("skipped") if isinstance(result.get("skipped"), int) else 0
    result["head"], result["tail"], result["total"] = read_output(out, skipped, 4 * C["max_output_chars"])
    return report, result


def send(report, result):
    # One line of valid UTF-8, small enough for the service to read whole (it stops at about 200 KB).
    for key in ("head", "tail", "error"):
        if isinstance(result.get(key), str):
            result[key] = valid(result[key])
    data = json.dumps(result, ensure_ascii=False).encode("utf-8")
    while len(data) > C["report_bytes"]:
        keep = len(result["head"]) // 2
        result["head"], result["tail"] = result["head"][:keep], result["tail"][len(result["tail"]) - keep :]
        result["error"] = result["error"][len(result["error"]) // 2 :]
        data = json.dumps(result, ensure_ascii=False).encode("utf-8")
    report.write(data + b"\n")
    report.flush()
    os._exit(0)


ERRORS = os.dup(2)
try:
    send(*main())
except BaseException:  # the program's own failure: the service's stderr says what, the client reports a crash
    os.write(ERRORS, valid(traceback.format_exc()).encode())
    os._exit(1)
"""

# The service reads at most about 200 KB of a process's output: the report stays well below.
REPORT_BYTES = 150_000


def build_driver(cells: list[str], numbers: list[int], **config) -> str:
    """The driver program for one request: the session's kept `cells` (replayed), then the new one (run).

    Args:
        cells (`list[str]`): Sources of the kept cells, then the new cell's.
        numbers (`list[int]`): Each cell's call number (tracebacks name it `<cell-N>`, as the local sandbox does).
        **config: `timeout_s`, `cpu_time_s`, `memory_mb`, `max_file_size_mb`, `max_output_chars` and `show`.
    """
    payload = dict(config, cells=cells, numbers=numbers, report_bytes=REPORT_BYTES)
    driver = _DRIVER.replace("@CELL_IO@", _cell_io_source())
    return driver.replace("@PAYLOAD@", base64.b64encode(json.dumps(payload).encode()).decode())


@functools.cache
def _cell_io_source() -> str:
    """`cell_io.py` as spliced into the driver: the same capture and tracebacks as a local session's."""
    return (Path(__file__).parent.parent / "jail" / "cell_io.py").read_text()
