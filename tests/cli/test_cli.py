"""`retool-trl` end to end on a tiny local model and local data, and every bad-input case's one-line error."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers.testing_utils import (
    PROBLEMS_ARGS,
    make_char_tokenizer,
    make_closed_vocab_tokenizer,
    save_tiny_model,
    write_problems,
)
from retool_trl.cli import eval as cli_eval
from retool_trl.cli import main
from retool_trl.cli import sft as cli_sft
from retool_trl.cli import train as cli_train
from retool_trl.format.parsing import remove_spans
from retool_trl.models.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
REWARDS_MODULE = '''
def ramp(completions, **kwargs):
    """Distinct rewards within a group, so that the policy gradient is not zero."""
    return [float(i % 4) for i in range(len(completions))]
'''
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_model(root / "model", make_char_tokenizer())
    save_tiny_model(root / "closed_model", make_closed_vocab_tokenizer())  # cannot spell every tag or text
    chat = make_char_tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    save_tiny_model(root / "chat_model", chat)
    nopad = make_char_tokenizer()
    nopad.pad_token = None
    save_tiny_model(root / "nopad_model", nopad)
    write_problems(root / "problems.jsonl")
    with open(root / "traces.jsonl", "w") as f:
        for i in range(6):
            completion = f"<code>print({i}*7)</code><interpreter>{i * 7}\n</interpreter>\\boxed{{{i * 7}}}"
            f.write(json.dumps({"prompt": f"What is {i}*7?\n", "completion": completion}) + "\n")
    (root / "cli_rewards.py").write_text(REWARDS_MODULE)
    return root


def write_yaml(path: Path, **values) -> str:
    path.write_text(yaml.safe_dump(values))
    return str(path)


def train_config(work, tmp_path, **overrides) -> str:
    values = dict(
        model_name_or_path=str(work / "model"),
        dataset_name=str(work / "problems.jsonl"),
        prompt_column="question",
        answer_column="final",
        prompt_format="plain",
        system_prompt="none",
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1.0e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        sandbox_workers=1,
        seed=0,
    )
    values.update(overrides)
    return write_yaml(tmp_path / "train.yaml", **values)


def sft_config(work, tmp_path, **overrides) -> str:
    values = dict(
        model_name_or_path=str(work / "model"),
        dataset_name=str(work / "traces.jsonl"),
        output_dir=str(tmp_path / "sft"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1.0e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        max_length=128,
        gradient_checkpointing=False,
    )
    values.update(overrides)
    return write_yaml(tmp_path / "sft.yaml", **values)


def spy_on(monkeypatch, command, name):
    """Keeps the trainer that `command.<name>` builds (and a copy of its parameters before training)."""
    real, seen = getattr(command, name), {}

    def spy(argv):
        trainer = real(argv)
        seen["trainer"] = trainer
        seen["before"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer

    monkeypatch.setattr(command, name, spy)
    return seen


# ----------------------------------------------------------------------------------------------- happy paths
def test_usage_and_help(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--reward_funcs" in out and "--max_tool_calls" in out and "--lora_r" in out


def test_train_lora_two_steps(work, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(work)  # the dotted reward path is imported from the working directory, as in TRL
    seen = spy_on(monkeypatch, cli_train, "build_train")
    cfg = train_config(
        work, tmp_path, use_peft=True, lora_r=4, lora_alpha=8, reward_funcs=["cli_rewards.ramp", "boxed_accuracy"]
    )
    assert main(["train", "--config", cfg, "--learning_rate", "0.01"]) == 0
    trainer, before = seen["trainer"], seen["before"]
    assert trainer.args.learning_rate == 0.01  # the command line wins over the YAML
    after = dict(trainer.model.named_parameters())
    lora = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert lora and base
    assert any(not torch.equal(before[n], after[n].detach()) for n in lora), "adapter weights did not change"
    assert all(torch.equal(before[n], after[n].detach()) for n in base), "base weights changed"
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    logged = {k for entry in state["log_history"] for k in entry}
    assert {"rewards/ramp/mean", "rewards/boxed_accuracy/mean", "retool/code_ratio"} <= logged
    # The console (stderr is not a terminal here, as when output goes to a file): one compact line per logging step
    # in order, no log dicts; every log in OUTPUT_DIR/log.jsonl.
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0].split()[1] for line in lines] == ["1/2", "2/2"], captured.err
    assert all("| reward " in line and "| acc " in line and "| code " in line for line in lines), lines
    assert "'learning_rate'" not in captured.err + captured.out
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logs if "reward" in entry] == [1, 2]
    assert main(["plot", "--run", str(out)]) == 0
    assert (out / "training_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_sft_masks_prompt_and_interpreter(work, tmp_path, monkeypatch, capsys):
    seen = spy_on(monkeypatch, cli_sft, "build_sft")
    assert main(["sft", "--config", sft_config(work, tmp_path)]) == 0
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("| loss " in line for line in steps), steps
    trainer = seen["trainer"]
    tok = trainer.processing_class
    raw = [json.loads(line) for line in (work / "traces.jsonl").read_text().splitlines()]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(raw))])
    for ids, labels, attention, row in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], raw):
        ids, labels = ids[attention.bool()], labels[attention.bool()]
        trained = tok.decode(ids[labels != -100])
        assert trained == remove_spans(row["completion"], "<interpreter>", "</interpreter>") + tok.eos_token
        blocks = re.findall(r"<interpreter>.*?</interpreter>", row["completion"], re.DOTALL)
        assert tok.decode(ids[labels == -100]) == row["prompt"] + "".join(blocks)
    out = tmp_path / "sft"
    assert (out / "model.safetensors").is_file() and (out / "trainer_state.json").is_file()


def test_console_dicts_keeps_trls_log_dicts(work, tmp_path):
    """`console: dicts` is the explicit way back to transformers' own console (a log dict per logging step)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from retool_trl.reporting.console import CompactProgressCallback

    def console_callbacks(*extra):
        trainer = cli_train.build_train(["--config", train_config(work, tmp_path), *extra])
        kinds = {type(c) for c in trainer.callback_handler.callbacks}
        return kinds & {CompactProgressCallback, ProgressCallback, PrinterCallback}

    assert console_callbacks() == {CompactProgressCallback}
    assert console_callbacks("--console", "dicts") & {ProgressCallback, PrinterCallback}
    assert CompactProgressCallback not in console_callbacks("--console", "dicts")


