"""Host side of the local sandbox's zygote process: start, fork requests, shutdown (`channel.py` runs the calls)."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from ..isolation import clean_env, warn_once
from ..jail.wire import frame, recv_frame

_WORKER = str(Path(__file__).parent.parent / "jail" / "worker.py")


class SandboxStartError(RuntimeError):
    """The zygote could not be started (bad interpreter, bubblewrap failure, ...)."""


class UnsafeSandboxError(SandboxStartError):
    """Refusing to run untrusted code as root without isolation (see `allow_root_without_isolation`)."""


class _Zygote:
    """Host side of the zygote process: start, fork requests, kills, shutdown.

    One lock serialises the control socket, so sessions of several threads can start and be killed safely."""

    def __init__(self, command: list[str], config: dict, start_timeout_s: float = 60.0):
        self.lock = threading.Lock()
        self.failed = False
        host_end, zygote_end = socket.socketpair()
        argv = [*command, sys.executable, "-I", _WORKER, json.dumps(config), str(zygote_end.fileno())]
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=clean_env(),
                pass_fds=(zygote_end.fileno(),),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise SandboxStartError(f"could not start the sandbox zygote: {exc}") from exc
        finally:
            zygote_end.close()
        self.control = host_end
        self.control.settimeout(start_timeout_s)
        try:
            hello = self._read()
            while "warning" in hello:
                warn_once(f"LocalSandbox: {hello['warning']}.")
                hello = self._read()
            self.network_isolated = bool(hello.get("network_isolated"))
            self.jail = bool(hello.get("jail"))
            self.own_uid_per_session = bool(hello.get("own_uid_per_session"))
        except (OSError, ConnectionError, ValueError) as exc:
            self.terminate()
            raise SandboxStartError(f"the sandbox zygote did not start ({' '.join(argv[:3])} ...): {exc}") from exc
        self.control.settimeout(30.0)

    def _read(self) -> dict:
        return recv_frame(self.control)

    @property
    def alive(self) -> bool:
        return not self.failed and self.proc.poll() is None

    def _exchange(self, send, replies: int) -> list[dict]:
        """One locked request/reply round; a broken control socket marks the zygote dead (it is then replaced)."""
        with self.lock:
            try:
                send()
                return [self._read() for _ in range(replies)]
            except (OSError, ConnectionError, ValueError):
                self.failed = True
                raise

    def spawn_many(self, requests: list[tuple[dict, int]]) -> list[dict]:
        """Sends every fork request before reading any reply: the zygote forks while earlier children set up."""

        def send():
            for request, fd in requests:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
                self.control.sendmsg([frame(request)], rights)

        return self._exchange(send, len(requests))

    def reserve(self, count: int) -> dict:
        """Asks the zygote to keep `count` jails ready (see `LocalSandbox.reserve`)."""
        return self._exchange(lambda: self.control.sendall(frame({"op": "reserve", "count": count})), 1)[0]

    def terminate(self, timeout_s: float = 5.0) -> None:
        try:
            with self.lock:
                self.control.sendall(frame({"op": "shutdown"}))
        except OSError:
            pass
        self.control.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            # Stuck: kill its whole process group (bubblewrap and its pid-1; the namespace dies with pid 1).
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
