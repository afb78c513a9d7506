"""Per-adapter usage counted in memory and written to the registry in the background.

A finished request adds to its adapter's counts here (no database on the request path); the flush hands what has
gathered to the registry and puts it back if the write fails, so no count is lost while the process lives. One entry per
adapter: the buffer is bounded by the adapters served, however many requests arrive while the database is away.
"""

from __future__ import annotations

from loraserve.registry import Usage


class UsageBuffer:
    """Owned by the catalog: `add` from the event loop, `take` and `put_back` by its flusher."""

    def __init__(self) -> None:
        self._counts: dict[str, Usage] = {}

    def add(self, name: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._counts.setdefault(name, Usage()).add(Usage(1, prompt_tokens, completion_tokens))

    def take(self) -> dict[str, Usage]:
        """Everything gathered since the last take (the caller writes it, or puts it back)."""
        counts, self._counts = self._counts, {}
        return counts

    def put_back(self, counts: dict[str, Usage]) -> None:
        for name, usage in counts.items():
            self._counts.setdefault(name, Usage()).add(usage)

    def __len__(self) -> int:
        return len(self._counts)
