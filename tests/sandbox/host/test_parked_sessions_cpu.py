"""Red team round 4, the calls themselves: a policy that unscores its own failures, computes between calls, stalls
its neighbours' results through the cleanup, or escapes CPU admission by computing in bursts.

Each test runs the attack through the public API (`LocalSandbox`, `session().run`, `run_many`, the rollout) and
checks what the sandbox itself observed, not what the cell says. They need root with bubblewrap (the jail) and, for
the freezer tests, a writable cgroup freezer; elsewhere they skip and say which protection is missing.
"""

import os
import time

import pytest

from helpers.process_state import COMPUTE_BETWEEN_CALLS, process_cpu_s, process_state
from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def sandbox():
    if os.geteuid() != 0:
        pytest.skip("needs root: a jail of its own per session (pid namespace) is made only as root here")
    sb = LocalSandbox(num_workers=2, timeout_s=10.0, preload=())
    sb.session().run("pass")  # starts the zygote
    if not sb._sessions_are_pid_one():
        sb.close()
        pytest.skip("needs bubblewrap: without a pid namespace a SIGKILL is never reported as infrastructure anyway")
    yield sb
    sb.close()


# A cell that lowers its own hard CPU limit to the kernel's minimum and spins: the kernel SIGKILLs it.
_SELF_CPU_KILL = """
import resource
resource.setrlimit(resource.RLIMIT_CPU, (0, 0))
while True:
    pass
"""


# The same through a child of the cell, which lowers its interpreter's (pid 1's) hard limit with prlimit.
_CHILD_CPU_KILL = """
import os, resource, time
if os.fork() == 0:
    resource.prlimit(1, resource.RLIMIT_CPU, (0, 0))
    os._exit(0)
time.sleep(0.2)
while True:
    pass
"""


@pytest.mark.parametrize("code", [_SELF_CPU_KILL, _CHILD_CPU_KILL], ids=["setrlimit", "prlimit_from_a_child"])
def test_a_cell_that_lowers_its_own_cpu_limit_is_not_an_infrastructure_error(sandbox, code):
    """Attack: a policy that knows it will be wrong lowers its own RLIMIT_CPU (hard) to 0 and spins, so the kernel's
    SIGKILL looks like a kill from outside and its completion drops out of the loss (reward None instead of -1).
    The sandbox must see that the limit was the cell's own: the cell's error, never `infra_error`."""
    s = sandbox.session()
    assert s.run("x = 1").ok
    r = s.run(code)
    assert not r.ok and not r.infra_error, r
    assert "CPU" in r.output.splitlines()[-1], r.output


def test_an_outside_sigkill_is_still_infrastructure(sandbox):
    """The other side of the rule: a kill the cell could not have caused (an operator's `kill -9` during a call,
    with the jail's limits untouched) stays `infra_error=True`, so the rollout retries it."""
    import signal
    import threading

    s = sandbox.session()
    assert s.run("x = 1").ok
    timer = threading.Timer(0.5, lambda: os.kill(s._proc.host_pid, signal.SIGKILL))
    timer.start()
    r = s.run("import time\nwhile True: time.sleep(0.01)")
    timer.join()
    assert not r.ok and r.infra_error, r


def test_self_inflicted_cpu_kill_is_scored_minus_one_through_the_rollout(sandbox):
    """End to end: the same attack inside a rollout (which retries infrastructure errors once) and the reward
    `boxed_accuracy` gives it. A wrong answer stays -1: the attack cannot take its completion out of the loss."""
    from helpers.testing_utils import ScriptedBackend, make_char_tokenizer
    from retool_trl.rewards.functions import boxed_accuracy
    from retool_trl.rollout import RolloutSpec, interleaved_rollout

    tokenizer = make_char_tokenizer()
    script = f"<code>{_SELF_CPU_KILL}</code>so \\boxed{{5}}"
    prompts = [tokenizer("Q: ", add_special_tokens=False)["input_ids"]]
    spec = RolloutSpec(max_completion_length=400, eos_token_ids=[tokenizer.eos_token_id])
    result = interleaved_rollout(prompts, ScriptedBackend(tokenizer, [script]), sandbox, tokenizer, spec)
    assert result.infra_failed == [False] and result.num_infra_errors == [0], result
    completion = tokenizer.decode(result.completion_ids[0])
    rewards = boxed_accuracy([completion], ["7"], infra_failed=result.infra_failed)
    assert rewards == [-1.0]


