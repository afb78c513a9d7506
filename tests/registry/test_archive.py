"""Adapter archives: the layouts people make are accepted; unsafe, oversized, pickle and corrupt ones are refused."""

from __future__ import annotations

import io
import stat
import struct
import tarfile
import zipfile
from pathlib import Path

import pytest

from loraserve.errors import AdapterError, PayloadTooLargeError
from loraserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loraserve.registry import extract_adapter_archive
from tests.registry.conftest import MakeAdapter

LIMIT = 1 << 20


def _write_zip(path: Path, members: dict[str, bytes], mode: int = stat.S_IFREG | 0o644) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


def _write_tar(path: Path, members: dict[str, bytes], special: tarfile.TarInfo | None = None) -> Path:
    with tarfile.open(path, "w:gz" if path.name.endswith("gz") else "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if special is not None:
            tf.addfile(special)
    return path


@pytest.fixture
def peft_files(make_adapter: MakeAdapter) -> dict[str, bytes]:
    path, _ = make_adapter()
    return {name: (path / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "out" / "adapter"


@pytest.mark.parametrize("suffix", [".zip", ".tar.gz", ".tgz", ".tar"])
@pytest.mark.parametrize("top", ["", "my-adapter/"])
def test_extracts_root_level_or_single_directory(
    tmp_path: Path, dest: Path, peft_files: dict[str, bytes], suffix: str, top: str
) -> None:
    members = {top + name: data for name, data in peft_files.items()} | {top + "README.md": b"# pirate"}
    if suffix == ".zip":
        members["__MACOSX/._adapter_config.json"] = b"resource fork"
        archive = _write_zip(tmp_path / f"archive{suffix}", members)
    else:
        archive = _write_tar(tmp_path / f"archive{suffix}", members)
    assert extract_adapter_archive(archive, dest, LIMIT) == dest
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == peft_files  # README.md is not extracted


@pytest.mark.parametrize("suffix", [".zip", ".tar.gz"])
@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/tmp/evil", "\\evil", "a\\..\\..\\evil"])
def test_paths_leaving_the_directory_are_refused(
    tmp_path: Path, dest: Path, peft_files: dict[str, bytes], suffix: str, name: str
) -> None:
    write = _write_zip if suffix == ".zip" else _write_tar
    archive = write(tmp_path / f"archive{suffix}", peft_files | {name: b"evil"})
    before = set(tmp_path.rglob("*"))
    with pytest.raises(AdapterError, match="outside") as caught:
        extract_adapter_archive(archive, dest, LIMIT)
    assert caught.value.field == "archive"
    assert set(tmp_path.rglob("*")) == before


def test_zip_symlink_is_refused(tmp_path: Path, dest: Path, peft_files: dict[str, bytes]) -> None:
    archive = _write_zip(tmp_path / "archive.zip", peft_files)
    with zipfile.ZipFile(archive, "a") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(AdapterError, match="link"):
        extract_adapter_archive(archive, dest, LIMIT)
    assert not dest.exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE])
def test_tar_links_and_devices_are_refused(
    tmp_path: Path, dest: Path, peft_files: dict[str, bytes], kind: bytes
) -> None:
    special = tarfile.TarInfo("special")
    special.type, special.linkname = kind, "/etc/passwd"
    archive = _write_tar(tmp_path / "archive.tar.gz", peft_files, special)
    with pytest.raises(AdapterError, match="link or special"):
        extract_adapter_archive(archive, dest, LIMIT)
    assert not dest.exists()


def test_zip_bomb_is_refused_from_its_headers(tmp_path: Path, dest: Path, peft_files: dict[str, bytes]) -> None:
    archive = _write_zip(tmp_path / "archive.zip", peft_files | {WEIGHTS_FILE: bytes(20 * LIMIT)})
    assert archive.stat().st_size < LIMIT // 10
    with pytest.raises(PayloadTooLargeError):
        extract_adapter_archive(archive, dest, LIMIT)
    assert not dest.exists()


def _understate_size(data: bytearray, name: str, size: int) -> None:
    """Rewrite `name`'s uncompressed size in the zip's local and central headers: a zip whose headers lie."""
    # (signature, offset of the name length, of the name, of the uncompressed size)
    for signature, length_at, name_at, size_at in ((b"PK\x03\x04", 26, 30, 22), (b"PK\x01\x02", 28, 46, 24)):
        start = data.find(signature)
        while start != -1:
            (length,) = struct.unpack_from("<H", data, start + length_at)
            if data[start + name_at : start + name_at + length] == name.encode():
                struct.pack_into("<I", data, start + size_at, size)
            start = data.find(signature, start + 4)


def test_zip_with_understated_sizes_is_refused(tmp_path: Path, dest: Path, peft_files: dict[str, bytes]) -> None:
    archive = _write_zip(tmp_path / "archive.zip", peft_files | {WEIGHTS_FILE: bytes(5 * LIMIT)})
    data = bytearray(archive.read_bytes())
    _understate_size(data, WEIGHTS_FILE, 1000)
    archive.write_bytes(data)
    with pytest.raises((PayloadTooLargeError, AdapterError)):
        extract_adapter_archive(archive, dest, LIMIT)
    assert list(dest.iterdir()) == []  # the partial files are removed


def test_tar_above_the_limit_is_refused(tmp_path: Path, dest: Path, peft_files: dict[str, bytes]) -> None:
    archive = _write_tar(tmp_path / "archive.tar.gz", peft_files | {"big.bin": bytes(2 * LIMIT)})
    with pytest.raises(PayloadTooLargeError):
        extract_adapter_archive(archive, dest, LIMIT)
    assert not dest.exists()


@pytest.mark.parametrize("suffix", [".zip", ".tar.gz"])
def test_pickle_weights_are_refused_by_name(
    tmp_path: Path, dest: Path, peft_files: dict[str, bytes], suffix: str
) -> None:
    members = {f"pirate/{CONFIG_FILE}": peft_files[CONFIG_FILE], "pirate/adapter_model.bin": b"\x80\x04pickle"}
    write = _write_zip if suffix == ".zip" else _write_tar
    with pytest.raises(AdapterError, match="only safetensors are accepted") as caught:
        extract_adapter_archive(write(tmp_path / f"archive{suffix}", members), dest, LIMIT)
    assert caught.value.field == "pirate/adapter_model.bin"
    assert not dest.exists()


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ({"a/adapter_config.json": b"{}", "b/adapter_model.safetensors": b"x"}, "single top-level"),
        ({"README.md": b"hi"}, "no adapter_config.json"),
        ({CONFIG_FILE: b"{}"}, "missing from the archive"),
        ({CONFIG_FILE: b"{}", f"./{CONFIG_FILE}": b"{}", WEIGHTS_FILE: b"x"}, "twice"),
    ],
)
def test_wrong_layouts_are_refused(tmp_path: Path, dest: Path, members: dict[str, bytes], match: str) -> None:
    with pytest.raises(AdapterError, match=match):
        extract_adapter_archive(_write_zip(tmp_path / "archive.zip", members), dest, LIMIT)


@pytest.mark.parametrize("name", ["archive.zip", "archive.tar.gz", "archive.tar", "archive.rar"])
def test_corrupt_or_unknown_archives_are_refused(tmp_path: Path, dest: Path, name: str) -> None:
    archive = tmp_path / name
    archive.write_bytes(b"PK\x03\x04 this is not really an archive" * 10)
    with pytest.raises(AdapterError) as caught:
        extract_adapter_archive(archive, dest, LIMIT)
    assert caught.value.field == "archive"


def test_truncated_tar_gz_is_refused(tmp_path: Path, dest: Path, peft_files: dict[str, bytes]) -> None:
    archive = _write_tar(tmp_path / "archive.tar.gz", peft_files)
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(AdapterError, match="corrupt") as caught:
        extract_adapter_archive(archive, dest, LIMIT)
    assert caught.value.field == "archive"
