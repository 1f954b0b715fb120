"""The sandbox server's settings (each a command-line option of the same name, with its help text), and how a
`/run_code` request's limits are clamped by them (a session's limits are validated instead: `limits.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ServerConfig"]


def _opt(default, help_text: str):
    """A setting with its `--help` line (the command line is built from these fields)."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class ServerConfig:
    """Settings of `retool-trl sandbox-server` (each is a command-line option of the same name).

    Args:
        host (`str`), port (`int`): Where to listen.
        token (`str`, *optional*): When set, every endpoint but `/health` wants `Authorization: Bearer <token>`.
        tokens (`dict[str, str]`, *optional*): Per-tenant tokens instead (`token -> tenant name`, from
            `--tokens-file`): every endpoint but `/health` wants one of them, and the per-client bounds are then kept
            per tenant, whatever addresses its calls come from.
        workers (`int`, *optional*): The node's CPU slots: cells *computing* at once, over every limit profile
            together (a cell that sleeps or waits gives its slot away). Default: the CPUs this process may use.
        max_concurrency (`int`, defaults to `64`): Cells *running* at once (computing, sleeping or waiting; one per
            session at most, each request runs its cells one after the other). One more is answered `429` with
            `Retry-After`, never queued.
        max_sessions (`int`, defaults to `4096`): Live sessions at once; creating one more is answered `429`.
        max_sessions_per_client (`int`, defaults to `1024`): Live sessions one client may hold. A client is its
            tenant where `tokens` are given, else its peer address, with every loopback address one client and an
            IPv6 address counted as its /64.
        idle_s (`float`, defaults to `600`): A session unused for this long is closed (its jail killed).
        fresh_idle_s (`float`, defaults to `30`): The same for a session that never ran a cell.
        timeout_s (`float`, defaults to `10`): A cell's wall-clock limit when the request names none.
        max_timeout_s (`float`, defaults to `60`): The most a request may ask for.
        memory_mb (`int`, defaults to `1024`), max_memory_mb (`int`, defaults to `4096`): The same for memory.
        max_output_chars (`int`, defaults to `200_000`): Output kept per `/run_code` call (SandboxFusion keeps about
            200 KB), and the most a session may ask for.
        max_limit_profiles (`int`, defaults to `4`): Distinct limit sets served at once, each by its own jails; they
            share the node's CPU slots (`workers`) and memory budget (`total_memory_mb`). A set no live
            session uses is given back when another is needed; when every one is in use, a new set is answered `429`.
        max_profiles_per_client (`int`, defaults to `2`): Limit sets (beyond the server's default) one client may
            hold, so that one client cannot take them all.
        total_memory_mb (`int`, *optional*): Memory of all sessions together (default: half of what this machine or
            its container allows). Each live session (and each running `/run_code` call) reserves its `memory_mb`
            of it; one that does not fit is answered `429` (`memory_full`), so that sessions others park rarely
            leave a cell short (the sandbox frees memory at about 90% of the budget: when nearly every session uses
            its whole reservation, a cell within its own `memory_mb` may still be killed, an infrastructure error).
        max_memory_per_client_mb (`int`, *optional*): What one client's live sessions (and running `/run_code`
            calls) may reserve of `total_memory_mb` together; one more is answered `429`. Default: half of it.
        max_cells_per_request (`int`, defaults to `16`): Cells one `/sessions/{id}/run` request may carry.
        max_body_bytes (`int`, defaults to `8 MiB`): Largest request body; a larger one is answered `413`.
        header_timeout_s (`float`, defaults to `10`): A connection must send a whole request head this soon after it
            opens (or after the head's first bytes, on a kept-alive connection), else it is closed.
        body_timeout_s (`float`, defaults to `30`): A request's body must arrive this soon, else `408`.
        isolation (`str`, defaults to `"auto"`), allow_root_without_isolation (`bool`): As for `LocalSandbox`.
        grace_s (`float`, *optional*): On SIGTERM, how long running calls may take to finish before they are failed
            and every jail is killed (default: `max_timeout_s + 5`).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    tokens: dict[str, str] | None = None
    workers: int | None = _opt(
        None, "CPU slots: cells computing at once over every limit profile (a sleeping cell gives its slot away); "
        "default: this machine's usable CPUs."
    )  # fmt: skip
    max_concurrency: int = _opt(
        64, "Cells running at once (computing or waiting; at most one per session); one more gets 429, never queued."
    )
    max_sessions: int = _opt(4096, "Live sessions at once; one more gets 429.")
    max_sessions_per_client: int = _opt(
        1024, "Live sessions one client may hold; one more gets 429. A client is its tenant with --tokens-file, "
        "else its address: all of loopback is one client, an IPv6 address counts as its /64."
    )  # fmt: skip
    idle_s: float = _opt(600.0, "A session unused for this many seconds is closed.")
    fresh_idle_s: float = _opt(30.0, "A session that never ran a cell is closed after this many idle seconds.")
    timeout_s: float = _opt(10.0, "A cell's wall-clock limit when the request names none.")
    max_timeout_s: float = _opt(60.0, "The longest wall-clock limit a request may ask for.")
    memory_mb: int = _opt(1024, "A session's memory limit when the request names none.")
    max_memory_mb: int = _opt(4096, "The largest memory limit a request may ask for.")
    max_output_chars: int = _opt(200_000, "Output kept per /run_code call; the most a session may ask for.")
    max_limit_profiles: int = _opt(
        4, "Distinct limit sets served at once; they share the CPU slots and the memory budget."
    )
    max_profiles_per_client: int = _opt(2, "Limit sets beyond the default that one client may hold at once.")
    total_memory_mb: int | None = _opt(
        None, "Memory of all sessions together, each live session reserving its memory_mb of it (one that does "
        "not fit gets 429); default: half the machine's."
    )  # fmt: skip
    max_memory_per_client_mb: int | None = _opt(
        None, "Memory one client's live sessions may reserve together (one more gets 429); default: half the "
        "memory budget, so that one client's idle sessions never hold all of it."
    )  # fmt: skip
    max_cells_per_request: int = _opt(16, "Cells one /sessions/{id}/run request may carry.")
    max_body_bytes: int = _opt(8 << 20, "Largest request body in bytes; a larger one gets 413.")
    header_timeout_s: float = _opt(10.0, "Seconds a connection has to send a whole request head, else it is closed.")
    body_timeout_s: float = _opt(30.0, "Seconds a request has to send its body, else 408.")
    isolation: str = _opt("auto", "Isolation level, as LocalSandbox's isolation.")
    allow_root_without_isolation: bool = _opt(False, "As root, run cells even where no isolation works.")
    grace_s: float | None = _opt(None, "On SIGTERM, seconds running calls may take to finish (default: max + 5).")

    def __post_init__(self):
        problems = []
        for name in (
            "max_concurrency",
            "max_sessions",
            "max_sessions_per_client",
            "max_limit_profiles",
            "max_profiles_per_client",
            "max_cells_per_request",
            "max_body_bytes",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.timeout_s <= self.max_timeout_s:
            problems.append(f"need 0 < timeout_s <= max_timeout_s, got {self.timeout_s} and {self.max_timeout_s}")
        if not 64 <= self.memory_mb <= self.max_memory_mb:
            problems.append(f"need 64 <= memory_mb <= max_memory_mb, got {self.memory_mb} and {self.max_memory_mb}")
        for name in ("idle_s", "fresh_idle_s", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_output_chars < 64:
            problems.append(f"max_output_chars must be >= 64, got {self.max_output_chars}")
        if self.total_memory_mb is not None and self.total_memory_mb < self.memory_mb:
            problems.append(
                f"total_memory_mb must hold one session of the default memory_mb ({self.memory_mb}), got "
                f"{self.total_memory_mb}"
            )
        if self.max_memory_per_client_mb is not None and self.max_memory_per_client_mb < self.memory_mb:
            problems.append(
                f"max_memory_per_client_mb must hold one session of the default memory_mb ({self.memory_mb}), got "
                f"{self.max_memory_per_client_mb}"
            )
        if self.token and self.tokens:
            problems.append("give one token for all (token) or one per tenant (tokens), not both")
        if problems:
            raise ValueError("; ".join(problems))
        if self.grace_s is None:
            self.grace_s = self.max_timeout_s + 5.0

    def clamp(self, timeout_s=None, memory_mb=None) -> tuple[float, int]:
        """The limits a `/run_code` request gets: what it asks (a number > 0), else the defaults, never above the
        maxima (SandboxFusion's callers send their own and expect them capped, not refused).

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