def test_a_parked_session_does_not_compute_between_calls(sandbox):
    """Attack: a policy that computes while its session is parked (a timer's SIGCONT resuming the interpreter into
    a handler), taking CPU from its neighbours' calls outside any call's time and CPU budget. Where the sandbox has
    a cgroup freezer, the parked session stays frozen between calls: it uses ~0 CPU over a 2 s gap."""
    s = sandbox.session()
    assert s.run("pass").ok
    if not ({"freezer", "v2"} & set(s._proc.cgroups)):
        pytest.skip("needs a writable cgroup freezer (v1 freezer or v2 cgroup.freeze): elsewhere SIGSTOP alone parks")
    r = s.run(COMPUTE_BETWEEN_CALLS)
    assert r.ok and "armed" in r.output, r
    pid = s._proc.host_pid
    before = process_cpu_s(pid)
    time.sleep(2.0)
    between = process_cpu_s(pid) - before
    assert between < 0.1, f"the parked session computed {between:.2f} CPU-s between calls"
    # Thawed, its handler computes again, now on its own call's clock: whatever that call's result, it is the cell's.
    assert not s.run("print('next')").infra_error
    s.close()  # a frozen jail still goes at once when its session closes (the zygote thaws what it kills)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and process_state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline, "the closed session's frozen process survived"
        time.sleep(0.05)


def _freezer_state(proc) -> str | None:
    from retool_trl.sandbox.host.cgroup_control import freezer_control

    control = freezer_control(proc.cgroups)
    if control is None:
        return None
    with open(control[0], "rb") as f:
        return f.read().strip().decode()


def test_a_parked_session_is_frozen_a_moment_after_its_call(sandbox):
    """Stands for a rollout whose next code block comes after a generation turn (tens of milliseconds or more): the
    session is frozen once it has been parked for `FREEZE_AFTER_S`, while calls made back to back (a batch's code
    blocks within a millisecond) do not pay a freeze and a thaw each. Read from the kernel's own freezer state."""
    from retool_trl.sandbox.host.parking import FREEZE_AFTER_S

    s = sandbox.session()
    assert s.run("pass").ok
    if _freezer_state(s._proc) is None:
        pytest.skip("needs a writable cgroup freezer (v1 freezer or v2 cgroup.freeze): elsewhere SIGSTOP alone parks")
    for _ in range(20):  # back to back: each call finds its session thawed and leaves it so
        assert s.run("x = 1").ok
    deadline = time.monotonic() + 5
    while _freezer_state(s._proc) not in ("FROZEN", "1"):
        assert time.monotonic() < deadline, f"still {_freezer_state(s._proc)} {time.monotonic() - deadline + 5:.1f} s"
        time.sleep(FREEZE_AFTER_S)
    assert s._proc.frozen
    r = s.run("print(x + 1)")  # thawed for its call, state intact
    assert r.ok and r.output.strip() == "2", r
    s.close()


def test_a_session_killed_as_its_freeze_lands_still_dies(sandbox):
    """Stands for the zygote's memory watch evicting a parked session (it SIGKILLs and thaws it) in the moment
    between the session's park and its deferred freeze: a freeze landing after that thaw would keep the victim,
    and the memory it holds, frozen with its kill pending. The freeze sees the pending SIGKILL and leaves it
    thawed."""
    import signal

    from retool_trl.sandbox.host.cgroup_control import set_frozen

    s = sandbox.session()
    assert s.run("pass").ok
    proc = s._proc
    if _freezer_state(proc) is None:
        pytest.skip("needs a writable cgroup freezer (v1 freezer or v2 cgroup.freeze): elsewhere SIGSTOP alone parks")
    proc._cancel_freeze()  # this test makes the freeze itself, at the moment it wants
    proc._thaw()
    assert set_frozen(proc.cgroups, True)  # frozen, so the SIGKILL below stays pending (as while the zygote thaws)
    pid = proc.host_pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.05)
    assert process_state(pid) not in ("Z", "X"), "a frozen process died before its thaw: the kernel differs"
    with proc.park_lock:
        proc.park_ticket += 1
        ticket = proc.park_ticket
    proc.freeze_parked(ticket)
    deadline = time.monotonic() + 5
    while process_state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline, "the killed session was frozen again and never died"
        time.sleep(0.01)
    assert not proc.frozen
    s.close()


