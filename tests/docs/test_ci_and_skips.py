"""CI as the README describes it: the README's test command runs in a default container, and every skip reason is one
short line."""

import re
import shlex

import pytest

from helpers.cli_runs import REPO

pytestmark = pytest.mark.timeout(300)


def test_ci_runs_the_readmes_test_command_in_a_default_container():
    """CI's container stage ran only the sandbox's contract tests in a default rootful container, so the README's test
    command could be red there (where most GPU users train) without CI noticing. It now runs that command, the whole
    fast suite, in the container."""
    script = (REPO / "scripts" / "ci" / "test_containers.sh").read_text().replace("\\\n", " ")
    pytest_args = shlex.split(re.search(r"^PYTEST=\((.*)\)$", script, re.MULTILINE).group(1))
    assert pytest_args[:3] == ["-m", "pytest", "-q"]  # `python -m pytest -q`, as the README says
    [run] = [line for line in script.splitlines() if line.strip().startswith("podman ") and " run " in line]
    after = shlex.split(run.split("--rootfs /:O", 1)[1])
    assert after[:2] == ['"$PY"', '"${PYTEST[@]}"'] or after[:2] == ["$PY", "${PYTEST[@]}"], after
    assert not any(arg.startswith(("tests/", '"${CONTRACT')) or "CONTRACT" in arg for arg in after[2:]), after
    readme = (REPO / "README.md").read_text()
    assert "python -m pytest -q" in readme


def test_a_skip_reason_is_one_short_line():
    """`pytest -rs` as a user reads it: skip reasons repeated the whole list of missing protections (up to 1.8 KB a
    line). A skip whose reason is not one short line now fails its test (`conftest.py`), so every skip names what is
    missing in a line; the level's own report stays where it belongs, in `isolation_report()`."""
    from helpers.skip_reasons import skip_reason_problem
    from retool_trl.sandbox import LocalSandbox

    with LocalSandbox(num_workers=1) as sandbox:
        report = sandbox.isolation_report()
    assert skip_reason_problem(f"needs per-session jails; missing here: {report}")  # the old form, a whole report
    assert skip_reason_problem("needs a\nsecond line")
    assert skip_reason_problem(f"needs a pids cgroup (isolation level here: {report['isolation']})") is None
