"""Named points where a fault test kills the server on purpose: LORASERVE_CRASH_AT=NAME makes the
process SIGKILL itself on reaching NAME, as a power cut or the OOM killer would stop it there.

Inert unless that variable is set. tests/server/test_crash_safety.py starts real servers with
each point in turn and checks what a restart on the same data finds (every adapter fully
present and servable, or absent; no orphan file). The points of an upload, in order:
upload.received, upload.unpacked, upload.validated, store.copying, store.staged,
store.renamed, registry.inserted, upload.served.
"""

from __future__ import annotations

import os
import signal

VARIABLE = "LORASERVE_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(VARIABLE) == name:
        os.kill(os.getpid(), signal.SIGKILL)
