"""Settings every server sharing the registry follows, one row each in `settings`: the inference-auth mode.

The mode is `open` (any request is served: a fresh single-user server) or `keys` (an API key or the admin token is
needed). It only closes by itself: creating the first key (api_keys.py, in the key's own transaction) or starting
with `--api-key` / `--require-api-key` switches to `keys`; revoking keys never opens it again, only `set_auth`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from enum import StrEnum

from sqlalchemy.orm import Session

from loraserve.registry.models import SettingRow, utc_now

INFERENCE_AUTH = "inference_auth"


class InferenceAuth(StrEnum):
    """Who may send inference requests: anyone, or holders of a key (or the admin token)."""

    OPEN = "open"
    KEYS = "keys"


def store_auth(session: Session, mode: InferenceAuth) -> None:
    """Write `mode` in `session` (its caller commits), so a key and the mode it implies land together."""
    row = session.get(SettingRow, INFERENCE_AUTH, with_for_update=True)
    if row is None:
        session.add(SettingRow(name=INFERENCE_AUTH, value=mode.value))
    elif row.value != mode.value:
        row.value, row.updated_at = mode.value, utc_now()


class ServerSettings:
    """The settings table, through the registry's sessions (`session(action)` turns failures into RegistryError)."""

    def __init__(self, session: Callable[[str], AbstractContextManager[Session]]) -> None:
        self._session = session

    def auth(self) -> InferenceAuth:
        """The stored mode; `keys` if the row is missing or unreadable as a mode (closed is the safe side)."""
        with self._session("read the inference-auth mode") as session:
            row = session.get(SettingRow, INFERENCE_AUTH)
            return InferenceAuth.OPEN if row is not None and row.value == InferenceAuth.OPEN else InferenceAuth.KEYS

    def set_auth(self, mode: InferenceAuth) -> None:
        with self._session(f"set the inference-auth mode to {mode.value}") as session:
            store_auth(session, mode)
            session.commit()
