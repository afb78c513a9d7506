"""A step's rows grouped into segments of one adapter, as the LoRA kernels read them."""

from __future__ import annotations

from loraserve.lora.batch import adapter_runs


def test_neighbouring_sequences_of_one_adapter_share_a_segment():
    assert adapter_runs([1, 1, 1, 3], [2, 2, -1, 2]) == ([2, 3, 6], [2, -1, 2])


def test_a_long_run_is_cut_into_segments_of_at_most_the_rows_asked_but_never_inside_a_sequence():
    # CUDA graphs cut runs of one adapter into 16-row segments, so each keeps a program busy.
    assert adapter_runs([1] * 40 + [1] * 3, [4] * 40 + [5] * 3, longest=16) == ([16, 32, 40, 43], [4, 4, 4, 5])
    assert adapter_runs([3, 20, 1], [1, 1, 1], longest=16) == ([3, 23, 24], [1, 1, 1])
    assert adapter_runs([1] * 5, [-1] * 5, longest=2) == ([2, 4, 5], [-1, -1, -1])
