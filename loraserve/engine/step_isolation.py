"""Running a step so that one row's failure ends only that row's request.

A step that raises is retried in halves, recursively, until the rows that fail alone are found
(log2(rows) extra forward passes, paid only when a step fails). Safe: a row writes K/V only at its
own new positions, which the retry writes again, and nothing is published or sampled until the
step's output is taken. Block copies are not repeated: one would overwrite what a half that already
succeeded wrote. Example: rows [a, b, c, d], c raises: [a, b] runs, [c, d] fails -> [c] fails
alone, [d] runs. Result: batch [a, b, d], their outputs in that order, c failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraserve.engine.batch import ScheduledBatch, ScheduledSequence, StepOutput


@dataclass
class RowFailure:
    item: ScheduledSequence
    error: Exception


@dataclass
class IsolatedStep:
    """What ran (`batch`, with `output` in its sampling order) and the rows that failed on their own."""

    batch: ScheduledBatch
    output: StepOutput
    failures: list[RowFailure]


def run_isolating_failures(
    run: Callable[[ScheduledBatch], StepOutput],
    batch: ScheduledBatch,
    is_unrecoverable: Callable[[Exception], bool],
) -> IsolatedStep:
    """`run(batch)`; on an error, the rows that raise alone are left out. Unrecoverable errors propagate."""
    try:
        return IsolatedStep(batch, run(batch), [])
    except Exception as error:
        if is_unrecoverable(error):
            raise
        items = batch.scheduled
        if len(items) == 1:
            return IsolatedStep(batch.subset([]), StepOutput(token_ids=[], logprobs=[]), [RowFailure(items[0], error)])
        middle = len(items) // 2
        first = run_isolating_failures(run, batch.subset(items[:middle]), is_unrecoverable)
        second = run_isolating_failures(run, batch.subset(items[middle:]), is_unrecoverable)
        # Decodes come before prefills in `items`, so the halves' rows, joined, keep the batch's order.
        return IsolatedStep(
            batch=batch.subset(first.batch.scheduled + second.batch.scheduled),
            output=StepOutput(
                token_ids=first.output.token_ids + second.output.token_ids,
                logprobs=first.output.logprobs + second.output.logprobs,
            ),
            failures=first.failures + second.failures,
        )