# A leftover child holding a 2 GB memfd, left alive by a cell that first disarms its interpreter's own end-of-cell
# killer (its own process, which it may rewrite): the host's cleanup kills it and waits until it has left the jail,
# which takes as long as the kernel needs to free that file (a few tenths of a second, in one system call).
_HEAVY_LEFTOVER = """
import os, sys, time
for module in list(sys.modules.values()):
    if hasattr(module, "_kill_descendants") and hasattr(module, "_serve"):
        module._kill_descendants = lambda *args: None
if os.fork() == 0:
    fd = os.memfd_create("hog")
    os.posix_fallocate(fd, 0, 2048 << 20)
    time.sleep(100)
time.sleep(3.0)
"""


def test_the_cleanup_of_leftovers_does_not_time_out_a_neighbour():
    """Attack: a cell leaves a heavy process behind, timed to end just before a neighbour's cell finishes, so that
    the end-of-call cleanup of its call (kill, then wait for the kernel to free it) holds up the batch past the
    neighbour's deadline, and the neighbour, done in time, is reported timed out (its reward -1). The neighbour must
    get its own result."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the end-of-call cleanup through the jail's own cgroup is made only as root")
    with LocalSandbox(num_workers=2, timeout_s=3.25, memory_mb=2560, max_file_size_mb=2048, preload=()) as sb:
        attackers, neighbour = [sb.session()], sb.session()
        assert all(r.ok for r in sb.run_many([(s, "pass") for s in [*attackers, neighbour]]))
        pairs = [(s, _HEAVY_LEFTOVER) for s in attackers]
        results = sb.run_many([*pairs, (neighbour, "import time\ntime.sleep(3.1)\nprint('done')")])
        assert results[-1].ok and results[-1].output == "done\n", results[-1]


# A cell whose child computes a quarter of the time, in bursts (12 ms of work, 36 ms of sleep) for 1.5 s, and which
# reports when it ran (the wall clock, shared with the trainer).
_BURSTS = """
import os, time
start = time.time()
if os.fork() == 0:
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        burst = time.process_time() + 0.012
        while time.process_time() < burst:
            pass
        time.sleep(0.036)
    os._exit(0)
os.wait()
print(start, time.time())
"""


def test_cells_computing_in_bursts_are_not_all_admitted_at_once():
    """Attack: a policy whose cells compute in short bursts (a quarter of the time, in a child) so that no instant
    look sees them busy: all of a batch's cells are admitted at once on 2 CPUs, and the neighbours' cells run 4-5x
    slower and time out. CPU use is measured over a window and counted in proportion: 24 such cells on
    `num_workers=2` run at most about 8 at a time (8 quarters make 2 CPUs), never all 24."""
    from helpers.testing_utils import most_at_once  # here, as the other imports of testing_utils in this file

    if os.geteuid() != 0:
        pytest.skip("needs root: a jail's CPU (all its processes) is counted through its own cgroup only as root")
    with LocalSandbox(num_workers=2, timeout_s=60.0, preload=()) as sb:
        sessions = [sb.session() for _ in range(24)]
        assert all(r.ok for r in sb.run_many([(s, "pass") for s in sessions]))
        if sessions[0]._proc.cpu_seconds() is None:  # a default container: its cgroups are read-only
            pytest.skip("needs a cgroup per jail to count its children's CPU (none is writable here)")
        results = sb.run_many([(s, _BURSTS) for s in sessions])
        assert all(r.ok for r in results), [r.output for r in results if not r.ok][:1]
        spans = [tuple(map(float, r.output.split())) for r in results]
        most = most_at_once(spans)
        assert most <= 12, f"{most} bursty cells ran at once on num_workers=2"


# A cell that writes status frames to its own status pipe (fd 4) as fast as it can for 2 s, then returns.
_STATUS_SPAM = """
import json, os, struct, time
body = json.dumps({"ok": True, "error": None, "fatal": None, "skipped": 0}).encode()
frame = struct.pack("!I", len(body)) + body
end = time.monotonic() + 2.0
while time.monotonic() < end:
    try:
        os.write(4, frame)
    except BlockingIOError:
        pass
