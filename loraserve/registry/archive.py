"""Unpack an uploaded adapter archive (.zip, .tar.gz, .tgz, .tar) safely.

Only the two PEFT files are extracted, flat into `dest`, so no name inside the archive ever becomes a path on disk; an
archive with members that would write elsewhere in a plain unpacker (absolute or `..` paths, links, devices) is refused
whole. Sizes are checked twice: the declared total before extracting, and the bytes actually written, so a zip whose
headers lie cannot fill the disk.
"""

from __future__ import annotations

import gzip
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO

from loraserve.errors import AdapterError, PayloadTooLargeError
from loraserve.lora.peft_files import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE

SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
_IGNORED_TOP_DIRS = {"__MACOSX"}  # resource forks macOS adds to the zips it makes

Opener = Callable[[], IO[bytes]]  # opens one member's bytes


def extract_adapter_archive(archive: Path, dest: Path, max_unpacked_bytes: int) -> Path:
    """Extract the adapter in `archive` into `dest`; returns the directory holding adapter_config.json (at the archive
    root or in its single top-level directory). Raises AdapterError("archive", ...) for an unsafe, corrupt or unknown
    archive, AdapterError naming the file for pickle weights, PayloadTooLargeError above `max_unpacked_bytes`."""
    lowered = archive.name.lower()
    try:
        if lowered.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                return _extract(_zip_members(zf, max_unpacked_bytes), dest, max_unpacked_bytes)
        if lowered.endswith(SUFFIXES):
            with tarfile.open(archive, "r:*") as tf:
                return _extract(_tar_members(tf, max_unpacked_bytes), dest, max_unpacked_bytes)
    except (zipfile.BadZipFile, tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, NotImplementedError) as error:
        raise AdapterError(
            "archive", f"{archive.name} is corrupt, truncated or uses an unsupported format: {error}"
        ) from error
    raise AdapterError("archive", f"{archive.name}: unknown archive type; upload one of {', '.join(SUFFIXES)}")


def _zip_members(zf: zipfile.ZipFile, max_unpacked_bytes: int) -> dict[str, Opener]:
    members: dict[str, Opener] = {}
    for info in zf.infolist():
        kind = stat.S_IFMT(info.external_attr >> 16)  # the Unix mode; 0 when a DOS tool made the zip
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise AdapterError("archive", f"{info.filename!r} is a link or special file; only plain files are accepted")
        if info.flag_bits & 0x1:
            raise AdapterError("archive", f"{info.filename!r} is encrypted")
        if info.is_dir():
            _normalized(info.filename)
        else:
            _add(members, info.filename, partial(zf.open, info))
    _check_total(sum(info.file_size for info in zf.infolist()), max_unpacked_bytes)
    return members


def _tar_members(tf: tarfile.TarFile, max_unpacked_bytes: int) -> dict[str, Opener]:
    members: dict[str, Opener] = {}
    total = 0
    for member in tf:  # header by header, so a huge archive is refused before it is all read
        if not (member.isfile() or member.isdir()):
            raise AdapterError("archive", f"{member.name!r} is a link or special file; only plain files are accepted")
        total += member.size
        _check_total(total, max_unpacked_bytes)
        if member.isfile():
            _add(members, member.name, partial(_open_tar_member, tf, member))
        else:
            _normalized(member.name)
    return members


def _open_tar_member(tf: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    file = tf.extractfile(member)
    assert file is not None, "extractfile returns a file for every regular member"
    return file


def _normalized(name: str) -> str:
    """`name` as "a/b", refusing names a plain unpacker would write outside its directory."""
    parts = [part for part in name.replace("\\", "/").split("/") if part not in ("", ".")]
    if name.startswith(("/", "\\")) or ".." in parts:
        raise AdapterError("archive", f"member {name!r} would be written outside the adapter directory")
    return "/".join(parts)


def _add(members: dict[str, Opener], name: str, opener: Opener) -> None:
    key = _normalized(name)
    if key in members:
        raise AdapterError("archive", f"{key!r} appears twice")
    members[key] = opener


def _check_total(total: int, max_unpacked_bytes: int, note: str = "") -> None:
    if total > max_unpacked_bytes:
        raise PayloadTooLargeError(f"archive unpacks to more than the limit of {max_unpacked_bytes} bytes{note}")


def _adapter_prefix(members: dict[str, Opener]) -> str:
    """'' when the PEFT files sit at the archive root, 'top/' when inside its single top-level directory."""
    if CONFIG_FILE in members:
        return ""
    top_dirs = {name.split("/", 1)[0] for name in members if "/" in name} - _IGNORED_TOP_DIRS
    if len(top_dirs) == 1 and f"{next(iter(top_dirs))}/{CONFIG_FILE}" in members:
        return f"{next(iter(top_dirs))}/"
    raise AdapterError("archive", f"no {CONFIG_FILE} at the archive root or in its single top-level directory")


def _extract(members: dict[str, Opener], dest: Path, max_unpacked_bytes: int) -> Path:
    prefix = _adapter_prefix(members)
    if prefix + WEIGHTS_FILE not in members:
        pickles = [prefix + name for name in PICKLE_FILES if prefix + name in members]
        if pickles:
            raise AdapterError(
                pickles[0], f"only safetensors are accepted; {pickles[0]} is a pickle and was not loaded"
            )
        raise AdapterError(WEIGHTS_FILE, "missing from the archive")
    dest.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with members[prefix + name]() as src, (dest / name).open("wb") as dst:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    _check_total(written, max_unpacked_bytes, " (its headers understate it)")
                    dst.write(chunk)
    except BaseException:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            (dest / name).unlink(missing_ok=True)
        raise
    return dest
