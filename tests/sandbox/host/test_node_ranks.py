"""Ranks that share a node share its CPUs and memory: the local sandbox's defaults are this rank's part of the node,
and of the CPUs this process may actually use.

The ranks are real processes started by `torchrun --nproc-per-node N` (which sets `LOCAL_RANK` and
`LOCAL_WORLD_SIZE` as it does for `accelerate launch`), each building its sandbox with the defaults and running a
cell; the memory bound read back is the one the kernel enforces (the sandbox's memory cgroup), where there is one.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from retool_trl.sandbox.host.machine_limits import default_memory_mb
from retool_trl.sandbox.host.node import usable_cpus

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).with_name("torchrun")

RANK = """
import json, os, sys
from types import SimpleNamespace
from retool_trl.sandbox import LocalSandbox
from retool_trl.sandbox.factory import sandbox_from_config

explicit = json.loads(sys.argv[2])
if explicit.get("config"):  # as the trainer builds it: ReToolConfig's sandbox fields, sandbox_workers unset
    args = SimpleNamespace(
        sandbox_backend="local", sandbox_workers=None, sandbox_timeout_s=5.0, sandbox_memory_mb=256,
        max_interpreter_output_chars=1024, sandbox_allow_root_without_isolation=False,
        max_cell_chars=None, interpreter_errors="traceback",
    )
    sandbox = sandbox_from_config(args)
else:
    sandbox = LocalSandbox(memory_mb=256, **explicit)
with sandbox:
    assert sandbox.session().run("print(6 * 7)").output == "42\\n"
    limit = None  # the bound the kernel enforces on all of this sandbox's sessions, where a memory cgroup exists
    for kind, path in sandbox._cgroups.roots:
        if kind == "memory1":
            limit = int(open(os.path.join(path, "memory.limit_in_bytes")).read()) >> 20
        elif kind == "v2" and os.path.exists(os.path.join(path, "memory.max")):
            text = open(os.path.join(path, "memory.max")).read().strip()
            limit = None if text == "max" else int(text) >> 20
    fact = dict(rank=os.environ.get("LOCAL_RANK"), workers=sandbox.num_workers,
                memory_mb=sandbox.total_memory_mb, cgroup_mb=limit)
with open(os.path.join(sys.argv[1], f"rank{os.environ.get('LOCAL_RANK', 0)}.json"), "w") as f:
    json.dump(fact, f)
"""


def launch(tmp_path, nproc: int, explicit: dict | None = None) -> list[dict]:
    """Starts `nproc` ranks with torchrun on this node; returns what each rank's sandbox took."""
    if not TORCHRUN.exists():
        pytest.skip("torchrun (torch's launcher) is not installed next to this interpreter")
    script, out = tmp_path / "rank.py", tmp_path / f"out{nproc}"
    script.write_text(RANK)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", str(script), str(out)]
    done = subprocess.run(
        [*command, json.dumps(explicit or {"config": True})], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert sorted(int(f["rank"]) for f in facts) == list(range(nproc))
    return facts


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_on_one_node_claim_the_node_once(tmp_path, nproc):
    """`accelerate launch`/`torchrun` with several GPUs on one node: each rank builds its own sandbox from the
    config's defaults. Before, each took every CPU and half of the memory (N times the node together); now their CPU
    slots add up to the CPUs this node lets us use (one each at least) and their memory bounds to the node's half."""
    facts = launch(tmp_path, nproc)
    cpus = usable_cpus()
    assert sum(f["workers"] for f in facts) == max(cpus, nproc)
    assert all(f["workers"] >= 1 for f in facts)
    node_mb = default_memory_mb()  # what one sandbox alone on this node would take
    total = sum(f["memory_mb"] for f in facts)
    assert node_mb - nproc <= total <= node_mb, (total, node_mb)  # the node's share, less rounding
    for fact in facts:
        if fact["cgroup_mb"] is not None:  # the kernel enforces the rank's part, not the node's
            assert fact["cgroup_mb"] == fact["memory_mb"]


def test_an_explicit_setting_wins_over_the_node_share(tmp_path):
    """A user who sets `num_workers` / `total_memory_mb` (e.g. per rank, knowing the node) gets exactly that."""
    facts = launch(tmp_path, 2, {"num_workers": 3, "total_memory_mb": 777})
    assert [(f["workers"], f["memory_mb"]) for f in facts] == [(3, 777), (3, 777)]


CPUS = "from retool_trl.sandbox import LocalSandbox; print(LocalSandbox().num_workers)"


def test_cpu_slots_follow_the_affinity_mask():
    """A trainer pinned to one CPU (`taskset -c 0`, a container's cpuset): one CPU slot, not the machine's count."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs a machine with 2 CPUs or more to pin a process to fewer")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    pinned = subprocess.run(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{0}}); {CPUS}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert pinned.returncode == 0, pinned.stderr
    assert int(pinned.stdout) == 1


def test_cpu_slots_follow_the_cgroup_cpu_quota(tmp_path):
    """A trainer in a cgroup with a CPU quota (`docker --cpus 1`, a Kubernetes CPU limit): the quota, rounded up,
    bounds the CPU slots (the machine has more)."""
    root = Path("/sys/fs/cgroup/cpu")
    v1 = (root / "cpu.cfs_quota_us").exists()
    if not v1 or not os.access(root, os.W_OK) or (os.cpu_count() or 1) < 2:
        pytest.skip("needs a writable cgroup v1 cpu hierarchy (to set a CPU quota) and 2 CPUs or more")
    group = root / f"retool-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")  # half a CPU: rounds up to one slot
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        env["PYTHONPATH"] = str(REPO)
        move = f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))"
        done = subprocess.run(
            [sys.executable, "-c", f"{move}; {CPUS}"], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == 1
    finally:
        for _ in range(50):  # the child has exited; its cgroup empties at once
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


def test_a_process_started_alone_keeps_the_whole_share(monkeypatch):
    """Without a launcher (no `LOCAL_WORLD_SIZE`) nothing is divided: a single trainer keeps every usable CPU."""
    from retool_trl.sandbox.host.node import node_share_cpus, node_share_memory_mb

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_share_cpus() == usable_cpus() and node_share_memory_mb() == default_memory_mb()
