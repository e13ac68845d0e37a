"""The run-log hint of worker/engine/padding.py: the padding share of padded batches."""
from app.store.specs import TrainSpec
from worker.engine.padding import padding_note, padding_share


def _spec(**kw):
    return TrainSpec(model="m", dataset="d", **kw)


def test_padding_share_counts_each_batch_padded_to_its_longest_row():
    assert padding_share([10, 10, 10, 10], 2) == 0.0
    # one batch [1, 3]: 6 tokens computed, 4 real
    assert padding_share([1, 3], 2) == 1 - 4 / 6
    assert padding_share([5, 100], 1) == 0.0 and padding_share([], 8) == 0.0
    lengths = [20] * 7 + [2000]  # one long row pads a whole batch of 8
    assert padding_share(lengths, 8) == 1 - (140 + 2000) / 16000


def test_the_note_names_the_share_and_the_fix_and_is_quiet_when_not_needed():
    lengths = [50, 60, 2000, 70] * 10
    note = padding_note(lengths, _spec(per_device_train_batch_size=4, seed=3))
    share = padding_share(lengths, 4, 3)
    assert note and f"{share:.0%}" in note and "padding_free" in note and "packing" in note
    assert padding_note(lengths, _spec(per_device_train_batch_size=4, padding_free=True)) is None
    assert padding_note(lengths, _spec(per_device_train_batch_size=4, packing=True)) is None
    assert padding_note([100] * 40, _spec(per_device_train_batch_size=4)) is None


def test_row_lengths_read_the_arrow_column():
    from datasets import Dataset

    from worker.engine.data import row_lengths

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4], list(range(50))],
                            "labels": [[1, 2, 3], [4], list(range(50))]})
    assert row_lengths(ds) == [3, 1, 50]
    assert row_lengths(ds.select([2, 0])) == [50, 3]  # an index mapping is honoured
