"""Reading a process's state and CPU time from /proc, and a cell that computes between its calls (the parked-session
tests and the batch's)."""

import os

# A cell that arranges to run between calls: it disarms the interpreter's signal blocking (its own process, which it
# may rewrite), installs a SIGCONT handler that computes, and arms a POSIX timer (timer_create) that sends SIGCONT
# every 50 ms: the timer survives the cell, and each SIGCONT resumes the stopped interpreter into the handler.
COMPUTE_BETWEEN_CALLS = """
import ctypes, signal, sys, time
for module in list(sys.modules.values()):
    if hasattr(module, "_quiet_signals") and hasattr(module, "_serve"):
        module._quiet_signals = lambda: signal.pthread_sigmask(signal.SIG_SETMASK, [])
def spin(*_):
    end = time.process_time() + 0.04
    while time.process_time() < end:
        pass
signal.signal(signal.SIGCONT, spin)
libc = ctypes.CDLL(None, use_errno=True)
event = (ctypes.c_byte * 64)()
ctypes.c_int.from_buffer(event, 8).value = int(signal.SIGCONT)  # sigev_signo; sigev_notify 0 = SIGEV_SIGNAL
timer = ctypes.c_void_p()
assert libc.timer_create(1, event, ctypes.byref(timer)) == 0  # CLOCK_MONOTONIC
spec = (ctypes.c_long * 4)(0, 50_000_000, 0, 50_000_000)  # every 50 ms, first in 50 ms
assert libc.timer_settime(timer, 0, spec, None) == 0
print("armed")
"""


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "X"


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