"""


def test_a_cell_spamming_status_frames_does_not_cost_the_trainer_its_cpu(sandbox):
    """Attack: a policy floods its status channel with frames, and the trainer's batch loop wakes, reads and parses
    each one on its own CPU, outside the cell's CPU budget (0.6-0.7 CPU-seconds per second of spam). The flood is
    charged to the cell: it ends its own call with its own error (not an infrastructure one), and the trainer spends
    a small fraction of a CPU-second on it."""
    s = sandbox.session()
    assert s.run("pass").ok
    before = time.process_time()  # every thread of this process: the trainer side of the sandbox
    r = s.run(_STATUS_SPAM)
    spent = time.process_time() - before
    assert not r.ok and not r.infra_error, r
    assert "status channel" in r.output.splitlines()[-1], r.output
    assert spent < 0.2, f"the trainer spent {spent:.2f} CPU-s on a status flood"


def test_without_a_freezer_a_session_that_ran_between_calls_ends_at_its_next_call(sandbox, monkeypatch):
    """Stands for a container without writable cgroups, where SIGSTOP alone parks a session (the freezer is turned
    off here): the same timer attack computes between calls, and cannot profit from it. Its next call fails as its
    own error (never infrastructure) and its session is ended."""
    from retool_trl.sandbox.host import sweep

    monkeypatch.setattr(sweep.JailSweep, "park_frozen", lambda self, frozen, keep=True: False)
    s = sandbox.session()
    r = s.run(COMPUTE_BETWEEN_CALLS)
    assert r.ok and "armed" in r.output, r
    time.sleep(1.0)
    assert process_cpu_s(s._proc.host_pid) > 0.1  # it did compute: no freezer held it
    nxt = s.run("print('next')")
    assert not nxt.ok and not nxt.infra_error and "between calls" in nxt.output, nxt
    assert s.broken


def test_sessions_frozen_when_the_zygote_dies_go_with_the_sandbox():
    """Stands for the machine's OOM killer taking the sandbox's zygote while sessions are parked frozen: nothing is
    left to kill and thaw them, and a frozen process would hold its memory after the trainer is gone. Closing the
    sandbox kills and thaws what is left in its jails' cgroups."""
    import signal

    if os.geteuid() != 0:
        pytest.skip("needs root: the jails' cgroups")
    sb = LocalSandbox(num_workers=1, timeout_s=10.0, preload=())
    s = sb.session()
    assert s.run("x = 1").ok
    proc = s._proc
    if _freezer_state(proc) is None:
        sb.close()
        pytest.skip("needs a writable cgroup freezer: elsewhere nothing is left frozen")
    proc._cancel_freeze()
    assert proc.park_frozen(True)  # parked frozen, as between calls
    pid = proc.host_pid
    with open(f"/proc/{pid}/stat", "rb") as f:
        zygote = int(f.read().rsplit(b")", 1)[1].split()[1])  # the jail's parent: the zygote
    os.kill(zygote, signal.SIGKILL)
    time.sleep(0.2)
    assert process_state(pid) not in ("Z", "X"), "the frozen jail died with its zygote: nothing to test here"
    sb.close()
    deadline = time.monotonic() + 5
    while process_state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline, "a frozen jail outlived its sandbox"
        time.sleep(0.02)
