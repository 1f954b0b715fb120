"""Dataset adapters: per-dataset mappings on rows shaped like the hub datasets, local files, and clear errors."""

import json

import datasets
import pytest
from datasets import Dataset

from retool_trl.config import SYSTEM_PROMPTS
from retool_trl.data import (
    DataError,
    aime_example,
    build_prompt,
    dapo_math_example,
    find_known_dataset,
    gsm8k_example,
    load_math_dataset,
    math500_example,
)

# Rows shaped like the published datasets (column names and nesting as on the hub; contents shortened).
DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [
        {
            "role": "user",
            "content": "Solve the following math problem step by step. The last line of your response should be of "
            "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            "Find the sum of all "
            'integers $n$ with $n^2 < 10$.\n\nRemember to put your answer on its own line after "Answer:".',
        }
    ],
    "ability": "MATH",
    "reward_model": {"ground_truth": "0", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}
AIME24_H4_ROW = {
    "id": 60,
    "problem": "Find $x$.",
    "solution": "...",
    "answer": "204",
    "url": "https://...",
    "year": "2024",
}
AIME24_MAXWELL_ROW = {"ID": "2024-I-1", "Problem": "Find $y$.", "Solution": "...", "Answer": 33}
AIME25_ROW = {"question": "Find $z$.", "answer": "70", "year": 2025, "solution": "...", "id": 1, "url": "..."}
MATH500_ROW = {
    "problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.",
    "solution": "... $\\boxed{\\frac{5}{6}}$",
    "answer": "\\frac{5}{6}",
    "subject": "Algebra",
    "level": 1,
    "unique_id": "test/algebra/1.json",
}
GSM8K_ROW = {
    "question": "Tom has 3 boxes of 500 pens. How many pens?",
    "answer": "3 boxes * 500 = <<3*500=1500>>1500 pens.\n#### 1,500",
}


def test_dapo_math_strips_dapo_answer_instructions():
    question, answer = dapo_math_example(DAPO_ROW)
    assert question == "Find the sum of all integers $n$ with $n^2 < 10$."
    assert answer == "0"


@pytest.mark.parametrize(
    "row, expected",
    [
        (AIME24_H4_ROW, ("Find $x$.", "204")),
        (AIME24_MAXWELL_ROW, ("Find $y$.", "33")),
        (AIME25_ROW, ("Find $z$.", "70")),
    ],
)
def test_aime_layouts(row, expected):
    assert aime_example(row) == expected


def test_math500_and_gsm8k():
    assert math500_example(MATH500_ROW) == (MATH500_ROW["problem"], "\\frac{5}{6}")
    assert gsm8k_example(GSM8K_ROW) == (GSM8K_ROW["question"], "1500")


def test_known_dataset_lookup():
    assert find_known_dataset("dapo_math").hub_id == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert find_known_dataset("BytedTsinghua-SIA/DAPO-Math-17k").split == "train"
    assert find_known_dataset("AIME-2024").hub_id == "HuggingFaceH4/aime_2024"
    assert find_known_dataset("aime25").hub_id == "yentinglin/aime_2025"
    assert find_known_dataset("HuggingFaceH4/MATH-500").split == "test"
    assert find_known_dataset("gsm8k").config_name == "main"
    assert find_known_dataset("someone/else") is None


def test_build_prompt_formats():
    assert build_prompt("Q?", "plain") == "Q?"
    assert build_prompt("Q?", "plain", "Sys.") == "Sys.\n\nQ?"
    assert build_prompt("Q?") == [{"role": "user", "content": "Q?"}]
    assert build_prompt("Q?", "conversational", "Sys.") == [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Q?"},
    ]
    with pytest.raises(DataError, match="prompt_format"):
        build_prompt("Q?", "chat")


