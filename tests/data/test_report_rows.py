"""Issue 19: rows with no trained token listed with the reason (item 9), repeated warnings
grouped (Low), and a column mapping for files with other column names (item 13)."""
from __future__ import annotations

import json

import pytest
from datalayer_paths import SHARED

from app.data.errors import DatasetError
from app.data.formats import check_column_mapping
from app.data.report import inspect_dataset, iter_encoded

DOLLY = SHARED / "messy" / "dolly_pretemplated_eos_marker.jsonl"
GSM8K = SHARED / "grpo" / "gsm8k" / "train.jsonl"


def test_untrained_rows_listed_with_reason_and_dropped_the_same(bundle):
    rep = inspect_dataset(DOLLY, bundle, "chatml", max_seq_length=512, max_issues=500)
    assert rep.no_trained_tokens > 0 and len(rep.untrained) == rep.no_trained_tokens
    first = rep.untrained[0]
    assert first.row > 0 and "past max_seq_length (512 tokens" in first.message
    dropped = []
    kept = [row for row, _ in iter_encoded(DOLLY, bundle, "chatml", 512, True, dropped=dropped)]
    assert [d.row for d in dropped] == [u.row for u in rep.untrained]
    assert not set(kept) & {d.row for d in dropped}
    assert len(kept) == rep.valid_rows - rep.no_trained_tokens


def test_repeated_warnings_grouped_with_exact_counts(bundle):
    rep = inspect_dataset(DOLLY, bundle, "chatml", max_seq_length=512, max_issues=20)
    assert rep.warning_count == 302
    counts = {(g.field, g.message[:20]): g.count for g in rep.warning_groups}
    assert sum(counts.values()) == 302 and len(rep.warning_groups) == 2
    eos = next(g for g in rep.warning_groups if "eos_token" in g.message)
    assert eos.count == 151 and eos.field == "answer" and len(eos.rows) == 20
    assert eos.rows == sorted(eos.rows) and eos.rows[0] >= 1


def test_column_mapping_reads_gsm8k_as_alpaca(bundle, tmp_path):
    with pytest.raises(DatasetError, match="map the columns"):
        inspect_dataset(GSM8K, bundle, "chatml")
    mapping = {"instruction": "question", "output": "answer"}
    rep = inspect_dataset(GSM8K, bundle, "chatml", max_seq_length=512, preview_rows=1,
                          column_mapping=mapping)
    first = json.loads(GSM8K.read_text().splitlines()[0])
    assert rep.format == "alpaca" and rep.valid_rows == rep.total_rows == 7473
    text = "".join(t for t, _ in rep.preview[0].segments)
    trained = "".join(t for t, f in rep.preview[0].segments if f)
    assert first["question"] in text and trained.startswith(first["answer"])
    # training reads the same rows the same way
    row, enc = next(iter(iter_encoded(GSM8K, bundle, "chatml", 512, True, column_mapping=mapping)))
    assert row == 1 and "".join(enc_text for enc_text, _ in rep.preview[0].segments) == text
    # a CSV with a numeric-looking label: errors name the file's own column
    csv = tmp_path / "spam.csv"
    csv.write_text("text,label\nWin a prize now,spam\nSee you at 5,\n")
    rep = inspect_dataset(csv, bundle, "chatml", column_mapping={"instruction": "text",
                                                                 "output": "label"})
    assert (rep.valid_rows, rep.invalid_rows) == (1, 1)
    assert (rep.errors[0].row, rep.errors[0].field) == (2, "label")


def test_column_mapping_checked():
    assert check_column_mapping({"instruction": "q", "input": "", "output": "a"}) == \
        {"instruction": "q", "output": "a"}
    assert check_column_mapping({"instruction": "", "output": ""}) is None
    with pytest.raises(DatasetError, match="holds the output") as info:
        check_column_mapping({"instruction": "q"})
    assert info.value.field == "output"
    with pytest.raises(DatasetError, match="already the instruction"):
        check_column_mapping({"instruction": "q", "output": "q"})
    with pytest.raises(DatasetError, match="no column 'x'"):
        check_column_mapping({"instruction": "q", "output": "x"}, ["q", "a"])


def test_dropped_rows_warning_is_a_summary_with_every_row_as_details():
    """Trial shot 67: 26 rows, each with its own reason, made one unreadable paragraph."""
    from app.data.report import Issue
    from worker.engine.data import dropped_note

    rows = [Issue(row=r, field=None, message=f"the answer starts past max_seq_length (128 "
                                               f"tokens; the row has {1000 + r})") for r in
            (9, 12, 18, 21, 24, 29, 31)]
    summary, details = dropped_note(rows)
    assert summary == ("7 rows with no trained token left out of training (rows 9, 12, 18, 21, "
                       "24 and 2 more); row 9: the answer starts past max_seq_length (128 "
                       "tokens; the row has 1009)")
    assert len(details) == 7 and details[-1] == ("row 31: the answer starts past max_seq_length "
                                                 "(128 tokens; the row has 1031)")
    assert dropped_note(rows, listed=3)[1][-1] == "… and 4 more rows"
    assert dropped_note(rows[:1])[0].startswith("1 row with no trained token left out of "
                                                "training (row 9); row 9: ")
    assert dropped_note([]) is None


def test_a_row_with_a_lone_surrogate_is_one_invalid_row_naming_the_field(bundle, tmp_path):
    """Trial s24 M-7: a ``\\ud800`` escape in one row failed the whole validation with the
    tokenizer's TypeError; now that row is invalid, naming field and character, the rest train."""
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(5)]
    rows[2]["prompt"] = "bad \ud800 here"
    rows[4]["completion"] = "ok \U0001f600"  # a real surrogate pair (an emoji) is text
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ASCII: the escape stays
    rep = inspect_dataset(path, bundle, "chatml", max_seq_length=256)
    assert rep.total_rows == 5 and rep.valid_rows == 4 and rep.invalid_rows == 1
    (err,) = rep.errors
    assert (err.row, err.field) == (3, "prompt"), err
    assert err.message.startswith("an unpaired UTF-16 surrogate (\\ud800) at character 5: not text")
    kept = [row for row, _ in iter_encoded(path, bundle, "chatml", 256, True)]
    assert kept == [1, 2, 4, 5]