def test_sft_on_retool_sft_messages(work, tmp_path):
    """The released ReTool-SFT layout: `messages` whose assistant text holds fenced code and interpreter output."""
    assistant = (
        "Let me compute.\n<code>\n```python\nprint(2*3)\n```\n</code>\n<interpreter>\n6\n</interpreter>\n"
        "So \\boxed{6}."
    )
    path = tmp_path / "retool_sft.jsonl"
    path.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "What is 2*3?"}, {"role": "assistant", "content": assistant}]}
        )
        + "\n"
    )
    cfg = sft_config(
        work,
        tmp_path,
        model_name_or_path=str(work / "chat_model"),
        dataset_name=str(path),
        system_prompt="retool_concise",
        max_length=1024,
    )
    trainer = cli_sft.build_sft(["--config", cfg])
    tok = trainer.processing_class
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    trained, masked = tok.decode(ids[labels != -100]), tok.decode(ids[labels == -100])
    assert "```python\nprint(2*3)\n```\n</code>" in trained and "So \\boxed{6}." in trained
    assert "<interpreter>" not in trained and "6\n</interpreter>" in masked
    assert masked.startswith("system: Use Python") and "user: What is 2*3?" in masked


def test_eval_writes_json_and_markdown(work, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(
        [
            "eval",
            "--model",
            str(work / "model"),
            "--dataset",
            str(work / "problems.jsonl"),
            *PROBLEMS_ARGS,
            "--num-samples",
            "2",
            "--max_samples",
            "3",
            "--batch_size",
            "4",
            "--max_completion_length",
            "12",
            "--sandbox_workers",
            "1",
            "--output_dir",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert (data["num_problems"], data["num_samples"], data["num_completions"]) == (3, 2, 6)
    assert [len(p["correct"]) for p in data["problems"]] == [2, 2, 2]
    assert [p["answer"] for p in data["problems"]] == ["0", "2", "4"]
    assert set(data["metrics"]) >= {"pass@1", "avg@2", "pass@2", "code_ratio", "calls_per_answer", "mean_length"}
    assert data["settings"]["max_completion_length"] == 12
    table = (out / "results.md").read_text()
    assert "avg@2" in table and "| 3 | 2 |" in table
    assert len((out / "results_samples.jsonl").read_text().splitlines()) == 6
    assert "| pass@1 |" in capsys.readouterr().out


def test_tokenizer_is_loaded_as_saved(work):
    """transformers 5 would load a Qwen2-config tokenizer as Qwen2Tokenizer, which drops this one's whitespace."""
    tok = load_tokenizer(str(work / "closed_model"))
    assert tok.decode(tok("a b\nc")["input_ids"]) == "a b\nc"
    assert tok.padding_side == "left"


def test_quickstart_is_delegated(monkeypatch, tmp_path, capsys):
    # A stand-in for the quickstart package (its real names load lazily, so deleting one would just reload it).
    import sys
    import types

    quickstart = types.ModuleType("retool_trl.quickstart")
    monkeypatch.setitem(sys.modules, "retool_trl.quickstart", quickstart)
    calls = []
    quickstart.main = lambda argv: calls.append(("main", argv)) or 0
    assert main(["quickstart", "--output-dir", str(tmp_path)]) == 0
    del quickstart.main
    quickstart.run_quickstart = lambda output_dir, **kw: calls.append(("run", output_dir))
    assert main(["quickstart", "--output-dir", str(tmp_path)]) == 0
    assert calls == [("main", ["--output-dir", str(tmp_path)]), ("run", str(tmp_path))]
    del quickstart.run_quickstart
    assert main(["quickstart"]) == 2
    assert "quickstart runner" in capsys.readouterr().err


def test_plot_checkpoint_fallback_and_errors(tmp_path, capsys):
    history = [
        {
            "step": s,
            "reward": -1 + s / 5,
            "reward_std": 0.1,
            "rewards/boxed_accuracy/mean": -1 + s / 5,
            "retool/code_ratio": s / 10,
            "completions/mean_length": 20 - s,
            "loss": 0.1,
        }
        for s in range(1, 6)
    ]
    history.append({"step": 5, "eval_reward": 0.2})
    ckpt = tmp_path / "run" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert main(["plot", "--run", str(tmp_path / "run"), "--output", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", "--run", str(tmp_path / "run"), "--metrics", "nonexistent"]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    assert main(["plot", "--run", str(tmp_path)]) == 2
    assert "no trainer_state.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if a command gets as far as loading the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input error was reported")

    import retool_trl.sft
    import retool_trl.trainer

    monkeypatch.setattr(retool_trl.trainer, "ReToolTrainer", refuse)
    monkeypatch.setattr(retool_trl.sft, "build_sft_trainer", refuse)
    monkeypatch.setattr(cli_eval, "load_eval_model", refuse)


def expect_error(capsys, argv, *fragments):
    assert main(argv) == 2
    # Progress bars of dataset loading may precede the error; the error itself is one line, and the last.
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("retool-trl")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert "Traceback" not in "\n".join(lines)
    err = errors[0]
    assert err.startswith(f"retool-trl {argv[0]}: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


TRAIN_CASES = {
    "unknown yaml key": ({"learnin_rate": 0.1}, [], ["unknown key 'learnin_rate'", "did you mean 'learning_rate'"]),
    "unknown cli argument": ({}, ["--max_stepz", "3"], ["unknown argument '--max_stepz'", "'--max_steps'"]),
    "yaml wrong type": ({"learning_rate": "abc"}, [], ["'learning_rate'", "must be a number, got 'abc'"]),
    "yaml float for int": ({"max_steps": 2.5}, [], ["'max_steps'", "must be an integer"]),
    "yaml list for scalar": ({"max_steps": [1, 2]}, [], ["'max_steps'", "takes a single value"]),
    "yaml yes/no": ({"report_to": False}, [], ["'report_to'", "quote the value"]),
    "yaml bad choice": (
        {"prompt_format": "chat"},
        [],
        ["'prompt_format'", "one of ['auto', 'conversational', 'plain']"],
    ),
    "cli wrong type": ({}, ["--max_steps", "x"], ["--max_steps", "invalid int value: 'x'"]),
    "config check": ({}, ["--max_tool_calls", "-1"], ["max_tool_calls must be >= 0"]),
    "bf16 on cpu": ({"bf16": True, "use_cpu": False}, [], ["bf16", "set `bf16: false`"]),
    "missing column": ({}, ["--answer_column", "nope"], ["no column 'nope'", "question, final", "answer_column"]),
    "no answer column": ({"answer_column": None}, [], ["no answer column", "set answer_column"]),
    "no pad token": ({"model_name_or_path": "{work}/nopad_model"}, [], ["has no pad token", "pad_token"]),
    "bad pad token": (
        {"model_name_or_path": "{work}/nopad_model"},
        ["--pad_token", "<nope>"],
        ["pad_token '<nope>' is not a token"],
    ),
    "tag not representable": (
        {"model_name_or_path": "{work}/closed_model"},
        ["--code_start", "<código>"],
        ["code_start '<código>' cannot be represented", "add_tokens"],
    ),
    "tag is special": ({}, ["--interpreter_end", "<|endoftext|>"], ["interpreter_end", "special token"]),
    "no chat template": ({}, ["--prompt_format", "conversational"], ["no chat template", "prompt_format: plain"]),
    "unknown reward": (
        {},
        ["--reward_funcs", "boxed_acc"],
        ["unknown reward function 'boxed_acc'", "did you mean 'boxed_accuracy'"],
    ),
    "reward import": ({}, ["--reward_funcs", "no_such_module.fn"], ["cannot import module 'no_such_module'"]),
    "reward column": ({}, ["--reward_funcs", "accuracy_reward"], ["needs a dataset column 'solution'"]),
    "missing model": (
        {"model_name_or_path": "./no/such/model"},
        [],
        ["model folder './no/such/model' does not exist"],
    ),
    "no dataset": ({"dataset_name": None}, [], ["no training data", "dataset_name"]),
    "resume without checkpoint": ({"resume_from_checkpoint": True}, [], ["has no checkpoint-* folder"]),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_train_input_errors(case, work, tmp_path, capsys, no_model_loading):
    yaml_values, extra, fragments = TRAIN_CASES[case]
    yaml_values = {k: v.format(work=work) if isinstance(v, str) else v for k, v in yaml_values.items()}
    cfg = train_config(work, tmp_path, **yaml_values)
    expect_error(capsys, ["train", "--config", cfg, *extra], *fragments)


def test_config_file_errors(tmp_path, capsys):
    expect_error(capsys, ["train", "--config", str(tmp_path / "missing.yaml")], "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1e-3\nmax_steps: 2\n")
    expect_error(capsys, ["train", "--config", str(bad)], "is not valid YAML at line")
    bad.write_text("- a\n- b\n")
    expect_error(capsys, ["sft", "--config", str(bad)], "must be a YAML mapping")


def test_tokenizer_that_drops_text(work, tmp_path, capsys, no_model_loading):
    broken = tmp_path / "broken"
    shutil.copytree(work / "closed_model", broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # its pre-tokenizer loses this vocabulary's whitespace
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = train_config(work, tmp_path, model_name_or_path=str(broken))
    expect_error(capsys, ["train", "--config", cfg], "does not give back the text it encodes")


def test_sft_and_eval_input_errors(work, tmp_path, capsys, no_model_loading):
    problems = str(work / "problems.jsonl")
    expect_error(
        capsys,
        ["sft", "--config", sft_config(work, tmp_path, dataset_name=problems)],
        "need a 'messages' column or 'prompt' and 'completion' columns",
    )
    expect_error(capsys, ["sft", "--config", sft_config(work, tmp_path, packing=True)], "packing")
    expect_error(
        capsys, ["sft", "--config", sft_config(work, tmp_path), "--prompt_column", "nope"], "no column 'nope'"
    )
    expect_error(capsys, ["eval", "--model", str(work / "model")], "required", "--dataset")
    expect_error(capsys, ["eval", "--model", "./no/model", "--dataset", problems], "does not exist")
    expect_error(
        capsys, ["eval", "--model", str(work / "model"), "--dataset", problems, "--num-samples", "0"], "num_samples"
    )
    expect_error(
        capsys,
        [
            "eval",
            "--model",
            str(work / "model"),
            "--dataset",
            problems,
            "--prompt_format",
            "plain",
            "--answer_column",
            "nope",
        ],
        "no column 'nope'",
    )


def test_no_traceback_in_a_real_process(work, tmp_path):
    cfg = train_config(work, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "retool_trl", "train", "--config", cfg, "--answer_column", "nope"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"retool-trl train: error: dataset '{work / 'problems.jsonl'}' has no column 'nope' (columns: question, "
        "final); set answer_column to one of them."
    ]
    script = shutil.which("retool-trl")
    if script:  # the console script of the installed package
        done = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.startswith("retool-trl ")
