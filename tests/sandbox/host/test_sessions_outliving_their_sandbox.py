"""Sessions the trainer still references when their sandbox closes: `close()` ends each of them, so that none keeps
the trainer's descriptors (or its jail), and each answers that it is closed, in one line."""

import gc
import os

import pytest

from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(120)


def _open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def test_close_ends_the_sessions_the_trainer_still_holds():
    gc.collect()
    before = _open_descriptors()
    sandbox = LocalSandbox(num_workers=2, spares=0, timeout_s=20.0, preload=())
    held = [sandbox.session() for _ in range(12)]
    results = sandbox.run_many([(session, "x = 6 * 7\nprint(x)") for session in held])
    assert all(r.ok and r.output == "42\n" for r in results), results
    assert _open_descriptors() >= before + len(held)  # each live session holds some of the trainer's
    sandbox.close()
    gc.collect()
    assert _open_descriptors() <= before + 1, (before, _open_descriptors())  # +1: a lazily opened /dev/urandom
    for session in held:
        r = session.run("print(x)")
        assert not r.ok and not r.infra_error, r
        assert r.output == "SessionError: this session is closed", r
    assert _open_descriptors() <= before + 1
