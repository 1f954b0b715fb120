"""Which sandbox a trainer closes: the one it built, whatever path built it. `trainer.evaluate()` called outside
`train()` builds the sandbox from the config; it used to stay open (its jails and the trainer's descriptors) until
the process ended."""

import pytest
from trl import GRPOTrainer

from helpers.testing_utils import trainer_for
from retool_trl import trainer as trainer_module
from retool_trl.testing import FakeSandbox


class _Counted(FakeSandbox):
    closes = 0

    def close(self):
        type(self).closes += 1
        super().close()


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    _Counted.closes = 0
    monkeypatch.setattr(trainer_module, "sandbox_from_config", lambda args: _Counted())
    built = trainer_for(tmp_path, ["\\boxed{42}"])
    built._sandbox, built._owns_sandbox = None, True  # as when no sandbox is given: built from the config
    return built


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_evaluate_outside_train_closes_the_sandbox_it_built(trainer, monkeypatch, fails):
    def parent_evaluate(self, *args, **kwargs):
        assert self.sandbox is not None  # the evaluation's rollouts build it
        if fails:
            raise RuntimeError("evaluation failed")
        return {"eval_loss": 0.0}

    monkeypatch.setattr(GRPOTrainer, "evaluate", parent_evaluate)
    if fails:
        with pytest.raises(RuntimeError):
            trainer.evaluate()
    else:
        assert trainer.evaluate() == {"eval_loss": 0.0}
    assert _Counted.closes == 1 and trainer._sandbox is None


def test_evaluate_during_train_leaves_the_sandbox_to_train(trainer, monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "evaluate", lambda self, *a, **k: self.sandbox and {})
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: [self.evaluate(), self.evaluate()])
    trainer.train()
    assert _Counted.closes == 1  # once, by train() at its end, not by each evaluation
