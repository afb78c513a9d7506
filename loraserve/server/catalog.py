"""The adapters the server offers: the registry's records kept in step with the engine.

Every change goes registry first, engine second, and is undone in the registry when the
engine refuses it, so a restart always sees what was served. Reads (name -> record for
routing and personas) come from memory, never from the database on the request path.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.errors import AdapterError, AdapterExistsError, UnknownAdapterError
from loraserve.lora.adapter import CONFIG_FILE
from loraserve.registry import AdapterInfo, Registry

logger = logging.getLogger(__name__)


class AdapterCatalog:
    def __init__(self, registry: Registry, engine: AsyncLLMEngine, base_model: str) -> None:
        self.registry = registry
        self.engine = engine
        self.base_model = base_model
        self._ready: dict[str, AdapterInfo] = {}
        self._usage_writes: set[asyncio.Task[None]] = set()  # referenced until done, or they may vanish

    def load_registered(self) -> None:
        """At start (before the engine thread runs): verify every stored adapter and serve the sound ones."""
        for info in self.registry.verify_all():
            if info.status != "ready":
                logger.warning("adapter %r not served: %s", info.name, info.status_reason)
                continue
            # Read at its first request (the hash was just checked); thousands may be registered.
            self.engine.engine.register_adapter(info.name, self.registry.files_of(info), info.sha256)
            self._ready[info.name] = info

    def register_samples(self, directory: Path) -> None:
        """Register each PEFT directory under `directory` by its directory name (those not registered yet)."""
        for path in sorted(p for p in directory.glob("*") if (p / CONFIG_FILE).is_file()):
            if self.registry.get(path.name) is not None:
                continue
            adapter = self.engine.engine.read_adapter(path)
            readme = path / "README.md"
            # The persona line: the first paragraph after the README's title.
            lines = [line for line in readme.read_text().splitlines()[1:] if line.strip()] if readme.exists() else []
            self.registry.create(path.name, path, adapter, self.base_model, None, lines[0] if lines else None)

    def get(self, name: str) -> AdapterInfo:
        """The ready adapter called `name`; UnknownAdapterError (404) otherwise."""
        info = self._ready.get(name)
        if info is None:
            raise UnknownAdapterError(name)
        return info

    @property
    def ready(self) -> list[AdapterInfo]:
        return sorted(self._ready.values(), key=lambda info: info.name)

    async def add(self, name: str, source_dir: Path, system_prompt: str | None, description: str | None) -> AdapterInfo:
        """Validate the PEFT directory against the base model, store it, serve it. All or nothing."""
        if await asyncio.to_thread(self.registry.get, name) is not None:
            raise AdapterExistsError(name)
        if name == self.base_model:
            raise AdapterError("name", f"{name!r} is the base model's id")
        # Off the engine's lock and out of this process: a hostile file stalls no request (adapter_sandbox.py).
        adapter = await asyncio.to_thread(self.engine.engine.read_untrusted_adapter, source_dir)
        info = await asyncio.to_thread(
            self.registry.create, name, source_dir, adapter, self.base_model, system_prompt, description
        )
        stored = self.registry.files_of(info)
        try:
            await self.engine.call(lambda engine: engine.register_adapter(name, stored, info.sha256, adapter))
        except BaseException:
            await asyncio.to_thread(self.registry.delete, name)
            raise
        self._ready[name] = info
        return info

    async def update(self, name: str, **changes: str | None) -> AdapterInfo:
        info = await asyncio.to_thread(lambda: self.registry.update(name, **changes))
        if name in self._ready:
            self._ready[name] = info
        return info

    async def remove(self, name: str) -> AdapterInfo:
        """Forget the adapter: new requests get 404 at once, the ones running finish."""
        info = await asyncio.to_thread(self.registry.delete, name)
        if self._ready.pop(name, None) is not None:
            await self.engine.call(lambda engine: engine.remove_adapter(name))
        return info

    async def mark_failed(self, name: str, reason: str) -> None:
        """The engine could not load a stored adapter: stop offering it, and say why in the registry."""
        if self._ready.pop(name, None) is None:
            return
        logger.error("adapter %r failed: %s", name, reason)
        await asyncio.to_thread(self.registry.mark_failed, name, reason)
        await self.engine.call(lambda engine: engine.remove_adapter(name))

    def record_usage(self, name: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count a finished request in the registry, in the background: the answer never waits on it."""
        task = asyncio.create_task(self._add_usage(name, prompt_tokens, completion_tokens))
        self._usage_writes.add(task)
        task.add_done_callback(self._usage_writes.discard)

    async def _add_usage(self, name: str, prompt_tokens: int, completion_tokens: int) -> None:
        try:
            await asyncio.to_thread(self.registry.add_usage, name, 1, prompt_tokens, completion_tokens)
        except Exception:  # counters must never fail a request that was answered
            logger.exception("could not record usage of adapter %r", name)
