"""The isolation report a user reads: a summary, a network flag true to what cells can reach, and the landlock level's
words for a normal user."""

import os

import pytest

from helpers.cli_runs import REPO

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------------ isolation report
NETWORK_PROBE = """
import socket
reached = []
for host in {hosts!r}:
    try:
        socket.create_connection((host, {port}), timeout=2).close()
        reached.append(host)
    except OSError:
        pass
print(reached)
"""


def _host_addresses() -> list[str]:
    """127.0.0.1 and this machine's own outward address (a container's eth0), where there is one."""
    import socket

    hosts = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: picks the interface a route would use
            hosts.append(probe.getsockname()[0])
        except OSError:
            pass
    return hosts


@pytest.mark.parametrize("level", ["auto", "landlock"])
def test_the_isolation_report_has_a_summary_and_its_network_flag_is_true_to_the_cells(level):
    """`isolation_report()` on the level this machine gives (bubblewrap on a host's root, Landlock in a default
    container or for a normal user without user namespaces): one short summary line of what holds and what does not,
    and `network_isolated` says whether a cell can reach a TCP server of the trainer's, tried for real (on Landlock it
    said False although cells cannot open an IP socket)."""
    import socket

    from retool_trl.sandbox import LocalSandbox, UnsafeSandboxError
    from retool_trl.sandbox.host.zygote import SandboxStartError

    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    port, hosts = server.getsockname()[1], _host_addresses()
    try:
        with LocalSandbox(num_workers=1, isolation=level) as sandbox:
            report = sandbox.isolation_report()
            result = sandbox.session().run(NETWORK_PROBE.format(hosts=hosts, port=port))
    except (UnsafeSandboxError, SandboxStartError) as error:
        pytest.skip(f"isolation={level} does not run here ({type(error).__name__})")
    finally:
        server.close()
    summary = report["summary"]
    assert "\n" not in summary and len(summary) < 400, summary
    assert summary.startswith(f"isolation level {report['isolation']}: holds: ")
    assert ("no network" in summary.split("does not hold")[0]) == report["network_isolated"], summary
    assert result.ok, result.output
    reached = eval(result.output.strip())  # noqa: S307 - the cell printed a list literal
    assert report["network_isolated"] == (reached == []), (report["network_isolated"], reached, hosts)


def test_the_landlock_levels_words_for_a_normal_user(monkeypatch):
    """A normal user on the Landlock level (user namespaces blocked) read "sessions then run as uid 0", the words for
    a container's root: the level's list of what does not hold speaks of the user the trainer is."""
    from retool_trl.sandbox.isolation import common
    from retool_trl.sandbox.isolation import landlock as landlock_level

    if landlock_level.landlock_problem():
        pytest.skip("no Landlock on this kernel")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a normal user's process sees
    monkeypatch.setattr(common, "may_watch_other_uids", lambda: False)
    worker = str(REPO / "retool_trl" / "sandbox" / "jail" / "worker.py")
    missing = " ".join(landlock_level.launch(worker, False).missing)
    assert "own uid per session" in missing and "uid 0" not in missing and "normal user" in missing
