"""The isolation contract's checks, run by a trainer in whatever condition the caller put it in (a normal user, a
default container, ...): prints one JSON object, each check's observed outcome. Used by
tests/sandbox/isolation/test_levels.py and tests/sandbox/isolation/test_container.py; run as `python
tests/helpers/sandbox_levels_probe.py [ISOLATION]`.

The nine checks of the container report (uid 0, /etc/shadow, a .env in the launch directory, TCP to the trainer's
loopback, UDP out, another session's scratch, SIGKILL of another session, a leftover process, memory), and the
trainer's environment through /proc, AF_VSOCK, and how long a first call takes.
"""

import json
import os
import socket
import sys
import tempfile
import time
import warnings

from retool_trl.sandbox import LocalSandbox


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    launch_dir = tempfile.mkdtemp(prefix="probe-launch-")
    with open(os.path.join(launch_dir, ".env"), "w") as f:
        f.write("HF_TOKEN=hf_probe_secret\n")
    os.chmod(launch_dir, 0o755)
    os.chdir(launch_dir)
    os.environ["HF_TOKEN"] = "hf_probe_secret"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    out = {"trainer_uid": os.geteuid()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # PROBE_ALLOW_ROOT=1 measures a build that refuses root without isolation (the before of a comparison).
            allow = os.environ.get("PROBE_ALLOW_ROOT") == "1"
            sandbox = LocalSandbox(
                num_workers=2,
                timeout_s=5.0,
                memory_mb=512,
                preload=(),
                isolation=mode,
                allow_root_without_isolation=allow,
            )
            out["report"] = sandbox.isolation_report()
        except Exception as exc:  # noqa: BLE001 - the refusal is an outcome too
            out["refused"] = f"{type(exc).__name__}: {exc}"
            print(json.dumps(out))
            return
    out["warnings"] = [str(w.message) for w in caught]
    a, b = sandbox.session(), sandbox.session()

    def run(session, code):
        result = session.run(code)
        return {"ok": result.ok, "output": result.output[-300:], "infra": result.infra_error}

    started = time.monotonic()
    out["first_call"] = run(
        a, "import os\nprint(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
    )
    out["first_call_s"] = time.monotonic() - started
    out["host_pid"] = a._proc.host_pid if a._proc is not None else None
    out["host_pid_is_session"] = bool(out["host_pid"]) and _is_worker(out["host_pid"])
    b_info = run(b, "import os\nopen('secret.txt', 'w').write('b')\nprint(os.getcwd(), os.getpid())")
    words = b_info["output"].split() if b_info["ok"] else []
    b_dir, b_pid = (words[0], int(words[1])) if len(words) == 2 and words[1].isdigit() else ("/nonexistent", 0)
    checks = {
        "shadow": "print(open('/etc/shadow').read()[:8])",
        "dotenv": f"print(open({os.path.join(launch_dir, '.env')!r}).read())",
        "trainer_environ": f"print(open('/proc/{os.getpid()}/environ').read())",
        "tcp_loopback": f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), 2)\n"
        "print('connected')",
        "udp_out": f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"s.sendto(b'x', ('127.0.0.1', {udp.getsockname()[1]}))\ns.sendto(b'x', ('192.0.2.1', 53))\nprint('sent')",
        "vsock": "import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\nprint('made')",
        "other_scratch": f"print(open({os.path.join(b_dir, 'secret.txt')!r}).read())",
        "kill_other": f"import os\nos.kill({b_pid}, 9)\nprint('sent')",
        "kill_trainer": f"import os\nos.kill({os.getpid()}, 0)\nprint('sent')",
        "leftover": "import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "subprocess.Popen(['sh', '-c', '(sleep 1001 &)'])\nprint('started')",
        "memory": "x = bytearray(1536 << 20)\nprint(len(x))",
        # Each process within memory_mb, together over it: one bound for the session as a whole.
        "memory_spread": "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
        "        x = b'x' * (200 << 20)\n        time.sleep(30)\n        os._exit(0)\n"
        "time.sleep(4)\nprint('all held')",
    }
    fresh = ("memory", "memory_spread")  # sessions of their own: these end the session they run in
    out["checks"] = {name: run(sandbox.session() if name in fresh else a, code) for name, code in checks.items()}
    try:
        listener.accept()
        out["tcp_accepted"] = True
    except OSError:
        out["tcp_accepted"] = False
    try:
        udp.recv(16)
        out["udp_received"] = True
    except OSError:
        out["udp_received"] = False
    out["other_alive"] = run(b, "print('alive')")
    time.sleep(0.3)
    out["leftovers"] = [pid for pid in _pids() if _cmdline(pid) in ("sleep 1000", "sleep 1001")]
    sandbox.close()
    time.sleep(0.3)
    out["session_gone_after_close"] = not out["host_pid"] or not os.path.exists(f"/proc/{out['host_pid']}")
    print(json.dumps(out))


def _pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_worker(pid):
    """Whether the pid the trainer holds for a session is that session's process (a forked zygote: worker.py)."""
    return "worker.py" in _cmdline(pid)


if __name__ == "__main__":
    main()
