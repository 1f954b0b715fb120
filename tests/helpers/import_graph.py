"""The package's import graph, read from its source (the layout tests hold it to its rules)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "retool_trl"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of `package` -> the package's modules it imports, lazily (inside functions) or not."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        parent = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = parent.split(".")[: len(parent.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(c for c in candidates if c in modules and c != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import cycle of `graph` as a path `[a, b, ..., a]`, or `None`.

    A package importing its own submodules, and them importing the package, is not a cycle: every module of such a
    path lies inside the path's shortest module, which is a package of the graph (`a.b` is inside `a`, while
    `a.quickstart_multiturn` is not inside `a.quickstart`, however their names begin)."""
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    root = min(path, key=len)
                    if not all(m == root or m.startswith(root + ".") for m in path):
                        return [*path, nxt]
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return None
