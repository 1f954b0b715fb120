"""The sandbox server's settings, and how a request's limits are clamped by them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerConfig"]


@dataclass
class ServerConfig:
    """Settings of `retool-trl sandbox-server` (each is a command-line option of the same name).

    Args:
        host (`str`), port (`int`): Where to listen.
        token (`str`, *optional*): When set, every endpoint but `/health` wants `Authorization: Bearer <token>`.
        workers (`int`, *optional*): Cells computing at once (`LocalSandbox(num_workers=...)`; default: the CPUs).
        max_concurrency (`int`, defaults to `64`): Calls (cells) running at once; one more is answered `429` with
            `Retry-After`, never queued.
        max_sessions (`int`, defaults to `4096`): Live sessions at once; creating one more is answered `429`.
        idle_s (`float`, defaults to `600`): A session unused for this long is closed (its jail killed).
        timeout_s (`float`, defaults to `10`): A cell's wall-clock limit when the request names none.
        max_timeout_s (`float`, defaults to `60`): The most a request may ask for.
        memory_mb (`int`, defaults to `1024`), max_memory_mb (`int`, defaults to `4096`): The same for memory.
        max_output_chars (`int`, defaults to `200_000`): Output kept per `/run_code` call (SandboxFusion keeps about
            200 KB); a session's own limit is clamped to it.
        max_limit_profiles (`int`, defaults to `4`): Distinct (time, memory) limit pairs served at once, each by its
            own `LocalSandbox`; a request with yet another pair gets the nearest served pair that is not below it
            (else the largest served), and the reply says which limits applied.
        isolation (`str`, defaults to `"auto"`), allow_root_without_isolation (`bool`): As for `LocalSandbox`.
        grace_s (`float`, *optional*): On SIGTERM, how long running calls may take to finish before they are failed
            and every jail is killed (default: `max_timeout_s + 5`).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    workers: int | None = None
    max_concurrency: int = 64
    max_sessions: int = 4096
    idle_s: float = 600.0
    timeout_s: float = 10.0
    max_timeout_s: float = 60.0
    memory_mb: int = 1024
    max_memory_mb: int = 4096
    max_output_chars: int = 200_000
    max_limit_profiles: int = 4
    isolation: str = "auto"
    allow_root_without_isolation: bool = False
    grace_s: float | None = None

    def __post_init__(self):
        problems = []
        if self.max_concurrency < 1:
            problems.append(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_sessions < 1:
            problems.append(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not 0 < self.timeout_s <= self.max_timeout_s:
            problems.append(f"need 0 < timeout_s <= max_timeout_s, got {self.timeout_s} and {self.max_timeout_s}")
        if not 64 <= self.memory_mb <= self.max_memory_mb:
            problems.append(f"need 64 <= memory_mb <= max_memory_mb, got {self.memory_mb} and {self.max_memory_mb}")
        if self.idle_s <= 0:
            problems.append(f"idle_s must be > 0, got {self.idle_s}")
        if self.max_limit_profiles < 1:
            problems.append(f"max_limit_profiles must be >= 1, got {self.max_limit_profiles}")
        if problems:
            raise ValueError("; ".join(problems))
        if self.grace_s is None:
            self.grace_s = self.max_timeout_s + 5.0

    def clamp(self, timeout_s=None, memory_mb=None) -> tuple[float, int]:
        """The limits a request gets: what it asks (a number > 0), else the defaults, never above the maxima.

        Raises:
            `ValueError`: a limit that is not a positive number, in one line naming the field.
        """
        timeout = self.timeout_s if timeout_s is None else _positive("run_timeout", timeout_s)
        memory = self.memory_mb if memory_mb is None or _number("memory_limit_MB", memory_mb) <= 0 else memory_mb
        # A memory limit below what an interpreter needs to start is raised to 64 MiB, as `LocalSandbox` needs.
        return min(float(timeout), self.max_timeout_s), int(min(max(int(memory), 64), self.max_memory_mb))


def _number(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _positive(name, value) -> float:
    if _number(name, value) <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)
