"""The package's house rules: imports run one way (no cycles, light modules stay light) and modules stay short."""

import ast
import json
import subprocess
import sys

import pytest

from helpers.import_graph import PACKAGE, find_cycle, import_graph


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_check_sees_lazy_imports_between_modules_that_share_a_prefix(tmp_path):
    """The layout the quickstart once had: `quickstart.py` and `quickstart_multiturn.py` importing each other inside
    functions. A cycle check that compared bare name prefixes took them for a package and its submodule."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "quickstart.py": "def run():\n    from .quickstart_multiturn import recovery_rate\n",
        "quickstart_multiturn.py": "def plan():\n    from .quickstart import TaskPlan\n",
        # A package and its submodule importing each other: allowed.
        "sub/__init__.py": "from .mod import f\n",
        "sub/mod.py": "from . import helper\nf = 1\n",
        "sub/helper.py": "",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"pkg.quickstart", "pkg.quickstart_multiturn"}
    del graph["pkg.quickstart_multiturn"], graph["pkg.quickstart"]
    assert graph["pkg.sub.mod"] >= {"pkg.sub"} and graph["pkg.sub"] >= {"pkg.sub.mod"}
    assert find_cycle(graph) is None


def test_modules_stay_short():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in lengths.items() if n > 500}
    assert not too_long, too_long


@pytest.mark.parametrize(
    "module",
    [
        "retool_trl.data",
        "retool_trl.format",
        "retool_trl.format.parsing",
        "retool_trl.format.prompts",
        "retool_trl.rollout",
        "retool_trl.rollout.batched",
        "retool_trl.rollout.engines",
        "retool_trl.reporting.run_logs",
        "retool_trl.sandbox",
        "retool_trl.testing",
        "retool_trl.errors",
        "retool_trl.cli",
    ],
)
def test_light_modules_do_not_import_torch_or_trl(module):
    """Data adapters, text helpers, the rollout state machine and test doubles work without the training stack."""
    code = f"import sys, json, {module}; print(json.dumps([m for m in ('torch', 'trl') if m in sys.modules]))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# Where users import each public name today (README, docs, DESIGN.md): a move of the house must keep every one.
DOCUMENTED_NAMES = [
    ("retool_trl", "ReToolTrainer"),
    ("retool_trl", "ReToolConfig"),
    ("retool_trl", "quickstart_model_path"),
    ("retool_trl.rewards", "boxed_accuracy"),
    ("retool_trl.rewards", "boxed_accuracy_and_recovery"),
    ("retool_trl.rewards", "tool_use_shaping"),
    ("retool_trl.rollout", "ROLLOUT_FIELDS"),
    ("retool_trl.rollout", "RolloutSpec"),
    ("retool_trl.rollout", "interleaved_rollout"),
    ("retool_trl.sandbox", "LocalSandbox"),
    ("retool_trl.sandbox", "RemoteSandbox"),
    ("retool_trl.sandbox", "ExecResult"),
    ("retool_trl.sandbox", "UnsafeSandboxError"),
    ("retool_trl.sandbox.factory", "sandbox_from_config"),
    ("retool_trl.sandbox", "build_sandbox"),
    ("retool_trl.sandbox", "RemoteSession"),
    ("retool_trl.sandbox.remote", "RemoteSandbox"),
    ("retool_trl.sandbox.server", "ServerConfig"),
    ("retool_trl.sandbox.server", "create_app"),
    ("retool_trl.training.sandbox_health", "SandboxHealth"),
    ("retool_trl.quickstart", "run_quickstart"),
    ("retool_trl.testing", "FakeSandbox"),
    ("retool_trl.testing", "ScriptedBackend"),
    ("retool_trl.data", "load_math_dataset"),
    ("retool_trl.evaluation", "evaluate"),
]


@pytest.mark.parametrize(("module", "name"), DOCUMENTED_NAMES, ids=[f"{m}.{n}" for m, n in DOCUMENTED_NAMES])
def test_documented_import_paths_work(module, name):
    """A fresh interpreter, as a user's script: `from <module> import <name>` works and gives the real object."""
    code = f"from {module} import {name} as x; print(getattr(x, '__module__', None) or type(x).__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), f"{module}.{name} imported as nothing"


def test_every_module_states_its_job():
    """A reader finds a module's one job in its docstring: every module of the package opens with one of at least a
    sentence (a package's face too). A missing or one-word docstring fails."""
    vague = {}
    for path in PACKAGE.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc or len(doc.split()) < 5:
            vague[str(path.relative_to(PACKAGE))] = doc
    assert not vague, f"modules without a docstring that says their job: {sorted(vague)}"


def test_the_top_level_reads_as_the_architecture():
    """The top level holds the TRL seam (trainer, config and its options, the SFT trainer), shared errors, the test
    doubles, and one package per concern; a rollout turn, a reward and a sandbox call each live in a package named
    for them. A new top-level module has to be placed on purpose, here."""
    modules = {p.name for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert modules == {
        "__init__.py",
        "__main__.py",
        "config.py",
        "errors.py",
        "options.py",
        "sft.py",
        "testing.py",
        "trainer.py",
    }
    assert {"rollout", "rewards", "sandbox", "format", "cli", "data"} <= packages
    assert (PACKAGE / "rollout" / "engines").is_dir()
