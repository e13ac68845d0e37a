"""The run-log line of worker/engine/padding.py: how a run batches its rows, and the padding
share padded batches spend."""
from app.store.specs import TrainSpec
from worker.engine.padding import batching_note, padding_share


def _spec(**kw):
    return TrainSpec(model="m", dataset="d", **kw)


def test_padding_share_counts_each_batch_padded_to_its_longest_row():
    assert padding_share([10, 10, 10, 10], 2) == 0.0
    # one batch [1, 3]: 6 tokens computed, 4 real
    assert padding_share([1, 3], 2) == 1 - 4 / 6
    assert padding_share([5, 100], 1) == 0.0 and padding_share([], 8) == 0.0
    lengths = [20] * 7 + [2000]  # one long row pads a whole batch of 8
    assert padding_share(lengths, 8) == 1 - (140 + 2000) / 16000


def test_padding_free_is_the_default_and_the_log_says_what_it_saves():
    assert TrainSpec.model_fields["padding_free"].default is True
    lengths = [50, 60, 2000, 70] * 10
    share = padding_share(lengths, 4, 3)
    text, level = batching_note(lengths, _spec(per_device_train_batch_size=4, seed=3,
                                               gradient_accumulation_steps=1))
    assert level == "info" and "padding-free batches (the default)" in text
    assert "each micro-batch's 4 rows go into one sequence" in text
    assert f"about {share:.0%}" in text and "accumulate" not in text
    # 4 rows x 2 accumulation steps: 8 rows per optimizer step, joined 4 at a time
    text, _ = batching_note(lengths, _spec(per_device_train_batch_size=4, seed=3,
                                           gradient_accumulation_steps=2))
    assert "each micro-batch's 4 rows go into one sequence" in text
    assert "(2 micro-batches, 8 rows, accumulate into each optimizer step)" in text
    assert "each step's" not in text
    text, _ = batching_note([100] * 40, _spec(per_device_train_batch_size=1,
                                              gradient_accumulation_steps=1))
    assert "micro-batch's 1 row goes" in text and "pad tokens" in text
    assert "would have spent" not in text
    assert batching_note(lengths, _spec(per_device_train_batch_size=4, packing=True)) is None


def test_a_padded_run_is_told_its_padding_share_and_the_fix():
    lengths = [50, 60, 2000, 70] * 10
    text, level = batching_note(lengths, _spec(per_device_train_batch_size=4, seed=3,
                                               padding_free=False))
    share = padding_share(lengths, 4, 3)
    assert level == "warning" and f"about {share:.0%}" in text and share > 0.5
    assert "padding_free" in text and "packing" in text
    assert batching_note([100] * 40, _spec(per_device_train_batch_size=4,
                                           padding_free=False)) is None


def test_row_lengths_read_the_arrow_column():
    from datasets import Dataset

    from worker.engine.data import row_lengths

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4], list(range(50))],
                            "labels": [[1, 2, 3], [4], list(range(50))]})
    assert row_lengths(ds) == [3, 1, 50]
    assert row_lengths(ds.select([2, 0])) == [50, 3]  # an index mapping is honoured
