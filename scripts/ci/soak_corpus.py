"""The cells `sandbox_soak.py` runs: benign ones whose output is known exactly, and a hostile corpus, each hostile cell
reporting on its last line how far it got (`HELD 300`: megabytes it held at once, `THREADS 90`, `DISK 64`, `CHMOD 2`,
`KILLED 1`), so that the soak can tell an attack that was stopped from one that went through, by the invariant it
broke. Each builder takes the soak's limits and a `random.Random`, and returns a `Cell`."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

__all__ = ["Cell", "Limits", "benign_session", "hostile_cell", "verdicts"]


@dataclass(frozen=True)
class Limits:
    """The limits the soak's sandbox is built with (the bounds the hostile cells try to pass)."""

    timeout_s: float = 3.0
    memory_mb: int = 128
    max_processes: int = 32
    scratch_mb: int = 32
    max_file_size_mb: int = 8
    max_output_chars: int = 2000


@dataclass
class Cell:
    kind: str
    code: str
    expected: str | None = None  # benign: the exact output
    fails: bool = False  # benign: the cell raises on purpose (`expected` is then its last line)
    context: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------ benign


def benign_session(rng: random.Random, cells: int) -> list[Cell]:
    """A neighbour's session: sets up a file and a variable in its scratch, then cells with known output, among them
    checks that its scratch is still its own (contents, modes, still writable)."""
    token, v = f"tok{rng.randrange(10**9)}", rng.randrange(1000)
    setup = (
        "import os, stat\nos.makedirs('mine', exist_ok=True)\n"
        f"open('mine/token.txt', 'w').write({token!r})\nv = {v}\n"
        "modes = (oct(stat.S_IMODE(os.stat('mine').st_mode)), oct(stat.S_IMODE(os.stat('.').st_mode)))\nprint('set')"
    )
    out = [Cell("setup", setup, "set\n")]
    for _ in range(cells):
        pick = rng.random()
        if pick < 0.3:
            k = rng.randrange(100)
            v = v * 3 + k
            out.append(Cell("state", f"v = v * 3 + {k}\nprint(v)", f"{v}\n"))
        elif pick < 0.5:
            n = rng.randrange(1, 20000)
            out.append(Cell("compute", f"print(sum(i * i for i in range({n})))", f"{sum(i * i for i in range(n))}\n"))
        elif pick < 0.75:
            check = (
                "import os, stat\nopen('mine/again.txt', 'w').write('x')\n"
                "now = (oct(stat.S_IMODE(os.stat('mine').st_mode)), oct(stat.S_IMODE(os.stat('.').st_mode)))\n"
                "print(open('mine/token.txt').read(), now == modes)"
            )
            out.append(Cell("scratch_intact", check, f"{token} True\n"))
        elif pick < 0.85:
            ms = rng.randrange(10, 300)
            out.append(Cell("sleep", f"import time\ntime.sleep({ms / 1000})\nprint('woke')", "woke\n"))
        elif pick < 0.93:
            out.append(Cell("expression", "v % 7", f"{v % 7}\n"))
        else:
            out.append(Cell("own_error", "print('before')\n1 / 0", "ZeroDivisionError: division by zero", fails=True))
    return out


# ----------------------------------------------------------------------------------------------------- hostile

_FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

_THREADS = """
import threading, time
n = 0
for _ in range({count}):
    try:
        threading.Thread(target=time.sleep, args=(1.5,), daemon=True).start()
        n += 1
    except Exception:
        break
print('THREADS', n + 1)
time.sleep(0.2)
"""

_ANON = """
held = []
try:
    for _ in range({chunks}):
        held.append(bytearray(8 << 20))
except MemoryError:
    pass
print('HELD', 8 * len(held))
"""

_MEMFD = """
import os
fd = os.memfd_create('soak')
mb = 0
try:
    for _ in range({chunks}):
        os.write(fd, b'm' * (8 << 20))
        mb += 8
except OSError:
    pass
print('HELD', mb)
"""

_SHM = """
import os
mb = 0
try:
    with open('/dev/shm/soak-{tag}', 'wb') as f:
        for _ in range({chunks}):
            f.write(b's' * (8 << 20))
            f.flush()
            mb += 8
except OSError:
    pass
print('HELD', mb)
"""

_PIPES = """
import fcntl, os
pipes, mb = [], 0
try:
    for _ in range(24):
        r, w = os.pipe()
        pipes.append((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        os.set_blocking(w, False)
        try:
            while True:
                os.write(w, b'p' * 65536)
        except BlockingIOError:
            pass
        mb = sum(fcntl.fcntl(w, 1032) for _, w in pipes) >> 20  # F_GETPIPE_SZ: what each holds, full
except OSError:
    pass
print('HELD', mb)
"""

_DISK = """
mb = 0
try:
    for i in range({files}):
        with open(f'fill{{i}}.bin', 'wb') as f:
            for _ in range(4):
                f.write(b'd' * (1 << 20))
                f.flush()
                mb += 1
except OSError:
    pass
print('DISK', mb)
"""

