"""The user documents stay true: the config reference lists every field ReToolConfig adds to GRPOConfig with its real
default, every command the README and the docs pages show exists with the options they give it, and every link
between them resolves."""

import contextlib
import dataclasses
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from trl import GRPOConfig

from retool_trl import ReToolConfig
from retool_trl.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
CONFIG_PAGE = ROOT / "docs" / "configuration.md"


def test_config_reference_table_matches_the_config():
    text = CONFIG_PAGE.read_text()
    table = text.split("## Fields ReTool adds to `GRPOConfig`", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.MULTILINE))
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = {f.name: f.default for f in dataclasses.fields(ReToolConfig) if f.name not in inherited}
    assert set(rows) == set(own), f"missing: {set(own) - set(rows)}, stale: {set(rows) - set(own)}"
    for name, default in own.items():
        assert rows[name] == repr(default), f"{name}: {CONFIG_PAGE.name} says {rows[name]}, the config {default!r}"


# ------------------------------------------------------------------------------------------------ commands
def shown_commands(text: str) -> list[str]:
    """Command lines of a Markdown page: the lines of its bash blocks and its inline code spans that start like a
    command of this project."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        lines += [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and line[0] != "#"]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    starts = (
        "retool-trl ",
        "python ",
        "python3 ",
        "pip ",
        "bash ",
        ".venv-engines/",
        "accelerate ",
        "CUDA_VISIBLE_DEVICES",
    )
    return [line for line in lines if line.startswith(starts)]


@cache
def cli_help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([command, "--help"]) == 0
    return out.getvalue()


def options_of(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def script_source(path: Path) -> str:
    """A script's source; for an entry point kept at its documented path that runs the script of the same name in a
    purpose folder (`scripts/bench_rollout.py` runs `scripts/bench/bench_rollout.py`), the source of that script."""
    source = path.read_text()
    if "runpy.run_path" in source:
        (target,) = path.parent.glob(f"*/{path.name}")
        source = target.read_text()
    return source


def check_command(line: str) -> list[str]:
    """What is wrong with one shown command line (an empty list when nothing is)."""
    words = shlex.split(line.replace("[", "").replace("]", ""))
    problems = []
    for word in words:  # every path of this repository that the line names must exist
        if re.match(r"^(configs|scripts|docs|retool_trl|tests)/[\w./-]+$", word) and not (ROOT / word).exists():
            problems.append(f"{word} does not exist")
    for k, word in enumerate(words):
        if word == "retool-trl" or (word == "retool_trl" and words[k - 1] == "-m"):
            if k + 1 == len(words):
                continue  # the bare program: it prints its commands
            command, rest = words[k + 1], words[k + 2 :]
            if command not in COMMANDS:
                problems.append(f"retool-trl has no command {command!r}")
                continue
            accepted = set(re.findall(r"--[\w-]+", cli_help(command)))
            # TRL's parser takes every `--a_b` as `--a-b` too; the short help lists one spelling.
            accepted |= {o[:2] + o[2:].replace("_", "-") for o in accepted}
            if command in ("train", "sft"):
                accepted.add("--config")  # TrlParser's own option, not in the help text
            problems += [f"retool-trl {command} has no option {o}" for o in options_of(rest) if o not in accepted]
        elif re.match(r"^scripts/[\w/]+\.py$", word) and (ROOT / word).exists():
            source = script_source(ROOT / word)
            if "add_argument" in source:  # argparse scripts: each option shown is one they define
                problems += [f"{word} has no option {o}" for o in options_of(words[k + 1 :]) if f'"{o}"' not in source]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_shown_command_exists(page):
    """A user copies these lines: each command, option, script and config they name must exist."""
    commands = shown_commands(page.read_text())
    if page == README:
        assert any(c.startswith("retool-trl quickstart") for c in commands)
        setup = [
            c for c in commands if c.endswith("pip install -e . && retool-trl quickstart --output-dir runs/quickstart")
        ]
        assert len(setup) == 1, "one set-up command: environment, CPU PyTorch, install, quickstart"
        # A newcomer without a GPU must get the CPU build of torch before pip resolves the package's torch.
        assert setup[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")
        assert setup[0].index("--index-url https://download.pytorch.org/whl/cpu") < setup[0].index("pip install -e .")
        assert 'pip install -e ".[dev]" && python -m pytest -q' in commands
    problems = {line: check_command(line) for line in commands}
    assert not {line: p for line, p in problems.items() if p}


def test_command_check_catches_what_does_not_exist():
    """The check above is only worth something if it fails on a wrong command."""
    assert check_command("retool-trl trian --config configs/quickstart.yaml")
    assert check_command("retool-trl quickstart --tasks multiturn")
    assert check_command("retool-trl train --config configs/nope.yaml")
    assert check_command("python scripts/bench_rollout.py --jsn")
    assert not check_command("retool-trl quickstart --task multiturn --output-dir runs/x")
    assert not check_command("python scripts/bench_rollout.py --backend vllm --json")


# ------------------------------------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    """Relative links (docs pages, plots, sections) point at files and headings that exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, broken


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text())}
    assert DOCS and linked == {p.resolve() for p in DOCS}


def test_readme_stays_a_users_page():
    """A short page for users: no work-item numbers, nothing about the machine the project was built on."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for page in PAGES:
        for phrase in (r"\bissue \d+", r"\bthis round\b", r"haltpoll", r"Firecracker", r"\bthis VM\b"):
            assert not re.search(phrase, page.read_text(), flags=re.IGNORECASE), (page.name, phrase)


# ------------------------------------------------------------------------------------------------ installing
def test_the_torch_step_advice_quotes_what_pip_says_when_the_index_is_unreachable():
    """A normal user whose machine cannot reach PyTorch's index: pip's only words are "No matching distribution
    found" (tried here against an index on a closed port); the README's advice for that case must quote them, so that
    the user recognises it, and must not suggest leaving the step out (pip would fetch the CUDA build)."""
    import subprocess
    import sys

    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("pip is not installed in this environment")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--no-deps"]
        + ["--index-url", "http://127.0.0.1:9/simple", "--retries", "0", "--timeout", "2", "filelock"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = re.search(r"ERROR: (No matching distribution found) for filelock", done.stderr)
    assert done.returncode != 0 and said, done.stderr[-2000:]
    text = " ".join(README.read_text().split())
    advice = text[text.index("The CPU build comes first") :][:900]
    assert f"`{said.group(1)} for ...`" in advice and "download.pytorch.org" in advice, advice
    assert "do not leave the step out" in advice and "mirror" in advice


def test_install_commands_install_from_a_clone():
    """The package is installed from a clone of this repository (it is not published on a package index): a page
    that says `pip install "retool-trl[server]"` sends the user to a package pip cannot find. Every `pip install`
    shown that names the package installs a path (`-e ".[server]"`, `/src[server]`), with extras pyproject declares."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    for page in PAGES:
        for line in shown_commands(page.read_text()):
            for words in re.findall(r"pip install ([^&|;]+)", line):
                for target in shlex.split(words):
                    name = target.split("[")[0]
                    assert name != project["name"], f"{page.name}: {line}"
                    if "[" in target and name.startswith((".", "/")):
                        assert set(target.split("[")[1].rstrip("]").split(",")) <= extras, f"{page.name}: {line}"
