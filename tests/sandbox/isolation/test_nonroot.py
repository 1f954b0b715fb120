"""The local sandbox run by an unprivileged user: what still holds, and that it says what does not.

The test process is root here, so the sandbox runs in a child process as `nobody`. That child keeps one capability,
CAP_DAC_READ_SEARCH, only because this machine's interpreter lives under /root (mode 700): it can read files, but it
cannot create namespaces, write cgroups or change uids, as any unprivileged trainer. bubblewrap refuses to start with
an ambient capability, so this covers the sandbox without bubblewrap (the warned, degraded mode).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers.container_env import setpriv_problem

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    from retool_trl.sandbox import LocalSandbox

    out = {"uid": os.geteuid()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sandbox = LocalSandbox(num_workers=2, timeout_s=1.0, preload=(), isolation="none")
        out["report"] = sandbox.isolation_report()
    out["warnings"] = [str(w.message) for w in caught]
    a, b = sandbox.session(), sandbox.session()
    out["state"] = [a.run("x = 6 * 7").ok, a.run("print(x)").output, b.run("print('x' in dir())").output]
    t = time.monotonic()
    hung = a.run("while True:\\n    pass")
    out["timeout"] = [hung.timed_out, hung.infra_error, time.monotonic() - t]
    crash = b.run("import os\\nos._exit(3)")
    out["crash"] = [crash.ok, crash.infra_error, crash.output]
    forged = sandbox.session()
    out["forged"] = forged.run(sys.argv[1]).timed_out
    pids = [s._proc.host_pid for s in (a, b, forged) if s._proc is not None]
    sandbox.close()
    time.sleep(0.5)
    def running(pid):  # one read decides: the process may exit between two reads of /proc
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    out["survivors"] = [p for p in pids if running(p)]
    print(json.dumps(out))
    """
)

FORGE_THEN_SLEEP = (
    "import json, os, struct, time\n"
    "data = json.dumps({'ok': True, 'error': None, 'fatal': None, 'skipped': 0}).encode()\n"
    "for fd in range(3, 64):\n"
    "    try:\n"
    "        os.write(fd, struct.pack('!I', len(data)) + data)\n"
    "    except OSError:\n"
    "        pass\n"
    "time.sleep(30)\n"
)


@pytest.fixture(scope="module")
def unprivileged_run():
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root (to become nobody) and setpriv")
    caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    problem = setpriv_problem(*caps)  # a default container's bounding set has no CAP_DAC_READ_SEARCH
    if problem:
        pytest.skip(problem)
    command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *caps]
    env = {key: value for key, value in os.environ.items() if key in ("PATH", "LANG", "PYTHONPATH")}
    done = subprocess.run(
        [*command, sys.executable, "-c", SCRIPT, FORGE_THEN_SLEEP],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_it_really_runs_unprivileged(unprivileged_run):
    assert unprivileged_run["uid"] == 65534


def test_what_is_missing_is_reported_and_warned(unprivileged_run):
    report = unprivileged_run["report"]
    assert report["isolation"] == "none" and not report["jail_per_session"]
    missing = " ".join(report["missing"])
    for protection in ("per-session jail", "bubblewrap", "own uid per session", "cgroups"):
        assert protection in missing, report["missing"]
    assert any("bubblewrap is unavailable" in w for w in unprivileged_run["warnings"])


def test_sessions_calls_timeouts_and_crashes_still_hold(unprivileged_run):
    assert unprivileged_run["state"] == [True, "42\n", "False\n"]
    timed_out, infra, seconds = unprivileged_run["timeout"]
    assert timed_out and not infra and seconds < 5
    ok, infra, output = unprivileged_run["crash"]
    assert not ok and not infra and "exited with code 3" in output


def test_a_forged_status_still_settles_nothing(unprivileged_run):
    assert unprivileged_run["forged"] is True


def test_nothing_survives_close(unprivileged_run):
    assert unprivileged_run["survivors"] == []
