"""The README's config table lists every field ReToolConfig adds to GRPOConfig, with its real default."""

import dataclasses
import re
from pathlib import Path

from trl import GRPOConfig

from retool_trl import ReToolConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_table_matches_the_config():
    text = README.read_text()
    table = text.split("### Fields ReTool adds to `GRPOConfig`", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.MULTILINE))
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = {f.name: f.default for f in dataclasses.fields(ReToolConfig) if f.name not in inherited}
    assert set(rows) == set(own), f"missing: {set(own) - set(rows)}, stale: {set(rows) - set(own)}"
    for name, default in own.items():
        assert rows[name] == repr(default), f"{name}: README says {rows[name]}, the config {default!r}"
