"""The registry of call formats: what it refuses when a class is registered, and that the rest of the package asks a
format class instead of comparing its name.

The real condition: a contributor adding a format. Before the registry, a format with no system prompt of its own was
silently given the tags' prompt (the model told to write `<code>` while the rollout waited for something else), and
the format's name was compared as a string in six modules outside `retool_trl/format/`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from retool_trl.format import FORMAT_NAMES, StopFormat, get_format, register_format, unregister_format
from retool_trl.format.registry import formats_table

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "retool_trl"


def described(**attrs):
    base = dict(
        name="toy",
        summary="s",
        writes="w",
        answered_by="a",
        stops_at="t",
        prompts={"retool": "Run [[code]]. \\boxed{{x}}", "retool_concise": "[[code]]"},
    )
    return type("Toy", (StopFormat,), {**base, **attrs})


def test_a_format_without_a_prompt_of_its_own_is_refused_when_registered():
    with pytest.raises(TypeError, match="no system prompt of its own for retool_concise"):
        register_format(described(prompts={"retool": "Run [[code]]."}))
    assert "toy" not in FORMAT_NAMES


@pytest.mark.parametrize(
    "attrs,message",
    [
        ({"name": "tags"}, "already registered"),
        ({"name": "not a name"}, "must be an identifier"),
        ({"summary": ""}, "set summary"),
        ({"prompts": {"retool": "{unknown}", "retool_concise": "x"}}, "unknown"),
    ],
)
def test_a_format_that_would_fail_later_is_refused_now(attrs, message):
    with pytest.raises((TypeError, ValueError, KeyError), match=message):
        register_format(described(**attrs))
    assert list(FORMAT_NAMES) == ["tags", "tool_call", "markdown"]


def test_a_registered_format_is_a_choice_of_parsers_built_before_it():
    """The command line's parsers are built at import; a format registered later is still a valid choice."""
    from retool_trl.options import ReToolOptions

    choices = ReToolOptions.__dataclass_fields__["call_format"].metadata["choices"]
    register_format(described())
    try:
        assert "toy" in choices and get_format("toy").name == "toy"
    finally:
        unregister_format("toy")
    assert "toy" not in choices


def _format_name_literals(tree: ast.AST):
    """Where a registered format's name is compared (`==`, `!=`, `in`) or listed (a tuple/list/set of them)."""
    names = set(FORMAT_NAMES)

    def is_name(node):
        return isinstance(node, ast.Constant) and node.value in names

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            listed = [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
            if any(is_name(o) for o in operands + listed):
                yield node.lineno, "compared"
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(map(is_name, node.elts)) >= 2:
            yield node.lineno, "listed"


def test_no_format_name_is_compared_or_listed_outside_the_format_package():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "format"):
            continue
        found += [
            f"{path.relative_to(ROOT)}:{line} {what}"
            for line, what in _format_name_literals(ast.parse(path.read_text()))
        ]
    assert not found, "ask the format class (retool_trl.format.registry) instead:\n" + "\n".join(found)


def test_the_name_check_sees_a_comparison_and_a_list():
    """The check above can fail: it finds the two shapes the package once had."""
    source = 'if args.call_format == "tool_call":\n    pass\nCHOICES = ["tags", "tool_call", "markdown"]\n'
    assert [what for _, what in _format_name_literals(ast.parse(source))] == ["compared", "listed"]


def test_the_docs_formats_table_is_the_registrys():
    """docs/configuration.md's table of call formats is the one the registered classes render."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = re.search(r"^\| format \| the model writes \|.*?(?=\n\n)", text, re.S | re.M)
    assert table is not None, "docs/configuration.md has no call formats table"
    assert table.group(0) == formats_table(), "regenerate it from retool_trl.format.registry.formats_table()"


def test_a_broken_plugin_leaves_the_built_in_formats_working(monkeypatch, caplog):
    """A third-party format declared as an entry point that cannot be registered (here: not a format class) is
    one warning; the config, the command line and the built-in formats go on."""
    import importlib.metadata

    from retool_trl.format import registry

    class Entry:
        value = "broken_plugin:NotAFormat"

        def load(self):
            return object

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [Entry()] if group else [])
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    with caplog.at_level("WARNING", logger=registry.__name__):
        assert get_format("markdown").name == "markdown"
    assert "broken_plugin:NotAFormat could not be loaded" in caplog.text
    assert list(FORMAT_NAMES) == ["tags", "tool_call", "markdown"]
