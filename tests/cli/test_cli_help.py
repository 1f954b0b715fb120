"""`--help` of `eval` and `quickstart` as a newcomer meets it: fast (nothing heavy imported), one default per option,
and the option set the command really parses.

Stands for a user typing `retool-trl eval --help` to learn the options, who waited seconds for torch and TRL to load.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

HEAVY = ("torch", "transformers", "trl", "datasets", "math_verify", "vllm")


def _help_in_fresh_interpreter(command: str) -> tuple[str, list[str], float]:
    code = (
        "import contextlib, io, json, sys\n"
        "from retool_trl.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    status = main([{command!r}, '--help'])\n"
        "print(json.dumps([status, out.getvalue(), sorted(m for m in %r if m in sys.modules)]))\n" % (HEAVY,)
    )
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr
    status, text, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status in (0, None)
    return text, heavy, elapsed


@pytest.mark.parametrize("command", ["eval", "quickstart"])
def test_help_imports_nothing_heavy(command):
    """The help is printed before torch, transformers, TRL or datasets would load (seconds each)."""
    text, heavy, elapsed = _help_in_fresh_interpreter(command)
    assert heavy == [], f"`retool-trl {command} --help` imported {heavy}"
    assert "--model" in text and f"retool-trl {command}" in text
    assert elapsed < 30  # loose: the import check above is the real one; this only catches a hang


def test_quickstart_help_gives_each_option_one_default():
    """`--model`'s help said "(default: the shipped model). (default: None)"."""
    text, _, _ = _help_in_fresh_interpreter("quickstart")
    flat = " ".join(text.split())
    assert "(default: None)" not in flat
    assert flat.count("the shipped model") == 1
    # the per-task and per-format defaults are still named
    assert "(default: 50; multiturn: 60; emerge: 120; markdown: 60; tool_call: 60)" in flat


def test_eval_help_lists_multiturn_and_what_eval_parses():
    """The help names the multi-turn quickstart's dataset, and lists exactly the options `eval` accepts, with the
    defaults it applies (the help's copy of TRL's sampling defaults must not drift from `ReToolConfig`)."""
    from retool_trl.cli.eval import _HelpOnly, _settings_class, eval_help

    text = " ".join(eval_help().split())
    assert "multiturn" in text
    settings = {f.name: f for f in dataclasses.fields(_settings_class())}
    help_only = {f.name: f for f in dataclasses.fields(_HelpOnly)}
    for name, spec in help_only.items():
        assert name in settings, name
        assert spec.default == settings[name].default, (name, spec.default, settings[name].default)
    for name in settings:
        assert f"--{name} " in text, name


def test_configuration_docs_list_the_multiturn_dataset():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert "`multiturn`" in page


def test_commands_make_openmp_threads_wait_passively():
    """A user on a shared machine: torch's OpenMP threads spun while waiting and burnt several times the CPU under
    load (scripts/bench/cpu_under_load.py measures it). The CLI sets OMP_WAIT_POLICY=PASSIVE before torch loads, and
    keeps a policy the user set."""
    code = (
        "import os, sys\n"
        "from retool_trl.cli import main\n"
        "main(['plot', '--help'])\n"
        "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.strip().splitlines()[-1] == "False PASSIVE", proc.stdout + proc.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.strip().splitlines()[-1].endswith("ACTIVE")
