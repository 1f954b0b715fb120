"""The isolation levels as objects: the docs' levels table states each level's facts as its object does, a level
defined here (one class, registered here) is picked and reported by the pool with no other module changed, and no
sandbox module outside `isolation/` decides anything by a level's name."""

import ast
import os
from pathlib import Path

import pytest

from retool_trl.sandbox import LocalSandbox, UnsafeSandboxError
from retool_trl.sandbox.isolation import LEVELS, IsolationLevel, Launch, choose_level, isolation_modes, register

DOCS = Path(__file__).resolve().parents[3] / "docs" / "sandbox.md"
ORDINALS = ("first", "second", "third", "fourth", "fifth")


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the docs' levels table (the one whose header starts `| level | chosen when |`), by column."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| level | chosen when |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


def stated_facts(level: IsolationLevel, levels: list[IsolationLevel]) -> dict[str, str]:
    """What the table's fact columns must say for `level`, in the table's words."""
    taken = [known.name for known in levels if known.auto]
    if level.auto:
        by_auto = ORDINALS[taken.index(level.name)]
    else:
        by_auto = "as its fallback" if level.fallback else "never"
    return {
        "level": f"`{level.name}`",
        "`auto` takes it": by_auto,
        "private file system": "yes" if level.private_filesystem else "no",
        "reads and writes confined": "yes" if level.filesystem_confined else "no",
        "tries namespaces per session": "always" if level.always_jails else "as root",
        "as root": "refused without the opt-in" if level.root_needs_opt_in else "runs",
    }


def disagreements(rows: list[dict[str, str]], levels: list[IsolationLevel]) -> list[str]:
    """Each place where the table and the level objects differ (a level missing, out of order, or a fact)."""
    found = []
    if [row["level"] for row in rows] != [f"`{level.name}`" for level in levels]:
        found.append(f"levels: table {[row['level'] for row in rows]}, registry {[lv.name for lv in levels]}")
    for row, level in zip(rows, levels):
        for column, words in stated_facts(level, levels).items():
            if row.get(column) != words:
                found.append(f"{level.name}, {column}: table says {row.get(column)!r}, the level {words!r}")
    return found


def test_the_docs_table_states_each_levels_facts_as_its_object_does():
    assert disagreements(table_rows(DOCS.read_text()), LEVELS) == []


def test_the_table_check_fails_when_a_fact_disagrees():
    """The check can fail: a table that gives Landlock a private file system, or drops a level, is caught."""
    rows = table_rows(DOCS.read_text())
    wrong = [dict(row, **{"private file system": "yes"}) if row["level"] == "`landlock`" else row for row in rows]
    assert disagreements(wrong, LEVELS) == ["landlock, private file system: table says 'yes', the level 'no'"]
    assert disagreements(rows[:-1], LEVELS)[0].startswith("levels:")


def test_the_root_refusal_fact_is_what_the_level_does(monkeypatch):
    """`root_needs_opt_in` (the table's 'as root' column) matches `root_refusal`, as root and as a normal user."""
    for uid, refuses in ((0, True), (1000, False)):
        monkeypatch.setattr(os, "geteuid", lambda uid=uid: uid)
        for level in LEVELS:
            for fell_back in (False, True):
                said = level.root_refusal("why not", fell_back)
                assert (said is not None) == (refuses and level.root_needs_opt_in), (level.name, uid, said)


class Toy(IsolationLevel):
    """A level that isolates nothing (the zygote runs directly) and says so, with facts no shipped level has."""

    name = "toy"
    title = "Toy"
    auto = False
    private_filesystem = True  # a made-up fact, to see it reach the report
    problem_text = None

    def problem(self, network):
        return self.problem_text

    def launch(self, worker, network, writable, why):
        return Launch(self.name, [], None, missing=["a protection the toy level lacks"])


@pytest.fixture
def toy():
    level = register(Toy())
    try:
        yield level
    finally:
        LEVELS.remove(level)


def test_a_registered_level_is_named_chosen_and_reported_by_the_pool(toy):
    assert "toy" in isolation_modes()
    assert choose_level("toy", network=False).level is toy
    assert choose_level("auto", network=False).level is not toy  # not for auto unless it says so
    with LocalSandbox(num_workers=1, preload=(), isolation="toy") as sandbox:
        report = sandbox.isolation_report()
        assert sandbox.session().run("print(6 * 7)").output == "42\n"
    assert report["isolation"] == "toy" and sandbox.isolation_used == "toy"
    assert report["private_filesystem"] is True and report["filesystem_confined"] is False
    assert "a protection the toy level lacks" in report["missing"]
    assert report["summary"].startswith("isolation level toy:")


def test_auto_tries_a_registered_level_in_its_place(toy, monkeypatch):
    """Placed before the others and marked for `auto`, the toy is tried first; where it does not run, its words lead
    the list of why each stronger level did not run, and `auto` goes on down the registry."""
    LEVELS.remove(toy)
    register(toy, before=LEVELS[0].name)
    monkeypatch.setattr(Toy, "auto", True)
    assert choose_level("auto", network=False).level is toy
    monkeypatch.setattr(Toy, "problem_text", "no toy here")
    choice = choose_level("auto", network=False)
    assert choice.level is not toy and choice.problems[0] == "Toy: no toy here"


def test_a_level_that_refuses_root_stops_the_pool_before_any_jail(toy, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the refusal is for root")
    monkeypatch.setattr(Toy, "root_refusal", lambda self, why, fell_back: "the toy level refuses root")
    sandbox = LocalSandbox(num_workers=1, preload=(), isolation="toy")
    with pytest.raises(UnsafeSandboxError, match="the toy level refuses root"):
        sandbox.isolation_report()
    sandbox.close()
    allowed = LocalSandbox(num_workers=1, preload=(), isolation="toy", allow_root_without_isolation=True)
    with allowed:
        assert allowed.isolation_report()["isolation"] == "toy"


SANDBOX = Path(__file__).resolve().parents[3] / "retool_trl" / "sandbox"


def level_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that compare something with a level's name (`== "bwrap"`, `in ("bwrap", "landlock")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            if any(isinstance(item, ast.Constant) and item.value in names for item in items):
                found.append(node.lineno)
                break
    return found


def test_no_sandbox_module_outside_isolation_compares_a_level_name():
    """What a level means is asked of its object: the pool once read `private_filesystem`, the jail flag and the
    root refusal off the level's name, so a new level had to be taught to `host/local.py` as well."""
    names = {level.name for level in LEVELS}
    found = {
        str(path.relative_to(SANDBOX)): lines
        for path in SANDBOX.rglob("*.py")
        if "isolation" not in path.relative_to(SANDBOX).parts
        and (lines := level_name_comparisons(path.read_text(), names))
    }
    assert found == {}


def test_the_name_check_sees_the_comparisons_the_pool_once_made():
    names = {level.name for level in LEVELS}
    once = 'a = level == "bwrap"\nb = launch.level in ("bwrap", "landlock")\nc = mode != "auto"\n'
    assert level_name_comparisons(once, names) == [1, 2]