def test_default_system_prompt_is_retools(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": 2}) + "\n")
    row = load_math_dataset(str(path))[0]
    assert row["prompt"][0]["role"] == "system"
    system = row["prompt"][0]["content"]
    tags = dict(
        code_start="<code>", code_end="</code>", interpreter_start="<interpreter>", interpreter_end="</interpreter>"
    )
    assert system == SYSTEM_PROMPTS["retool"].format(**tags)
    assert "<code>" in system and "{" not in system.replace("\\boxed{answer}", "")
    assert row["prompt"][1] == {"role": "user", "content": "1+1?"}
    assert row["answer"] == "2"


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_local_files_with_configured_columns(tmp_path, suffix):
    rows = [{"q": f"What is {i}+1?", "gold": str(i + 1), "other": i} for i in range(4)]
    path = tmp_path / f"problems.{suffix}"
    Dataset.from_list(rows).to_json(path) if suffix == "jsonl" else getattr(Dataset.from_list(rows), f"to_{suffix}")(
        str(path)
    )
    ds = load_math_dataset(
        str(path), prompt_column="q", answer_column="gold", prompt_format="plain", system_prompt=None, max_samples=3
    )
    assert ds.column_names == ["prompt", "answer"]
    assert ds["prompt"] == ["What is 0+1?", "What is 1+1?", "What is 2+1?"]
    assert ds["answer"] == ["1", "2", "3"]


def test_local_verl_layout_keeps_conversations(tmp_path):
    path = tmp_path / "verl.parquet"
    Dataset.from_list([DAPO_ROW]).to_parquet(str(path))
    conv = load_math_dataset(str(path), system_prompt="Sys.")[0]
    assert conv["prompt"][0] == {"role": "system", "content": "Sys."}
    assert conv["prompt"][1]["content"].startswith("Solve the following")  # generic mapping keeps the text
    assert conv["answer"] == "0"
    plain = load_math_dataset(str(path), prompt_format="plain", system_prompt=None)[0]
    assert plain["prompt"].startswith("Solve the following")


def test_missing_columns_name_the_fix(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "1+1?", "label": "2"}) + "\n")
    with pytest.raises(DataError, match="no column 'nope'.*columns: text, label.*set answer_column"):
        load_math_dataset(str(path), prompt_column="text", answer_column="nope")
    with pytest.raises(DataError, match="no prompt column .*set prompt_column"):
        load_math_dataset(str(path))
    bad = tmp_path / "p.txt"
    bad.write_text("x")
    with pytest.raises(DataError, match=r"\.jsonl, \.json, \.parquet or \.csv"):
        load_math_dataset(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        load_math_dataset(str(tmp_path / "missing.jsonl"))


def test_known_hub_datasets_are_mapped(monkeypatch):
    """The hub path: `load_dataset` is faked with rows shaped like the real datasets (no network in tests)."""
    calls = []
    tables = {
        "BytedTsinghua-SIA/DAPO-Math-17k": [DAPO_ROW],
        "openai/gsm8k": [GSM8K_ROW],
        "HuggingFaceH4/MATH-500": [MATH500_ROW],
        "HuggingFaceH4/aime_2024": [AIME24_H4_ROW],
    }

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return Dataset.from_list(tables[path])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dapo = load_math_dataset("dapo_math", system_prompt="Sys.")
    assert dapo[0]["prompt"][1]["content"] == "Find the sum of all integers $n$ with $n^2 < 10$."
    assert load_math_dataset("gsm8k", prompt_format="plain", system_prompt=None)[0] == {
        "prompt": GSM8K_ROW["question"],
        "answer": "1500",
    }
    assert load_math_dataset("math500")[0]["answer"] == "\\frac{5}{6}"
    assert load_math_dataset("aime_2024", split="train")[0]["answer"] == "204"
    assert calls == [
        ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
        ("openai/gsm8k", "main", "test"),
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("HuggingFaceH4/aime_2024", None, "train"),
    ]
    # A known dataset whose columns changed: named, with the fix.
    tables["openai/gsm8k"] = [{"problem": "x", "solution": "y"}]
    with pytest.raises(DataError, match="lacks columns.*prompt_column and answer_column"):
        load_math_dataset("gsm8k")


def test_synthetic_task():
    ds = load_math_dataset("synthetic", prompt_format="plain", system_prompt=None, max_samples=5, config_name="1")
    assert len(ds) == 5 and ds[0]["prompt"].startswith("What is ") and ds[0]["answer"].lstrip("-").isdigit()
