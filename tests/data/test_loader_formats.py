"""Loading and format detection on every real SFT / messy / text file, plus crafted errors."""
from __future__ import annotations

import json

import pytest

from app.data.errors import DatasetError
from app.data.formats import detect_format, normalize_row
from app.data.loader import iter_records, txt_split_mode

from datalayer_paths import EXPECTED_ROWS, SHARED


def _load(path, fmt=None):
    recs = list(iter_records(path))
    fmt = fmt or detect_format([r.data for r in recs[:100] if r.data is not None])
    ok, bad, warns = [], [], []
    for r in recs:
        if r.error:
            bad.append(r.error)
            continue
        try:
            ex, w = normalize_row(r.data, fmt, r.row)
            ok.append(ex)
            warns += w
        except DatasetError as e:
            bad.append(e)
    return fmt, recs, ok, bad, warns


@pytest.mark.parametrize("rel,fmt,rows,valid", [e for e in EXPECTED_ROWS if e[0].startswith("sft/")])
def test_sft_files(rel, fmt, rows, valid):
    got_fmt, recs, ok, bad, _ = _load(SHARED / rel)
    assert got_fmt == fmt
    assert len(recs) == rows and len(ok) == valid and len(bad) == rows - valid
    for ex in ok:
        roles = [m["role"] for m in ex["messages"]]
        assert roles[-1] == "assistant" and roles[0] in ("system", "user")


def test_alpaca_input_joined():
    _, _, ok, _, _ = _load(SHARED / "sft" / "alpaca_en_demo.json")
    data = json.loads((SHARED / "sft" / "alpaca_en_demo.json").read_text())
    with_input = [i for i, d in enumerate(data) if d["input"]]
    assert len(with_input) == 412
    i = with_input[0]
    assert ok[i]["messages"][0]["content"] == data[i]["instruction"].strip() + "\n\n" + data[i]["input"].strip()
    assert ok[i]["messages"][1]["content"] == data[i]["output"]


def test_single_object_conversation_is_one_row():
    _, recs, ok, _, _ = _load(SHARED / "sft" / "oasst_conversation_sharegpt.json")
    assert len(ok[0]["messages"]) == 12


def test_oasst_trees_flatten_like_the_derived_file():
    _, recs, ok, bad, _ = _load(SHARED / "sft" / "oasst1_en_100_trees.jsonl")
    derived = [json.loads(line)["messages"]
               for line in (SHARED / "sft" / "oasst1_en_100_messages.jsonl").read_text().splitlines()]
    assert [ex["messages"] for ex in ok] == derived
    assert all(e.field == "prompt.synthetic" for e in bad)


def test_glaive_roles_and_tools():
    _, recs, ok, _, _ = _load(SHARED / "sft" / "glaive_toolcall_en_demo_sharegpt.json")
    ex = ok[0]
    assert [m["role"] for m in ex["messages"]][:4] == ["user", "assistant", "user", "assistant"]
    assert ex["tools"][0]["type"] == "function" and ex["tools"][0]["function"]["name"] == "search_recipes"
    calls = [ex for ex in ok if any(m["role"] == "tool" for m in ex["messages"])]
    assert len(calls) > 100
    msgs = calls[0]["messages"]
    k = next(i for i, m in enumerate(msgs) if m["role"] == "tool")
    assert msgs[k - 1]["role"] == "assistant" and json.loads(msgs[k - 1]["content"])["name"]


def test_messy_empty_assistant_turn():
    _, _, ok, bad, _ = _load(SHARED / "messy" / "sharegpt_empty_assistant_turn.json")
    assert ok == [] and len(bad) == 1
    assert (bad[0].row, bad[0].field) == (1, "conversations[1].value")
    assert str(bad[0]) == "row 1, field 'conversations[1].value': empty assistant turn"


def test_messy_latin1_csv():
    with pytest.raises(DatasetError) as info:
        list(iter_records(SHARED / "messy" / "sms_spam_kaggle_latin1.csv"))
    err = info.value
    assert err.row == 6 and "byte offset 606" in str(err) and "line 7" in str(err)
    assert "re-save it as UTF-8" in str(err)


def test_messy_dolly_pretemplated():
    fmt, recs, ok, bad, warns = _load(SHARED / "messy" / "dolly_pretemplated_eos_marker.jsonl")
    assert fmt == "prompt_completion" and len(ok) == 151 and not bad
    assert not any("###eos_token###" in ex["completion"] for ex in ok)
    assert sum("###eos_token###" in w.message for w in warns) == 151
    assert sum(w.field == "prompt" and "### Instruction:" in w.message for w in warns) == 151


