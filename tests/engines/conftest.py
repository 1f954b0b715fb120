"""The engine tests' shared fixtures: the quickstart tokenizer and one local sandbox per module."""

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from helpers.engine_helpers import quickstart_tokenizer

    return quickstart_tokenizer()


@pytest.fixture(scope="module")
def sandbox():
    from retool_trl.sandbox import LocalSandbox

    with LocalSandbox(num_workers=1, timeout_s=10.0) as box:
        yield box
