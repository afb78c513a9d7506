"""Content hashes of files, read in chunks so large weights never sit in memory twice."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of_files(*files: Path) -> str:
    """Hex SHA-256 of the files' bytes, concatenated in the order given."""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