@pytest.mark.parametrize("name,mode,rows", [
    ("wiki_demo.txt", "line", 30),
    ("tinystories_sample_endoftext.txt", "endoftext", 5),
    ("tinystories_train_head.txt", "paragraph", None),
])
def test_txt_split(name, mode, rows):
    path = SHARED / "pretrain_text" / name
    assert txt_split_mode(path) == mode
    recs = list(iter_records(path))
    if rows is not None:
        assert len(recs) == rows
    assert all(r.data["text"] == r.data["text"].strip() and r.data["text"] for r in recs)
    if name == "wiki_demo.txt":
        assert max(len(r.data["text"]) for r in recs) == 109_672
    if name == "tinystories_train_head.txt":
        assert recs[0].data["text"].startswith("One day, a little girl named Lily found a needle")
        assert all("\n\n" not in r.data["text"] for r in recs)


def test_c4_text_column():
    fmt, recs, ok, bad, _ = _load(SHARED / "pretrain_text" / "c4_demo.jsonl")
    assert fmt == "text" and len(ok) == 300 and not bad


def test_bad_jsonl_line_is_a_row_error(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "b"\n{"text": "c"}\n')
    recs = list(iter_records(p))
    assert [r.row for r in recs] == [1, 2, 3]
    assert recs[1].error.row == 2 and "invalid JSON on line 3" in recs[1].error.message


def test_broken_json_document(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[{"text": "a"},\n {"text": "b"')
    with pytest.raises(DatasetError, match="invalid JSON at line 2"):
        list(iter_records(p))


def test_json_file_holding_jsonl_and_row_lists(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert [r.data["text"] for r in iter_records(p)] == ["a", "b"]
    p.write_text(json.dumps({"data": [{"text": "x"}, {"text": "y"}]}))
    assert [r.data["text"] for r in iter_records(p)] == ["x", "y"]


def test_csv_ragged_and_multiline(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text('instruction,input,output\r\n"multi\nline",,ok\r\nq,,a,extra\r\nq2,,a2\r\n', newline="")
    recs = list(iter_records(p))
    assert recs[0].data == {"instruction": "multi\nline", "input": "", "output": "ok"}
    assert recs[1].error.row == 2 and "line 4 has 4 fields but the header has 3" in recs[1].error.message
    assert recs[2].data["output"] == "a2" and recs[2].line == 5


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    fmt, recs, ok, bad, _ = _load(tmp_path / "d.parquet")
    assert fmt == "messages" and len(ok) == 3
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="Parquet"):
        list(iter_records(tmp_path / "bad.parquet"))
    # a Parquet file (or a zip / gzip) under a text extension says what it really is
    (tmp_path / "renamed.jsonl").write_bytes((tmp_path / "d.parquet").read_bytes())
    with pytest.raises(DatasetError, match=r"this is a Parquet file .* rename it to \.parquet"):
        list(iter_records(tmp_path / "renamed.jsonl"))
    (tmp_path / "z.csv").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(DatasetError, match="a zip archive"):
        list(iter_records(tmp_path / "z.csv"))


@pytest.mark.parametrize("row,fmt,field,msg", [
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "messages[0].role", "wrong role order"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
     "messages", "messages[1].content", "is a int, expected a string"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages", "messages[0].content", "ends with a user turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]},
     "messages", "messages[1].role", "unknown role"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]},
     "sharegpt", "conversations[1].role", "wrong role order"),
    ({"instruction": "q", "input": "", "output": ""}, "alpaca", "output", "empty output"),
    ({"instruction": "", "input": "", "output": "a"}, "alpaca", "instruction", "empty instruction"),
    ({"text": "   "}, "text", "text", "empty text"),
    ({"prompt": "p"}, "prompt_completion", "completion", "missing completion"),
])
def test_row_validation(row, fmt, field, msg):
    with pytest.raises(DatasetError) as info:
        normalize_row(row, fmt, 7)
    assert info.value.row == 7 and info.value.field == field and msg in info.value.message


def test_unknown_columns_and_preference():
    with pytest.raises(DatasetError, match="could not detect the dataset format from the columns 'v1'"):
        detect_format([{"v1": "ham", "v2": "text"}])
    recs = list(iter_records(SHARED / "preference" / "dpo_en_demo_sharegpt.json"))
    with pytest.raises(DatasetError, match="preference data"):
        detect_format([r.data for r in recs[:10]])


def test_kto_data_is_named_not_trained_on():
    """LLaMA-Factory's KTO demo (messages + a boolean label, half of them false) is refused with
    what it is, by detection and by the whole-file report the upload runs."""
    from app.studio.reports import inspect_file

    path = SHARED / "preference" / "kto_en_demo_messages.json"
    recs = list(iter_records(path))
    assert sum(r.data["label"] is False for r in recs) > 0  # undesirable answers are in it
    with pytest.raises(DatasetError, match="this is KTO data") as info:
        detect_format([r.data for r in recs[:50]])
    assert "'label'" in info.value.message and "undesirable" in info.value.message
    with pytest.raises(DatasetError, match="KTO data"):
        inspect_file(str(path), tokenizer_dir=None, chat_template=None, max_seq_length=512)
    # a boolean-free label (a classifier's CSV column) is not KTO
    assert detect_format([{"text": "ham", "label": "spam"}]) == "text"
