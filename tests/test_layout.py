"""The package's house rules: imports run one way (no cycles, light modules stay light) and modules stay short."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "retool_trl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every `retool_trl` module -> the package modules it imports, lazily (inside functions) or not."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(c for c in candidates if c in modules and c != name)
    return graph


def test_no_import_cycles():
    graph = import_graph()
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                # A package importing its own submodules (and them importing the package) is not a cycle.
                if nxt == start and not all(m.startswith(min(path, key=len)) for m in path):
                    pytest.fail(f"import cycle: {' -> '.join([*path, nxt])}")
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))


def test_modules_stay_short():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in lengths.items() if n > 500}
    assert not too_long, too_long


@pytest.mark.parametrize(
    "module",
    [
        "retool_trl.data",
        "retool_trl.parsing",
        "retool_trl.prompts",
        "retool_trl.rollout",
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