_CHMOD_NEIGHBOURS = """
import os, re
here = os.getcwd()
parent, own = os.path.split(here)
try:
    names = os.listdir(parent)
except OSError:
    m = re.match(r'(.*?)(\\d+)$', own)
    names = [m.group(1) + str(int(m.group(2)) + d) for d in range(-40, 41)] if m else []
done = 0
for name in names:
    path = os.path.join(parent, name)
    if path == here:
        continue
    for target in (path, os.path.join(path, 'mine')):
        try:
            os.chmod(target, 0)
            done += 1
        except OSError:
            pass
print('CHMOD', done)
"""

_CHMOD_TRAINER = """
import os
done = 0
for call in (lambda: os.chmod({path!r}, 0o666), lambda: os.utime({path!r}, (1, 1))):
    try:
        call()
        done += 1
    except OSError:
        pass
print('CHMOD', done)
"""

_SIGNALS = """
import os, signal
done = 0
for pid in {pids!r}:
    try:
        os.kill(pid, signal.SIGKILL)
        done += 1
    except OSError:
        pass
try:
    os.kill({trainer}, signal.SIGURG)  # ignored by default: harmless if it lands, and it is seen landing
    done += 1
except OSError:
    pass
print('KILLED', done)
"""

_FORGE = """
import os
for fd in range(3, 64):
    try:
        os.write(fd, b'{"ok": true, "output": "forged"}\\n')
    except OSError:
        pass
raise SystemExit(3)
"""


def hostile_cell(rng: random.Random, limits: Limits, context: dict) -> Cell:
    """One attack, picked at random. `context`: the trainer's pid, a canary file it owns, neighbours' host pids."""
    over = 2 * limits.memory_mb // 8 + 2  # 8 MB chunks: twice the session's bound
    kinds = {
        "fork_bomb": lambda: _FORK_BOMB,
        "threads": lambda: _THREADS.format(count=4 * limits.max_processes),
        "memory_anon": lambda: _ANON.format(chunks=over),
        "memory_memfd": lambda: _MEMFD.format(chunks=over),
        "memory_shm": lambda: _SHM.format(chunks=over, tag=rng.randrange(10**9)),
        "memory_pipes": lambda: _PIPES,
        "disk_fill": lambda: _DISK.format(files=3 * limits.scratch_mb // 4),
        "chmod_neighbours": lambda: _CHMOD_NEIGHBOURS,
        "chmod_trainer": lambda: _CHMOD_TRAINER.format(path=context["canary"]),
        "signals": lambda: _SIGNALS.format(pids=context["neighbours"], trainer=context["trainer"]),
        "sleep_past_deadline": lambda: f"import time\ntime.sleep({10 * limits.timeout_s})\nprint('slept')",
        "spin_past_deadline": lambda: "while True:\n    pass",
        "output_flood": lambda: "import sys\nfor _ in range(3000):\n    sys.stdout.write('y' * 10000)",
        "forge_result": lambda: _FORGE,
    }
    kind = rng.choice(sorted(kinds))
    return Cell(kind, kinds[kind](), context=dict(context))


_REPORT = re.compile(r"^(HELD|THREADS|DISK|CHMOD|KILLED) (\d+)$", re.M)


def verdicts(cell: Cell, result, limits: Limits) -> list[tuple[str, str]]:
    """The invariants a hostile cell's result broke, as `(invariant, detail)`; empty when the attack was held."""
    found = []
    late = result.duration_s - (limits.timeout_s + 3.0)
    if late > 0:
        took = f"{cell.kind} took {result.duration_s:.1f} s under a {limits.timeout_s:g} s limit"
        found.append(("deadline_held", took))
    if len(result.output) > limits.max_output_chars:
        found.append(("output_bounded", f"{cell.kind} returned {len(result.output)} characters"))
    if cell.kind in ("sleep_past_deadline", "spin_past_deadline") and result.ok:
        found.append(("deadline_held", f"{cell.kind} finished ok"))
    if cell.kind == "forge_result" and (result.ok or "forged" in result.output):
        found.append(("result_unforgeable", f"forged status accepted: {result.output[-120:]!r}"))
    reports = {name: int(value) for name, value in _REPORT.findall(result.output)}
    slack_mb = 16
    if reports.get("HELD", 0) > limits.memory_mb + slack_mb:
        found.append(("memory_bounded", f"{cell.kind} held {reports['HELD']} MB under memory_mb={limits.memory_mb}"))
    if reports.get("THREADS", 0) > limits.max_processes:
        found.append(("tasks_bounded", f"{reports['THREADS']} tasks under max_processes={limits.max_processes}"))
    if reports.get("DISK", 0) > limits.scratch_mb + 4:
        found.append(("scratch_bounded", f"wrote {reports['DISK']} MB under scratch_mb={limits.scratch_mb}"))
    if reports.get("CHMOD", 0) > 0:
        found.append(("metadata_outside_scratch", f"{cell.kind}: {reports['CHMOD']} metadata changes went through"))
    if reports.get("KILLED", 0) > 0:
        found.append(("signals_contained", f"{reports['KILLED']} signals reached the trainer or a neighbour"))
    return found
