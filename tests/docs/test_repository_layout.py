"""Where tests and scripts live, pinned so that a newcomer finds the tests of a module in the folder named after it and
a script by its purpose: tests in subject folders that mirror the package, their shared support in one helpers
package, no test module importing another, and a short top level in `tests/` and `scripts/`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SCRIPTS = ROOT / "scripts"

# Names of review rounds and visits, not of what a test checks.
NOT_A_SUBJECT = ("round", "redteam", "fixes", "edge_cases", "new_user", "correctness")
# Kept at the top of tests/: the package's own import-graph rules.
TOP_LEVEL_TESTS = {"test_layout.py"}


def files_in(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_file() and p.suffix != ".pyc"]


def all_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_the_top_of_tests_stays_short():
    top = files_in(TESTS)
    assert len(top) <= 15, sorted(p.name for p in top)
    stray = {p.name for p in top if p.name.startswith("test_")} - TOP_LEVEL_TESTS
    assert not stray, f"test files go in the subject folder of what they test (tests/<subject>/): {sorted(stray)}"


def test_tests_are_filed_by_subject():
    """At least five subject folders hold tests; every test file but the top-level ones is in one."""
    subjects = {p.relative_to(TESTS).parts[0] for p in all_test_files() if p.parent != TESTS}
    assert len(subjects) >= 5, sorted(subjects)
    assert "helpers" not in subjects, "tests/helpers/ holds shared support, not tests"


def test_no_test_file_is_named_after_a_review_round_or_a_visit():
    named = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if any(w in p.stem for w in NOT_A_SUBJECT)]
    assert not named, f"name each file after the behaviour it tests: {named}"


def test_shared_support_is_one_helpers_package():
    """Every module of tests/ that is not a test file is either a conftest or in tests/helpers/."""
    assert (TESTS / "helpers" / "__init__.py").is_file()
    loose = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if "__pycache__" not in p.parts
        and not p.name.startswith("test_")
        and p.name not in ("conftest.py", "__init__.py")
        and p.relative_to(TESTS).parts[0] != "helpers"
    ]
    assert not loose, f"shared test support goes in tests/helpers/: {loose}"


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another_or_the_conftest():
    """A test module that imports another ties the two files together (and collects the other's tests' module-level
    set-up twice); what two files share goes in tests/helpers/, which imports no test module either."""
    paths = all_test_files() + sorted((TESTS / "helpers").glob("*.py"))
    wrong = {
        str(p.relative_to(TESTS)): sorted(m for m in imported_modules(p) if m.startswith("test_") or m == "conftest")
        for p in paths
    }
    assert not {k: v for k, v in wrong.items() if v}


def test_the_layout_checks_see_an_import_of_another_test_module(tmp_path):
    """The check above is only worth something if it catches one, lazy or not."""
    path = tmp_path / "test_x.py"
    path.write_text("def test_a():\n    from test_other import thing\n\n\nimport conftest\n")
    assert imported_modules(path) >= {"test_other", "conftest"}


def test_the_top_of_scripts_holds_only_the_pinned_entry_points():
    """Scripts live in purpose folders (bench/, ci/, build/, render/, gpu/, serve/, experiments/); at most six files
    stay at the top: the entry points that the docs, CI and the recorded results name."""
    top = files_in(SCRIPTS)
    assert len(top) <= 6, sorted(p.name for p in top)
    assert {"bench_sandbox.py", "bench_rollout.py", "bench_async_rollout.py", "gpu_check.sh", "test_engines.sh"} <= {
        p.name for p in top
    }


def test_each_entry_point_runs_a_script_that_exists():
    """An entry point at the top of scripts/ hands its arguments to the script it names in a purpose folder."""
    for path in files_in(SCRIPTS):
        text = path.read_text()
        if path.suffix == ".py":
            assert "runpy.run_path" in text, path.name
            (target,) = SCRIPTS.glob(f"*/{path.name}")
        else:
            line = next(line for line in text.splitlines() if line.startswith("exec bash"))
            target = SCRIPTS / line.split('"$(dirname "$0")/', 1)[1].split('"', 1)[0]
        assert target.is_file(), (path.name, target)
