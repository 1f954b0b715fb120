import pytest
import torch
from datasets import Dataset
from trl import SFTConfig

from retool_trl.data.synthetic import make_sft_traces
from retool_trl.format.parsing import Tags
from retool_trl.quickstart import build_char_tokenizer, build_tiny_model
from retool_trl.sft import build_sft_dataset, build_sft_trainer, split_environment_spans, tokenize_trace

PROMPT = "What is 843*13?\n"
COMPLETION = (
    "Let me compute.<code>x = 843*13\nprint(x)</code><interpreter>10959\n</interpreter>"
    "Check:<code>print(x % 7)</code>\n<interpreter>4\n</interpreter> so \\boxed{10959}"
)
MODEL_TEXT = "Let me compute.<code>x = 843*13\nprint(x)</code>Check:<code>print(x % 7)</code> so \\boxed{10959}"
ENV_TEXT = "<interpreter>10959\n</interpreter>\n<interpreter>4\n</interpreter>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def _sft_config(tmp_path, **kwargs):
    return SFTConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        max_length=None,
        **kwargs,
    )


def test_split_environment_spans():
    spans = split_environment_spans(COMPLETION)
    assert "".join(text for text, _ in spans) == COMPLETION
    assert "".join(text for text, trained in spans if trained) == MODEL_TEXT
    # The newline between `</code>` and `<interpreter>` is never generated at RL time, so it goes with the block.
    assert "".join(text for text, trained in spans if not trained) == ENV_TEXT
    assert split_environment_spans("no code \\boxed{1}") == [("no code \\boxed{1}", True)]
    assert split_environment_spans("<code>1/0</code><interpreter>ZeroDivisionError") == [
        ("<code>1/0</code>", True),
        ("<interpreter>ZeroDivisionError", False),  # truncated trace: the open block runs to the end
    ]
    custom = Tags("<py>", "</py>", "<out>", "</out>")
    assert split_environment_spans("<py>print(1)</py><out>1\n</out>ok", custom) == [
        ("<py>print(1)</py>", True),
        ("<out>1\n</out>", False),
        ("ok", True),
    ]


