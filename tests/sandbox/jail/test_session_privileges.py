"""What a session may reach by the privileges it holds: no capability at all on any level, and none of the trainer's
private pathname UNIX sockets (a vLLM `ipc://` socket, a reward server's, a mounted `/var/run/docker.sock`).

Root in a default container runs the `landlock` level with the interpreter under root's mode-700 home: sessions used to
keep CAP_DAC_OVERRIDE to read it, and with it could connect to any socket file whose path they knew (`/proc/net/unix`
lists them all). `scripts/ci/test_containers.sh` runs this file inside a default container and as a normal user (with
user namespaces allowed and blocked); on the host as root the same checks meet a uid per session and namespaces.
"""

import os
import socket
import tempfile

import pytest

from retool_trl.sandbox import LocalSandbox
from retool_trl.sandbox.host.zygote import SandboxStartError

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=["landlock", "bwrap"])
def sandbox(request):
    sb = LocalSandbox(isolation=request.param, num_workers=1, spares=1, timeout_s=20.0)
    try:
        sb.isolation_report()
    except SandboxStartError as exc:
        pytest.skip(f"the {request.param} level does not run here ({str(exc).rsplit(': ', 1)[-1][:80]})")
    yield sb
    sb.close()


def test_a_session_holds_no_capability(sandbox):
    """A cell's process, and what it starts, hold no capability in any set (a container's root used to leave each
    session CAP_DAC_OVERRIDE, so that it could read an interpreter under a mode-700 /root)."""
    code = (
        "import subprocess\nsets = {}\nfor line in open('/proc/self/status'):\n"
        "    if line.startswith(('CapInh', 'CapPrm', 'CapEff', 'CapAmb')):\n"
        "        sets[line.split(':')[0]] = int(line.split()[1], 16)\n"
        "child = subprocess.run(['grep', 'CapEff', '/proc/self/status'], capture_output=True, text=True).stdout\n"
        "print(sorted(name for name, value in sets.items() if value), int(child.split()[1], 16))"
    )
    r = sandbox.session().run(code)
    assert r.ok and r.output == "[] 0\n", r


def test_the_interpreter_still_imports_what_it_needs(sandbox):
    """With no capability, a session still imports what it did not import before (its libraries may lie under a
    directory only root can enter)."""
    r = sandbox.session().run("import json, decimal, fractions, statistics, sqlite3\nprint(statistics.mean([1, 2]))")
    assert r.ok and r.output == "1.5\n", r


def _listening_socket(directory):
    path = os.path.join(directory, "trainer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(4)
    server.setblocking(False)
    return server, path


CONNECT = """
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({path!r})
    s.sendall(b"from the cell")
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""


@pytest.mark.parametrize("mode", [0o700, 0o1777], ids=["private_dir", "world_writable_dir"])
def test_a_cell_cannot_connect_to_the_trainers_private_socket(sandbox, mode):
    """The trainer listens on a mode-0600 socket in a mode-0700 directory, and in a world-writable one (where its
    name is all a cell needs); a cell that connects must be refused, and the trainer must receive nothing."""
    report = sandbox.isolation_report()
    if not report["own_uid_per_session"] and report.get("landlock_abi", 0) < 9 and report["isolation"] == "landlock":
        pytest.skip(
            "sessions share the trainer's uid and this kernel's Landlock (ABI < 9) does not rule connect() to "
            "pathname UNIX sockets: the trainer's own sockets stay reachable (the report's 'missing' says so)"
        )
    directory = tempfile.mkdtemp(prefix="retool-private-")
    os.chmod(directory, mode)
    server, path = _listening_socket(directory)
    try:
        r = sandbox.session().run(CONNECT.format(path=path))
        try:
            accepted, _ = server.accept()
        except BlockingIOError:
            accepted = None
        if accepted is not None:
            accepted.settimeout(2)
            got = accepted.recv(64)
            accepted.close()
            pytest.fail(f"the cell reached the trainer's socket and sent {got!r} ({r.output.strip()})")
        assert r.ok and r.output.startswith("refused"), r
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(directory)


def test_the_report_names_unruled_socket_connects_where_landlock_cannot_rule_them(sandbox):
    """Where Landlock cannot rule connect() to pathname sockets (ABI < 9), the `landlock` level's report says what
    stays reachable."""
    report = sandbox.isolation_report()
    if report["isolation"] != "landlock":
        pytest.skip("the bwrap level's sessions have a uid, /tmp and network of their own")
    named = any("pathname UNIX sockets" in line for line in report["missing"])
    assert named == (report["landlock_abi"] < 9), report["missing"]


WATCH = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
if fd < 0:
    print("refused", ctypes.get_errno())
else:
    wd = libc.inotify_add_watch(fd, os.path.dirname(os.getcwd()).encode(), 0x100 | 0x2)  # IN_CREATE | IN_MODIFY
    print("watching" if wd >= 0 else f"refused {ctypes.get_errno()}")
"""


def test_a_cell_cannot_watch_the_scratch_root(sandbox):
    """On the `landlock` level every session's scratch lies in one root: an inotify watch there would name each
    neighbour's scratch directory as it is made (their 24 random hex digits) and then report its file activity."""
    if sandbox.isolation_report()["isolation"] != "landlock":
        pytest.skip("the bwrap level gives each session a /tmp of its own")
    r = sandbox.session().run(WATCH)
    assert r.ok and r.output.startswith("refused"), r
