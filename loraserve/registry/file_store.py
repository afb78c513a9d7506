"""Content-addressed store of adapter files: `root/<sha256>/{adapter_config.json, adapter_model.safetensors}`.

Equal uploads share one directory. A directory appears only complete: files are written and fsynced in a temporary
directory under `root` (same filesystem), then renamed into place; those a crash left behind go when the store opens,
once older than `min_leftover_age` (where servers share a store, a younger one may be another server's write).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loraserve.crash_points import crash_point
from loraserve.errors import AdapterError, RegistryError, raise_if_disk_full
from loraserve.file_digest import sha256_of_files
from loraserve.lora.peft_files import CONFIG_FILE, WEIGHTS_FILE

FILES = (CONFIG_FILE, WEIGHTS_FILE)  # in the order the content hash reads them
_TMP_PREFIX = ".tmp-"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class FileStore:
    """Adapter files on disk, named by content hash. Owns everything under `root`."""

    def __init__(self, root: Path, min_leftover_age: float = 0.0) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(f"{_TMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):  # another server's, finished meanwhile
                if time.time() - leftover.stat().st_mtime >= min_leftover_age:
                    shutil.rmtree(leftover, ignore_errors=True)

    def path_of(self, sha256: str) -> Path:
        """The directory that holds (or would hold) the files hashing to `sha256`."""
        if not _SHA256.fullmatch(sha256):
            raise ValueError(f"not a lowercase hex sha256: {sha256!r}")
        return self.root / sha256

    def put(self, source_dir: Path, sha256: str) -> Path:
        """Copy the adapter files in `source_dir` into the store; returns their stored directory. AdapterError if the
        files no longer hash to `sha256` (changed since they were read), RegistryError if the store cannot be written.
        """
        final = self.path_of(sha256)
        if final.is_dir() and self.verify(sha256) is None:
            return final
        staging = self.staging_dir()
        try:
            digest = hashlib.sha256()
            for name in FILES:
                _copy_durably(source_dir / name, staging / name, digest.update)
                crash_point("store.copying")
            _fsync_dir(staging)
            crash_point("store.staged")
            if (actual := digest.hexdigest()) != sha256:
                raise AdapterError(
                    "files", f"changed in {source_dir} while being stored: sha256 {actual}, read as {sha256}"
                )
            if final.exists():
                if self.verify(sha256) is None:  # another thread stored the same content meanwhile
                    return final
                self._discard(final)  # a damaged copy, replaced by the fresh one
            os.rename(staging, final)
            _fsync_dir(self.root)
            crash_point("store.renamed")
        except OSError as error:
            raise_if_disk_full(error, f"store the adapter files in {self.root}")
            raise RegistryError(f"cannot store adapter files in {self.root}: {error}") from error
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # already gone after a successful rename
        return final

    def staging_dir(self) -> Path:
        """A new temporary directory in the store's filesystem (removed at the next open if a crash leaves it)."""
        return Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))

    def stored(self) -> list[str]:
        """The content hashes of every stored directory."""
        return sorted(path.name for path in self.root.iterdir() if path.is_dir() and _SHA256.fullmatch(path.name))

    def age_seconds(self, sha256: str) -> float:
        """Seconds since the stored directory of `sha256` appeared."""
        return max(0.0, time.time() - self.path_of(sha256).stat().st_mtime)

    def remove(self, sha256: str) -> None:
        """Delete the stored files of `sha256`, if any."""
        path = self.path_of(sha256)
        if path.exists():
            self._discard(path)

    def verify(self, sha256: str) -> str | None:
        """None when the stored files are present and hash to `sha256`, else why not."""
        path = self.path_of(sha256)
        missing = [name for name in FILES if not (path / name).is_file()]
        if missing:
            return f"stored files missing: {', '.join(missing)} in {path}"
        actual = sha256_of_files(*(path / name for name in FILES))
        return None if actual == sha256 else f"stored files changed on disk: sha256 is {actual}, expected {sha256}"

    def _discard(self, path: Path) -> None:
        # Renamed first, so a crash mid-delete leaves a temporary dir, never a half-deleted adapter.
        aside = self.staging_dir()
        os.rename(path, aside / path.name)
        shutil.rmtree(aside)


def _copy_durably(source: Path, dest: Path, update: Callable[[bytes], object]) -> None:
    """Copy `source` to `dest` and fsync it, passing the bytes to `update` on the way (one read pass)."""
    with source.open("rb") as src, dest.open("wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            update(chunk)
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist a directory's entries (new files, renames) across a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
