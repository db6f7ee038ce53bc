"""Prompt sources (real AIME parquet in the DAPO schema, JSONL, local HF datasets), bad rows,
overlong prompts, the validation split, and the arithmetic task."""

from __future__ import annotations

import json

import datasets
import pytest

from dapo_lightning.data import (
    FieldMap,
    PromptDataError,
    deduplicate,
    load_prompt_records,
    records_from_rows,
    split_train_val,
    tokenize_records,
)
from dapo_lightning.tasks.arithmetic import make_arithmetic_rows
from dapo_lightning.testing import make_tiny_tokenizer

AIME = "/work/shared/data/aime-2024.parquet"
TOK = make_tiny_tokenizer()


def test_aime_parquet_dapo_schema_dedup():
    records = load_prompt_records(AIME, dedup=False)
    assert len(records) == 960
    records = load_prompt_records(AIME)
    assert len(records) == 30
    r = records[0]
    assert isinstance(r.prompt, list) and r.prompt[0]["role"] == "user"
    assert "Answer:" in r.prompt[0]["content"]
    assert r.answer.isdigit() and r.data_source == "math_dapo"
    assert len({x.uid for x in records}) == 30
    kept, _ = tokenize_records(records[:2], TOK, max_prompt_length=4096)
    text = TOK.decode(kept[0].prompt_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_jsonl_with_field_mapping(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"question": "1+1=", "meta": {"sol": 2}, "id": "a"},
        {"question": "2+2=", "meta": {"sol": "4"}, "id": "b"},
        {"question": "1+1=", "meta": {"sol": 2}, "id": "a"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fields = FieldMap(prompt_key="question", answer_key="meta.sol", uid_key="id")
    records = load_prompt_records(path, fields)
    assert [(r.uid, r.prompt, r.answer) for r in records] == [
        ("a", "1+1=", "2"),
        ("b", "2+2=", "4"),
    ]
    kept, _ = tokenize_records(records, TOK, apply_chat_template=False)
    assert TOK.decode(kept[0].prompt_ids) == "1+1="
    kept, _ = tokenize_records(records, TOK, apply_chat_template=True)
    assert (
        TOK.decode(kept[0].prompt_ids)
        == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_dataset_on_disk(tmp_path):
    ds = datasets.Dataset.from_list(
        [{"problem": "What is 3*3?", "answer": 9.0}, {"problem": "What is 1/2?", "answer": 0.5}]
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    records = load_prompt_records(tmp_path / "ds", FieldMap("problem", "answer"))
    assert [r.answer for r in records] == ["9", "0.5"]
    assert records[0].data_source is None


@pytest.mark.parametrize(
    "row,match",
    [
        ({"prompt": "", "answer": "1"}, r"row 2: field 'prompt' is an empty prompt"),
        ({"answer": "1"}, r"row 2: missing field 'prompt'.*set prompts.prompt_key"),
        ({"prompt": "x", "answer": [1]}, r"row 2: field 'answer' must be a string or a number"),
        ({"prompt": "x", "answer": True}, r"row 2: field 'answer' is a bool"),
        ({"prompt": "x", "answer": None}, r"row 2: field 'answer' is null"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, r"row 2: field 'prompt' message 0"),
    ],
)
def test_bad_rows_name_row_field_and_fix(row, match):
    rows = [{"prompt": "ok", "answer": "1"}, row]
    with pytest.raises(PromptDataError, match=match):
        records_from_rows(rows, FieldMap("prompt", "answer"))


def test_missing_nested_field_and_file():
    with pytest.raises(PromptDataError, match="missing field 'reward_model.ground_truth'"):
        records_from_rows([{"prompt": "x", "reward_model": {}}])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_records("/nonexistent/prompts.jsonl")


def test_overlong_prompts_error_or_drop():
    records = records_from_rows(
        [{"prompt": "short", "answer": "1"}, {"prompt": "x" * 100, "answer": "2"}],
        FieldMap("prompt", "answer"),
    )
    with pytest.raises(
        PromptDataError, match="max_prompt_length=50.*prompts.overlong_prompts: drop"
    ):
        tokenize_records(records, TOK, apply_chat_template=False, max_prompt_length=50)
    kept, dropped = tokenize_records(
        records, TOK, apply_chat_template=False, max_prompt_length=50, overlong_prompts="drop"
    )
    assert dropped == 1 and [r.answer for r in kept] == ["1"]


def test_messages_need_chat_template():
    records = records_from_rows(
        [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}],
        FieldMap("prompt", "answer"),
    )
    with pytest.raises(PromptDataError, match="prompts.apply_chat_template is false: set it true"):
        tokenize_records(records, TOK, apply_chat_template=False)


def test_split_train_val_is_seeded_and_disjoint():
    records = records_from_rows(
        make_arithmetic_rows(50, level=1), FieldMap("prompt", "answer", "uid")
    )
    tr, va = split_train_val(records, 0.2, seed=3)
    assert len(va) == 10 and len(tr) == 40
    assert not {r.uid for r in tr} & {r.uid for r in va}
    assert [r.uid for r in split_train_val(records, 0.2, seed=3)[1]] == [r.uid for r in va]
    assert deduplicate(records + records)[1] == 50


def test_arithmetic_task():
    a = make_arithmetic_rows(30, level=1, seed=5)
    assert a == make_arithmetic_rows(30, level=1, seed=5)
    assert a != make_arithmetic_rows(30, level=1, seed=6)
    assert len({r["prompt"] for r in a}) == 30
    for r in a:
        x, y = r["prompt"].rstrip("=").split("+")
        assert int(x) + int(y) == int(r["answer"]) and r["difficulty"] == 1
        assert r["prompt"].isascii()
    assert any(len(r["answer"]) > 1 for r in a)  # multi-token answers exist
    two = make_arithmetic_rows(20, level=2)
    assert all(10 <= int(r["prompt"].split("+")[0]) <= 99 for r in two)
    mul = make_arithmetic_rows(10, level=3)
    assert all("*" in r["prompt"] for r in mul)
    custom = make_arithmetic_rows(5, level=1, operand_range=(100, 105), ops=["-"])
    assert all(r["prompt"].startswith("10") and "-" in r["prompt"] for r in custom)
    with pytest.raises(ValueError, match="level"):
        make_arithmetic_rows(5, level=99)


# ------------------------------------------------------------------- encodings, NaN, paths


def test_non_utf8_file_names_the_file_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = b'{"prompt": "1+1=", "answer": "2"}\n'
    path.write_bytes(good + '{"prompt": "caf\u00e9 2+2=", "answer": "4"}\n'.encode("latin-1"))
    offset = len(good) + len(b'{"prompt": "caf')
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(path, FieldMap("prompt", "answer"))
    msg = str(err.value)
    assert str(path) in msg and f"byte {offset} (line 2)" in msg and "b'\\xe9'" in msg
    assert "Save the file as UTF-8" in msg


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_is_accepted(tmp_path, suffix):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    records = load_prompt_records(path, FieldMap("prompt", "answer"))
    assert [(r.prompt, r.answer) for r in records] == [("1+1=", "2"), ("2+2=", "4")]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_answer_names_row_and_key(value):
    rows = [{"q": "1+1=", "gt": {"a": 2}}, {"q": "2+2=", "gt": {"a": value}}]
    with pytest.raises(PromptDataError, match=r"row 2: field 'gt\.a' is (nan|inf) .*fill in"):
        records_from_rows(rows, FieldMap("q", "gt.a"))


def test_nan_answer_from_a_parquet_file(tmp_path):
    """pandas writes a missing answer of a numeric column as NaN; it must not train on 'nan'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": [2.0, float("nan")]}), path)
    with pytest.raises(PromptDataError, match=r"p\.parquet row 2: field 'answer' is nan"):
        load_prompt_records(path, FieldMap("prompt", "answer"))


@pytest.mark.parametrize(
    "source", ["data/train.jsonl", "data/train", "prompts.jsonl", "a/b/c", "~/nope/x.parquet"]
)
def test_missing_path_is_no_such_file_never_a_hub_lookup(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()

    def no_hub(*args, **kwargs):  # pragma: no cover - must never run
        raise AssertionError(f"hub lookup for {args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(FileNotFoundError, match=r"no such file: prompt file .*check the path"):
        load_prompt_records(source)


def test_hub_name_still_goes_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_hub(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    records = load_prompt_records(
        ["BytedTsinghua-SIA/DAPO-Math-17k", "org/name.v2:test"], FieldMap("prompt", "answer")
    )
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "train"), ("org/name.v2", "test")]
    assert len(records) == 1  # the same prompt twice, de-duplicated


def _jsonl_with_row_4(tmp_path, row4: str):
    rows = [json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) for i in range(5)]
    rows[3] = row4
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("row4", "field", "char"),
    [
        ('{"prompt": "3 + 1 = \\ud83d", "answer": "4"}', "'prompt'", "'\\ud83d' at character 8"),
        ('{"prompt": "3 + 1 =", "answer": "4\\udc00"}', "'answer'", "'\\udc00' at character 1"),
        (
            '{"prompt": [{"role": "user", "content": "\\ud800 3 + 1"}], "answer": "4"}',
            "'prompt message 0'",
            "'\\ud800' at character 0",
        ),
        ('{"prompt": "3 + 1 =", "answer": "4", "id": "a\\ud800"}', "'id'", "at character 1"),
    ],
    ids=["prompt", "answer", "chat message", "uid"],
)
def test_lone_surrogate_names_the_file_row_and_field(tmp_path, row4, field, char):
    """A JSON escape of half a UTF-16 pair is read as a lone surrogate: one PromptDataError
    naming the file, the row and the field (it was a UnicodeEncodeError in prompt_uid)."""
    path = _jsonl_with_row_4(tmp_path, row4)
    fields = FieldMap(
        prompt_key="prompt", answer_key="answer", uid_key="id" if "id" in row4 else None
    )
    if fields.uid_key:  # every row needs the uid field then
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for i, row in enumerate(rows):
            row.setdefault("id", f"u{i}")
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(str(path), fields)
    message = str(err.value)
    assert message.startswith(f"{path} row 4: field {field} holds the lone surrogate"), message
    assert char in message and "fix the escape or remove the row" in message


def test_a_surrogate_pair_escape_is_text(tmp_path):
    """The escape pair of one emoji is the emoji: accepted, and hashed into a uid."""
    path = _jsonl_with_row_4(tmp_path, '{"prompt": "3 + 1 = \\ud83d\\ude00", "answer": "4"}')
    records = load_prompt_records(str(path), FieldMap(prompt_key="prompt", answer_key="answer"))
    assert records[3].prompt == "3 + 1 = \U0001f600" and len(records[3].uid) == 16


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        (
            (2, 64, 1, 16),
            r"^data\.dynamic_sampling\.gen_batch_size=64 is more than the 16 training prompts "
            r"\(16 per rank\): .* Fix: set data\.dynamic_sampling\.gen_batch_size to at most 16",
        ),
        (
            (32, None, 1, 16),
            r"^data\.dynamic_sampling\.train_batch_size=32 \(gen_batch_size is null: the prompts "
            r"per round\) is more than the 16 training prompts",
        ),
        (
            (4, 18, 2, 17),
            r"gen_batch_size=18 is more than the 17 training prompts \(8 per rank\).* at most 16",
        ),
        (
            (6, None, 4, 100),
            r"^data\.dynamic_sampling\.train_batch_size=6 is global .* use e\.g\. 4",
        ),
        ((4, 10, 4, 100), r"^data\.dynamic_sampling\.gen_batch_size=10 is global .* use e\.g\. 8"),
    ],
)
def test_batch_split_errors_name_the_field_and_the_fix(sizes, match):
    from dapo_lightning.checks import ConfigError
    from dapo_lightning.data.prompts.config import check_batch_split

    with pytest.raises(ConfigError, match=match):
        check_batch_split(*sizes)
    check_batch_split(2, 16, 1, 16)  # a round of every prompt once is fine
    check_batch_split(4, 16, 2, 17)
