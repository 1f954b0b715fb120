import os
import sys
from pathlib import Path

import pytest

# The tests' shared helpers are one package, `tests/helpers/`: `from helpers.testing_utils import ...` works from every
# subject folder (pytest runs with --import-mode=importlib, which puts no test folder on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.skip_reasons import skip_reason_problem  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def char_tokenizer():
    from helpers.testing_utils import make_char_tokenizer

    return make_char_tokenizer()


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # Two cores on CI: keep torch from oversubscribing them while sandbox workers run.
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        problem = skip_reason_problem(reason)
        if problem is not None:  # the skip stands, but the test fails so that the reason gets fixed
            report.outcome = "failed"
            report.longrepr = f"{problem}; it began: {reason[:160]!r}"
