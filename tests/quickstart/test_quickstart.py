import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from retool_trl.data.synthetic import make_arithmetic_dataset
from retool_trl.quickstart import (
    QuickstartArguments,
    QuickstartTask,
    build_char_tokenizer,
    build_tiny_model,
    model_path,
    run_quickstart,
)

TAGS = ["<code>", "</code>", "<interpreter>", "</interpreter>"]
TEXTS = [
    "What is (859*55)%99?\n",
    "<code>print(843*13)</code><interpreter>10959\n</interpreter>\\boxed{10959}",
    "  two  spaces\tand tabs\n\nTraceback (most recent call last):\nZeroDivisionError: división ∑",
]


def test_char_tokenizer_is_lossless_with_single_token_tags():
    tokenizer = build_char_tokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    ids = tokenizer("<code>x</code><interpreter>1\n</interpreter>")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<code>" and len(ids) == 7
    # TRL decodes completions with skip_special_tokens=True: the tags must survive it, EOS must not.
    text = "<code>x</code>" + tokenizer.eos_token
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == "<code>x</code>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_char_tokenizer_survives_autotokenizer_reload(tmp_path):
    # AutoTokenizer loads any `qwen2` checkpoint as Qwen2Tokenizer, which rebuilds its own pipeline around the
    # saved vocabulary; the tokenizer must tokenize identically after that.
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_tiny_model_is_seeded():
    tokenizer = build_char_tokenizer()
    a, b = build_tiny_model(tokenizer, seed=1), build_tiny_model(tokenizer, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.config.tie_word_embeddings and a.config.vocab_size == len(tokenizer)


def test_shipped_model_is_small_and_copies_expressions_into_code():
    path = Path(model_path())
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 5 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.vocab_size == len(tokenizer)
    assert all(tokenizer.convert_tokens_to_ids(tag) != tokenizer.unk_token_id for tag in TAGS)
    task = QuickstartTask()
    problems = make_arithmetic_dataset(24, seed=11, difficulty=task.difficulty, split="test")
    batch = tokenizer(list(problems["prompt"]), return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    # Greedy decoding always calls code (sampling sometimes answers directly); the expression must be copied.
    copied = [t.startswith(f"<code>print({e})</code>") for t, e in zip(texts, problems["expression"])]
    assert sum(copied) >= 22, texts


def test_quickstart_arguments_are_validated():
    with pytest.raises(ValueError, match="num_generations"):
        QuickstartArguments(num_generations=1)
    with pytest.raises(ValueError, match="max_steps"):
        QuickstartArguments(max_steps=0)


def test_cli_reports_bad_values_in_one_line(capsys):
    from retool_trl.cli import main

    assert main(["quickstart", "--max-steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_steps" in err
    assert main(["quickstart", "--max-steps", "two"]) == 2
    assert "--max-steps" in capsys.readouterr().err
    assert main(["quickstart", "--model", "/no/such/model"]) == 2
    assert "--model" in capsys.readouterr().err


def test_quickstart_run_folder(tmp_path, capsys):
    summary = run_quickstart(
        tmp_path / "run",
        max_steps=2,
        prompts_per_step=2,
        num_generations=4,
        num_train=8,
        num_eval=8,
    )
    out = tmp_path / "run"
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for run in ("tool_rl", "text_rl"):
        for key in ("accuracy_before", "accuracy_after", "code_ratio_before", "code_ratio_after", "mean_length_after"):
            assert 0 <= written[run][key] <= (1 if "length" not in key else 64)
        assert written[run]["steps"] == 2
        history = json.loads((out / run / "trainer_state.json").read_text())["log_history"]
        assert [h["step"] for h in history if "reward" in h] == [1, 2]
        assert all("retool/code_ratio" in h for h in history if "reward" in h)
        # The full log is kept in the run folder, line by line as it was logged.
        log = [json.loads(line) for line in (out / run / "log.jsonl").read_text().splitlines()]
        assert [entry for entry in log if "reward" in entry] == [h for h in history if "reward" in h]
        assert (out / run / "model" / "config.json").is_file()
        samples = (out / run / "eval_after_samples.jsonl").read_text().splitlines()
        assert len(samples) == 8 and all("completion" in json.loads(line) for line in samples)
        AutoModelForCausalLM.from_pretrained(out / run / "model")
    # Without the interpreter nothing is executed, whatever the model writes.
    assert written["text_rl"]["code_ratio_before"] == written["text_rl"]["code_ratio_after"] == 0
    assert written["wall_s"] > 0
    assert (out / "quickstart.png").stat().st_size > 10_000
    # The isolation the quickstart's code ran under is recorded with its results (and said once at its start).
    isolation = json.loads((out / "isolation.json").read_text())
    assert isolation["summary"].startswith(f"isolation level {isolation['isolation']}: holds:")
    # The console shows the progress bar with a few numbers, not TRL's ~40-key log dicts.
    captured = capsys.readouterr()
    assert "'completions/mean_length'" not in captured.out + captured.err
    assert "reward " in captured.err and "code " in captured.err


TINY = dict(max_steps=2, prompts_per_step=2, num_generations=4, num_train=8, num_eval=8, threads=1)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores: the two runs train side by side on 2+")
def test_runs_trained_side_by_side_give_the_results_of_runs_in_turn(tmp_path, capfd):
    """A user's machine with a core for each run (2+ cores, one thread each): the text-only run trains in a forked
    process beside the tool run. Each run is seeded alone, so every number of both runs must equal the numbers of the
    same runs trained one after the other; and the two consoles stay apart (each line names its run)."""
    together = run_quickstart(tmp_path / "together", side_by_side=True, **TINY)
    lines = capfd.readouterr().err.splitlines()
    in_turn = run_quickstart(tmp_path / "in_turn", side_by_side=False, **TINY)
    for run in ("tool_rl", "text_rl"):
        assert {k: v for k, v in together[run].items() if k != "train_s"} == {
            k: v for k, v in in_turn[run].items() if k != "train_s"
        }
        logged = [json.loads(line) for line in (tmp_path / "together" / run / "log.jsonl").read_text().splitlines()]
        assert [e["reward"] for e in logged if "reward" in e] == [
            json.loads(line)["reward"]
            for line in (tmp_path / "in_turn" / run / "log.jsonl").read_text().splitlines()
            if "reward" in json.loads(line)
        ]
        assert any(line.startswith(f"{run} | step 2/2") for line in lines), lines
    assert (tmp_path / "together" / "isolation.json").is_file()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores: the two runs train side by side on 2+")
@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_failing_side_run_is_reported_by_name(tmp_path, monkeypatch, how):
    """The forked run failing (an exception) or dying (killed, as by the OOM killer) is raised in the quickstart,
    naming the run and, for a death, the way to train the runs one after the other: never a hang, never a summary
    without it."""
    from retool_trl.quickstart import runner

    real = runner.train_run

    def train_run(name, *args, **kwargs):
        if name == "text_rl":
            if how == "dies":
                os._exit(3)
            raise ValueError("a broken text run")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(runner, "train_run", train_run)
    expected = "text_rl run failed in its own process" if how == "raises" else "exit code 3.*--side-by-side false"
    with pytest.raises(RuntimeError, match=expected):
        run_quickstart(tmp_path / "run", side_by_side=True, **TINY)
    assert not (tmp_path / "run" / "summary.json").exists()
