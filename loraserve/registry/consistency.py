"""The registry against its file store: every adapter row has its files, every stored directory a row.

The store writes files before the row (complete, by rename), so a crash between the two leaves at worst stored files no
row names: orphans, which the server removes at start and `loraserve registry check --repair` on demand. Example: after
SIGKILL between the rename and the insert, store/<sha> exists with no row; `check(repair=True)` removes it and reports
it under `removed`. Orphans newer than `min_orphan_age` are left alone: where replicas share one store, another server's
upload may be between its file write and its commit. A row whose files are missing or changed (a disk fault, a hand-made
deletion) cannot come from a crash; it is marked failed with the reason, kept for the operator to see, and never served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loraserve.registry.adapter_info import AdapterInfo
from loraserve.registry.models import AdapterStatus
from loraserve.registry.repository import Registry

logger = logging.getLogger(__name__)


@dataclass
class ConsistencyReport:
    orphans: list[str] = field(default_factory=list)  # stored directories (sha256) no adapter or version names
    removed: list[str] = field(default_factory=list)  # of those, removed by the repair
    failed: dict[str, str] = field(default_factory=dict)  # adapter -> why its files cannot be served
    adapters: list[AdapterInfo] = field(default_factory=list)  # every adapter, after the check

    @property
    def is_consistent(self) -> bool:
        """No orphan left; adapters with unusable files are marked failed (never served)."""
        return set(self.orphans) <= set(self.removed)

    def lines(self) -> list[str]:
        kept = [sha for sha in self.orphans if sha not in self.removed]
        return [
            *(f"orphan files removed: {sha}" for sha in self.removed),
            *(f"orphan files (no adapter names them): {sha}" for sha in kept),
            *(f"adapter {name!r} not served: {reason}" for name, reason in sorted(self.failed.items())),
        ]


def check_registry(registry: Registry, repair: bool, min_orphan_age: float = 0.0) -> ConsistencyReport:
    """Compare rows and stored files; with `repair`, remove orphans older than `min_orphan_age` seconds."""
    adapters = registry.verify_all()  # marks adapters whose files are missing or changed failed
    named = registry.stored_hashes()  # every version's files too: a rollback needs them
    orphans = [sha256 for sha256 in registry.store.stored() if sha256 not in named]
    failed = {a.name: a.status_reason for a in adapters if a.status is AdapterStatus.FAILED and a.status_reason}
    report = ConsistencyReport(orphans=orphans, failed=failed, adapters=adapters)
    for sha256 in orphans:
        if repair and registry.store.age_seconds(sha256) >= min_orphan_age:
            registry.store.remove(sha256)
            report.removed.append(sha256)
            logger.warning("removed orphan adapter files %s: no adapter names them (a crash mid-upload)", sha256)
    return report
