import os

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def char_tokenizer():
    from testing_utils import make_char_tokenizer

    return make_char_tokenizer()


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # Two cores on CI: keep torch from oversubscribing them while sandbox workers run.
    import torch

    torch.set_num_threads(1)


# A skip reason is read in a list of them (`pytest -rs`): one short line naming what is missing, not a report dump.
MAX_SKIP_REASON_CHARS = 240


def skip_reason_problem(reason: str) -> str | None:
    """Why a skip reason is not one short line, or None when it is."""
    if "\n" in reason.strip():
        return "a skip reason must be one line"
    if len(reason) > MAX_SKIP_REASON_CHARS:
        return f"a skip reason must be short ({len(reason)} > {MAX_SKIP_REASON_CHARS} characters)"
    return None


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
