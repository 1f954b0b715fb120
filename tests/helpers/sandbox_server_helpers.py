"""Starts `retool-trl sandbox-server` as a real process on a free 127.0.0.1 port, for the server's tests and the
benchmark (the same command line a user runs)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m retool_trl sandbox-server --host 127.0.0.1 --port P ...` in a subprocess, ready when /health is."""

    def __init__(self, *args: str, start_timeout_s: float = 120.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "retool_trl", "sandbox-server", "--host", "127.0.0.1", "--port"]
        self.proc = subprocess.Popen(
            [*command, str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: the jails it forked can be found and checked
            env=None if env is None else {**os.environ, **env},
        )
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox-server exited with {self.proc.returncode}: {self.proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError("sandbox-server did not answer /health in time")

    def metrics(self, token: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def terminate(self, timeout_s: float = 60.0) -> str:
        """SIGTERM (a graceful stop); returns the server's output."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout_s)
        return out

    def kill(self) -> None:
        """SIGKILL to the server's whole process group (a machine that goes away)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.communicate(timeout=30)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc: the kernel's own account)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