def test_tokenize_trace_masks_prompt_and_interpreter(tokenizer):
    out = tokenize_trace(tokenizer, PROMPT, COMPLETION)
    ids, mask = out["input_ids"], out["completion_mask"]
    assert len(ids) == len(mask)
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert ids[:n_prompt] == tokenizer(PROMPT)["input_ids"] and mask[:n_prompt] == [0] * n_prompt
    trained = [t for t, m in zip(ids, mask) if m]
    untrained = [t for t, m in zip(ids[n_prompt:], mask[n_prompt:]) if not m]
    assert tokenizer.decode(trained) == MODEL_TEXT + tokenizer.eos_token
    assert trained[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(untrained) == ENV_TEXT
    # Tags are single tokens: the interpreter tags themselves carry mask 0, code tags mask 1.
    for tag, expected in [("<interpreter>", 0), ("</interpreter>", 0), ("<code>", 1), ("</code>", 1)]:
        tag_id = tokenizer.convert_tokens_to_ids(tag)
        assert {m for t, m in zip(ids, mask) if t == tag_id} == {expected}


def test_tokenize_trace_with_bpe_merging_across_tags():
    from helpers.testing_utils import make_bpe_tokenizer

    bpe = make_bpe_tokenizer()  # has tokens such as `)</code>` and `</code>\n`: tags are not token boundaries
    out = tokenize_trace(bpe, PROMPT, COMPLETION)
    ids, mask = out["input_ids"], out["completion_mask"]
    n_prompt = len(bpe(PROMPT)["input_ids"])
    assert not any(mask[:n_prompt])
    # Span-wise tokenization keeps every token on one side of a boundary, so the mask is exact.
    assert bpe.decode([t for t, m in zip(ids, mask) if m]) == MODEL_TEXT + bpe.eos_token
    assert bpe.decode([t for t, m in zip(ids[n_prompt:], mask[n_prompt:]) if not m]) == ENV_TEXT


def test_tokenize_trace_without_eos(tokenizer):
    out = tokenize_trace(tokenizer, PROMPT, "\\boxed{1}", add_eos=False)
    assert tokenizer.decode(out["input_ids"]) == PROMPT + "\\boxed{1}"


def test_messages_format_uses_chat_template(chat_tokenizer):
    messages = [
        {"role": "system", "content": "Use Python."},
        {"role": "user", "content": "What is 843*13?"},
        {"role": "assistant", "content": COMPLETION},
    ]
    dataset = build_sft_dataset(Dataset.from_dict({"messages": [messages]}), chat_tokenizer)
    assert dataset.column_names == ["input_ids", "completion_mask"]
    ids, mask = dataset[0]["input_ids"], dataset[0]["completion_mask"]
    prompt_ids = chat_tokenizer.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    trained = [t for t, m in zip(ids, mask) if m]
    # The chat template's end of turn is trained (that is how the model learns to stop).
    assert chat_tokenizer.decode(trained) == MODEL_TEXT + "<|im_end|>\n"
    assert chat_tokenizer.decode(ids) == chat_tokenizer.apply_chat_template(messages, tokenize=False)


def test_messages_need_a_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    dataset = Dataset.from_dict({"messages": [messages]})
    with pytest.raises(ValueError, match="chat template"):
        build_sft_dataset(dataset, tokenizer)


def test_bad_columns(tokenizer):
    with pytest.raises(ValueError, match="messages"):
        build_sft_dataset(Dataset.from_dict({"text": ["hello"]}), tokenizer)


def test_sft_trainer_labels_and_gradients_skip_prompt_and_interpreter(tokenizer, tmp_path):
    traces = make_sft_traces(16, seed=0, code_fraction=0.5)
    raw = Dataset.from_dict(
        {"prompt": list(traces["prompt"]) + [PROMPT], "completion": list(traces["completion"]) + [COMPLETION]}
    )
    expected = build_sft_dataset(raw, tokenizer)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    config = _sft_config(tmp_path)
    trainer = build_sft_trainer(model, tokenizer, raw, config)
    assert config.completion_only_loss is None  # the caller's config is not modified
    assert trainer.args.completion_only_loss is True

    # What TRL will train on: labels are -100 exactly where completion_mask is 0.
    prepared = {tuple(row["input_ids"]): row["labels"] for row in trainer.train_dataset}
    for row in expected:
        labels = prepared[tuple(row["input_ids"])]
        assert [label != -100 for label in labels] == [bool(m) for m in row["completion_mask"]]

    # And through the loss: logits at masked positions get exactly zero gradient, model positions do not.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = outputs.logits
    logits.retain_grad()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
    )
    loss.backward()
    grad_norm = logits.grad[:, :-1].abs().sum(-1)
    trained = batch["labels"][:, 1:] != -100
    assert torch.all(grad_norm[~trained] == 0)
    assert torch.all(grad_norm[trained] > 0)

    trainer.train()  # one real step through TRL
    assert trainer.state.global_step == 1


def test_pretokenized_dataset_is_used_as_is(tokenizer, tmp_path):
    tokenized = Dataset.from_list([tokenize_trace(tokenizer, PROMPT, COMPLETION)])
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    trainer = build_sft_trainer(model, tokenizer, tokenized, _sft_config(tmp_path))
    labels = trainer.train_dataset[0]["labels"]
    assert [label != -100 for label in labels] == [bool(m) for m in tokenized[0]["completion_mask"]]


def test_completion_only_loss_false_is_rejected(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    raw = Dataset.from_dict({"prompt": [PROMPT], "completion": [COMPLETION]})
    with pytest.raises(ValueError, match="completion_only_loss"):
        build_sft_trainer(model, tokenizer, raw, _sft_config(tmp_path, completion_only_loss=False))
