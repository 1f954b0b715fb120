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
