"""The sandbox's trust boundary, drawn by its folders and pinned here: what runs inside a jail (`jail/`), what runs
in the trainer (`host/`, `isolation/`, `remote/`) and what serves other machines (`server/`).

The real condition each rule stands for: the zygote is started as `python -I jail/worker.py` inside the jail, where
nothing but the interpreter's standard library and that one folder can be found; a jail module that imported the
package, or a third-party library, would fail there (or let a cell reach trainer code). The host must never import
the server: a trainer does not need starlette, and the service depends on the host, not the reverse.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.import_graph import PACKAGE, import_graph

SANDBOX = PACKAGE / "sandbox"
JAIL = SANDBOX / "jail"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, top-level name) of every import in a file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, (node.module or "").split(".")[0]))
    return found


def jail_violations(folder: Path) -> dict[str, list[str]]:
    """Per jail file, what it imports from neither the standard library nor its own folder (relative imports too:
    the jail loads these files as scripts, not as a package)."""
    siblings = {p.stem for p in folder.glob("*.py")}
    bad = {}
    for path in folder.glob("*.py"):
        wrong = [
            ("." * level) + name
            for level, name in _imports(path)
            if level or not (name in sys.stdlib_module_names or name in siblings)
        ]
        if wrong:
            bad[path.name] = wrong
    return bad


def test_jail_side_imports_only_the_standard_library_and_its_own_folder():
    assert jail_violations(JAIL) == {}


def test_the_jail_rule_would_catch_a_package_or_third_party_import(tmp_path):
    """The check itself can fail: a jail file importing the package, numpy or a relative module is reported."""
    (tmp_path / "ok.py").write_text("import os\nfrom wire import frame\n")
    (tmp_path / "wire.py").write_text("import json\n")
    (tmp_path / "bad.py").write_text("import numpy\nfrom retool_trl.sandbox import base\nfrom . import ok\n")
    assert jail_violations(tmp_path) == {"bad.py": ["numpy", "retool_trl", "."]}


def test_host_side_never_imports_the_server():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith(("retool_trl.sandbox.host", "retool_trl.sandbox.isolation", "retool_trl.sandbox.remote")):
            server = sorted(t for t in targets if t.startswith("retool_trl.sandbox.server"))
            assert not server, f"{name} imports the server: {server}"
        if name.startswith("retool_trl.sandbox.remote"):
            host = sorted(t for t in targets if t.startswith("retool_trl.sandbox.host"))
            assert not host, f"{name} (the remote client) imports the local host: {host}"


def test_nothing_imports_the_jail_but_its_shared_pieces():
    """The host may read the wire format, the freezer and the Landlock rules from the jail side; the zygote's and
    the session's programs are started by path, never imported by trainer code."""
    shared = {"wire", "freezer", "landlock"}
    for name, targets in import_graph().items():
        if name.startswith("retool_trl.sandbox.jail"):
            continue
        reached = {t.rsplit(".", 1)[-1] for t in targets if t.startswith("retool_trl.sandbox.jail.")}
        assert reached <= shared, f"{name} imports jail modules {sorted(reached - shared)}"


def test_every_sandbox_module_sits_in_a_folder_that_says_where_it_runs():
    """Only the shared interface stays at the top of the sandbox package; every folder's face says where its code
    runs, with what privileges, and what it may import."""
    top = {p.name for p in SANDBOX.glob("*.py")}
    assert top == {"__init__.py", "base.py", "cell_limits.py", "factory.py"}
    for folder in ("jail", "host", "remote", "server", "isolation"):
        doc = ast.get_docstring(ast.parse((SANDBOX / folder / "__init__.py").read_text())) or ""
        assert "runs" in doc and "import" in doc.lower(), f"sandbox/{folder}/__init__.py does not say where it runs"


@pytest.mark.parametrize("folder", ["jail", "host", "remote", "server", "isolation"])
def test_no_sandbox_folder_is_over_3000_lines(folder):
    lines = sum(len(p.read_text().splitlines()) for p in (SANDBOX / folder).rglob("*.py"))
    assert lines <= 3000, f"sandbox/{folder} has {lines} lines"


def test_the_zygote_program_starts_with_only_its_folder_on_the_path(tmp_path):
    """As the jail starts it: `python -I -S` with the jail folder alone reachable (a copy elsewhere, so the package
    cannot be found through any parent). Importing every jail module must work there."""
    copy = tmp_path / "jail"
    copy.mkdir()
    for path in JAIL.glob("*.py"):
        (copy / path.name).write_text(path.read_text())
    modules = sorted(p.stem for p in JAIL.glob("*.py") if p.stem != "__init__")
    imports = "".join(f"import {m}\n" for m in modules)
    code = f"import sys; sys.path.insert(0, {str(copy)!r})\n{imports}print('ok')"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
