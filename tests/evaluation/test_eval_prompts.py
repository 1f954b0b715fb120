"""Evaluation builds exactly the prompt ids training builds (TRL's `_tokenize_prompts` on a real `ReToolTrainer`).

The real condition: a Qwen3 model trained with `chat_template_kwargs: {enable_thinking: false}` must not be evaluated
in thinking mode, and a chat template given by file must reach evaluation as it reached training.
"""

import pytest

from helpers.testing_utils import make_char_tokenizer, trainer_for
from retool_trl.cli.eval import parse_eval_args
from retool_trl.data.prompt_ids import tokenize_prompts
from retool_trl.errors import UserError
from retool_trl.models.tokenizers import load_tokenizer
from retool_trl.testing import FakeSandbox

# A template that, like Qwen3's, renders differently with `enable_thinking` (default: thinking on).
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 6 * 7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
]
TEXTS = ["Q: What is 6 * 7?\nA:", "Q: 2 + 2?\nA:"]


def chat_tokenizer():
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.mark.parametrize(
    "prompts, overrides",
    [
        (CONVERSATIONS, {}),
        (CONVERSATIONS, {"chat_template_kwargs": {"enable_thinking": False}}),
        (CONVERSATIONS, {"chat_template_kwargs": {"enable_thinking": False}, "system_prompt": "Use code."}),
        (TEXTS, {}),
        (TEXTS, {"system_prompt": "Use code."}),
    ],
    ids=["chat", "chat-no-thinking", "chat-no-thinking-system", "plain", "plain-system"],
)
def test_eval_prompt_ids_equal_the_trainers(tmp_path, prompts, overrides):
    tokenizer = chat_tokenizer()
    trainer = trainer_for(tmp_path, ["\\boxed{1}"], FakeSandbox(), tokenizer=tokenizer, **overrides)
    trained_on, _, _ = trainer._tokenize_prompts(trainer._with_system_prompt(prompts))
    assert tokenize_prompts(tokenizer, prompts, trainer.args) == [list(ids) for ids in trained_on]
    if overrides.get("chat_template_kwargs"):
        assert all(tokenizer.decode(ids).endswith("<think></think>") for ids in trained_on)


def test_eval_accepts_the_training_prompt_options(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(THINKING_TEMPLATE)
    model_dir = tmp_path / "model"
    make_char_tokenizer().save_pretrained(model_dir)  # a tokenizer without a chat template
    eval_args, config = parse_eval_args(
        [
            "--model",
            str(model_dir),
            "--dataset",
            "synthetic",
            "--chat_template_kwargs",
            '{"enable_thinking": false}',
            "--chat_template_path",
            str(template),
        ]
    )
    assert config.chat_template_kwargs == {"enable_thinking": False}
    tokenizer = load_tokenizer(str(model_dir), chat_template_path=eval_args.chat_template_path)
    assert tokenizer.chat_template == THINKING_TEMPLATE
    ids = tokenize_prompts(tokenizer, CONVERSATIONS[:1], config)
    assert tokenizer.decode(ids[0]).endswith("<assistant><think></think>")


def test_a_chat_template_path_without_a_template_is_one_clear_error(tmp_path):
    model_dir = tmp_path / "model"
    make_char_tokenizer().save_pretrained(model_dir)
    with pytest.raises(UserError, match="chat_template_path .* gives no chat template"):
        load_tokenizer(str(model_dir), chat_template_path=str(model_dir))


def test_a_system_prompt_string_still_works_as_the_third_argument():
    tokenizer = chat_tokenizer()
    ids = tokenize_prompts(tokenizer, CONVERSATIONS[:1], "Use code.")
    assert tokenizer.decode(ids[0]).startswith("<system>Use code.\n<user>")
    assert tokenize_prompts(tokenizer, TEXTS, None) == [tokenizer(t)["input_ids"] for t in TEXTS]
