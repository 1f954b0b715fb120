"""`retool-trl quickstart --seeds`: one run folder per seed, then the table and plot across them.

The runs themselves are the quickstart's (tested end to end in test_quickstart*.py); here a stand-in run writes a
summary of the real shape, so the aggregate is checked against values computed by hand.
"""

import json

import pytest

from retool_trl.errors import UserError
from retool_trl.quickstart.runner import main
from retool_trl.quickstart.seeds import aggregate_seeds, parse_seeds, run_seeds, seeds_table


@pytest.mark.parametrize(
    "text, seeds", [("0-4", [0, 1, 2, 3, 4]), ("3", [3]), ("0,2,7", [0, 2, 7]), ("1-2,5", [1, 2, 5])]
)
def test_parse_seeds(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a-b", "0-", "1,1", "-1", "3-1", "0-1,5-3"])
def test_bad_seeds_are_one_clear_error(text):
    with pytest.raises(ValueError, match="--seeds"):
        parse_seeds(text)


def fake_summary(seed: int, multiturn: bool = False) -> dict:
    run = {"accuracy_before": 0.5, "accuracy_after": 0.9 + seed / 100, "code_ratio_after": 1.0 - seed / 100}
    if multiturn:
        run.update(recovery_rate_after=0.8, failing_completions_after=100, calls_per_completion_after=2.0 + seed / 10)
    return {
        "tool_rl": dict(run),
        "text_rl": {**run, "accuracy_after": 0.01 * seed},
        "wall_s": 100.0 + seed,
        "task": {"max_cell_chars": 16} if multiturn else {"difficulty": 2},
        "settings": {"seed": seed},
    }


def test_run_seeds_writes_a_folder_per_seed_and_the_aggregate(tmp_path):
    calls = []

    def run(output_dir, seed, **kwargs):
        calls.append((output_dir, seed, kwargs))
        output_dir.mkdir(parents=True)
        summary = fake_summary(seed, multiturn=True)
        (output_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    aggregate = run_seeds([0, 1, 2], run, tmp_path, max_steps=3)
    assert [(c[0].name, c[1], c[2]) for c in calls] == [(f"seed{s}", s, {"max_steps": 3}) for s in (0, 1, 2)]
    accuracy = aggregate["runs"]["tool_rl"]["accuracy_after"]
    assert accuracy["per_seed"] == [0.9, 0.91, 0.92]
    assert accuracy["min"] == 0.9 and accuracy["max"] == 0.92 and accuracy["mean"] == pytest.approx(0.91)
    assert aggregate["runs"]["tool_rl"]["recovery_rate_after"]["stderr_per_seed"] == [pytest.approx(0.04)] * 3
    assert aggregate["command_s"]["max"] == 102.0
    assert json.loads((tmp_path / "seeds.json").read_text())["seeds"] == [0, 1, 2]
    table = (tmp_path / "seeds.md").read_text()
    assert "| tool_rl | accuracy after | 91.0% | 90.0% | 92.0% | 90.0% | 91.0% | 92.0% |" in table
    assert (tmp_path / "seeds.png").stat().st_size > 10_000


def test_the_table_leaves_out_what_a_task_does_not_log():
    table = seeds_table(aggregate_seeds({s: fake_summary(s) for s in (0, 1)}))
    assert "recovery" not in table and "code ratio after" in table


def test_the_cli_refuses_bad_seeds_before_any_work():
    with pytest.raises(UserError, match="--seeds 'x' is not a list of seeds"):
        main(["--seeds", "x"])


def test_the_quickstart_learning_rate_is_constant_then_decays_to_zero(tmp_path):
    """The trained model is the last update's: the rate holds for the first steps and reaches 0 at the last one."""
    import torch
    from transformers import get_scheduler

    from retool_trl.quickstart import QuickstartArguments, rl_config

    args = QuickstartArguments(max_steps=40, lr_decay_steps=15)
    config = rl_config(args, tmp_path, with_tools=True)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    scheduler = get_scheduler(
        config.lr_scheduler_type, optimizer, 0, args.max_steps, scheduler_specific_kwargs=config.lr_scheduler_kwargs
    )
    rates = []
    for _ in range(args.max_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:25] == [pytest.approx(3e-4)] * 25
    assert all(a > b for a, b in zip(rates[25:], rates[26:])) and rates[-1] < 0.02 * 3e-4
    constant = rl_config(QuickstartArguments(lr_decay_steps=0), tmp_path, with_tools=True)
    assert constant.lr_scheduler_type == "constant"
