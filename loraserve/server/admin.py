"""Admin routes (the admin token, always): adapters, vLLM's load/unload, the memory pool.

An upload is written to a temporary directory in the data directory, validated against the base model, then handed to
the catalog, which stores and serves it; whatever fails, the temporary directory goes and the registry is as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import FormData, UploadFile

from loraserve.crash_points import crash_point
from loraserve.engine.stats import json_view
from loraserve.errors import AdapterError, AdapterNotFoundError, raise_if_disk_full
from loraserve.lora.adapter import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from loraserve.registry import AdapterInfo
from loraserve.registry.archive import SUFFIXES, extract_adapter_archive
from loraserve.server.responses import AdapterList, AdapterRecord, AdapterWithVersions, Deleted, Pool, record_json
from loraserve.server.state import ServerState, server_state

router = APIRouter()

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _kept_when_left_out() -> Any:
    """A PATCH field: null clears it, and one left out keeps its value (exclude_unset below), so its schema shows no
    default (null would say that leaving it out clears it)."""
    return Field(None, description="null clears it; left out, it stays", json_schema_extra=_without_default)


def _without_default(schema: dict[str, Any]) -> None:
    del schema["default"]


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    description: str | None = _kept_when_left_out()
    system_prompt: str | None = _kept_when_left_out()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a directory on the server's disk ("" would be its working directory)
    load_inplace: bool = False  # vLLM's: new weights under a name already served


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    sha256: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    lora_name: str = Field(min_length=1)


UPLOADS_DIR = "uploads"  # in the data directory: scratch space of uploads in flight


@router.post("/admin/adapters", status_code=201, response_model=AdapterRecord)
async def upload_adapter(request: Request) -> JSONResponse:
    state = server_state(request)

    async def store(form: FormData, source: Path) -> AdapterInfo:
        name = _text_field(form.get("name"), "name")
        if not name:
            raise AdapterError("name", "is required (a multipart form field)")
        system_prompt = _text_field(form.get("system_prompt"), "system_prompt")
        description = _text_field(form.get("description"), "description")
        return await state.catalog.add(name, source, system_prompt, description, uploaded_by(state))

    return JSONResponse(_record(state, await _received_upload(request, store)), status_code=201)


@router.put("/admin/adapters/{name}", response_model=AdapterRecord)
async def replace_adapter(name: str, request: Request) -> dict[str, Any]:
    """New weights for an adapter (the same multipart as an upload; `name` may be left out, `system_prompt` and
    `description` change them when given): a new version, served to every request that has not started; the running
    ones finish on the old weights."""
    state = server_state(request)

    async def store(form: FormData, source: Path) -> AdapterInfo:
        if (given := _text_field(form.get("name"), "name")) not in (None, name):
            raise AdapterError("name", f"{given!r} differs from the adapter in the path, {name!r}")
        fields = {field: _text_field(form.get(field), field) for field in ("system_prompt", "description")}
        info = await state.catalog.replace(name, source, uploaded_by(state))
        changes = {field: value for field, value in fields.items() if value is not None}
        return await state.catalog.update(name, **changes) if changes else info

    return _record(state, await _received_upload(request, store))


@router.post("/admin/adapters/{name}/rollback", response_model=AdapterRecord)
async def rollback_adapter(name: str, body: RollbackRequest, request: Request) -> dict[str, Any]:
    """Serve an earlier version again: `sha256` names it (GET /admin/adapters/{name} lists them)."""
    state = server_state(request)
    return _record(state, await state.catalog.rollback(name, body.sha256))


async def _received_upload(request: Request, store: Callable[[FormData, Path], Awaitable[AdapterInfo]]) -> AdapterInfo:
    """Unpack a multipart upload into scratch space and `store` it; the scratch space goes whatever happens."""
    state = server_state(request)
    form = await request.form(max_files=4, max_fields=8)
    try:
        uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        crash_point("upload.received")
        with _scratch_dir(state) as scratch:
            try:
                source = await asyncio.to_thread(_unpack_upload, uploads, scratch, state.config.max_unpacked_bytes)
            except OSError as error:
                raise_if_disk_full(error, "unpack the upload")
                raise
            crash_point("upload.unpacked")
            return await store(form, source)
    finally:
        await form.close()


def uploaded_by(state: ServerState) -> str:
    """Who uploads: the admin token, by an id that does not reveal it."""
    return "admin-" + hashlib.sha256(state.admin_token.encode()).hexdigest()[:12]


@router.get("/admin/adapters", response_model=AdapterList)
async def list_adapters(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {"object": "list", "data": [_record(state, info) for info in await state.catalog.records()]}


@router.get("/admin/adapters/{name}", response_model=AdapterWithVersions)
async def get_adapter(name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    if (info := await state.catalog.record(name)) is None:
        raise AdapterNotFoundError(name)
    versions = await state.catalog.versions(name)
    return {**_record(state, info), "versions": [record_json(version) for version in versions]}


@router.patch("/admin/adapters/{name}", response_model=AdapterRecord)
async def patch_adapter(name: str, body: AdapterPatch, request: Request) -> dict[str, Any]:
    state = server_state(request)
    info = await state.catalog.update(name, **body.model_dump(exclude_unset=True))  # a field left out stays as it is
    return _record(state, info)


@router.delete("/admin/adapters/{name}", response_model=Deleted)
async def delete_adapter(name: str, request: Request) -> dict[str, Any]:
    info = await server_state(request).catalog.remove(name)
    return {"name": info.name, "deleted": True}


@router.post("/admin/adapters/{name}/pin", response_model=AdapterRecord)
async def pin_adapter(name: str, request: Request) -> dict[str, Any]:
    return await _set_pinned(server_state(request), name, pinned=True)


@router.post("/admin/adapters/{name}/unpin", response_model=AdapterRecord)
async def unpin_adapter(name: str, request: Request) -> dict[str, Any]:
    return await _set_pinned(server_state(request), name, pinned=False)


@router.post("/v1/load_lora_adapter", response_model=AdapterRecord)
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    """vLLM's route: `lora_path` is a PEFT directory on the server's own disk."""
    state = server_state(request)
    path = Path(body.lora_path)
    if not path.is_dir():
        raise AdapterError("lora_path", f"{body.lora_path!r} is not a directory on the server")
    if body.load_inplace and await state.catalog.record(body.lora_name) is not None:
        return _record(state, await state.catalog.replace(body.lora_name, path, uploaded_by(state)))
    info = await state.catalog.add(body.lora_name, path, system_prompt=None, description=None)
    return _record(state, info)


@router.post("/v1/unload_lora_adapter", response_model=Deleted)
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    info = await server_state(request).catalog.remove(body.lora_name)
    return {"name": info.name, "deleted": True}


@router.get("/admin/pool", response_model=Pool)
async def pool(request: Request) -> dict[str, Any]:
    return json_view(await server_state(request).engine.call(lambda engine: engine.stats()))


async def _set_pinned(state: ServerState, name: str, pinned: bool) -> dict[str, Any]:
    state.catalog.get(name)  # 404 unless ready
    await state.catalog.set_pinned(name, pinned)
    if pinned:  # answer once the weights are in their slot, so the record shows them there
        await asyncio.to_thread(state.engine.wait_resident, name)
    return _record(state, state.catalog.get(name))


def _record(state: ServerState, info: AdapterInfo) -> dict[str, Any]:
    """The record as JSON, with where its weights are (device, host or disk only) as the engine tells."""
    record = record_json(info)
    record["residency"], record["pinned"] = state.engine.residency(info.name)
    return record


def _text_field(value: object, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise AdapterError(field, "must be a text field, not a file")


def remove_stale_uploads(data_dir: Path, min_age: float) -> None:
    """At start: the scratch directories of uploads a crash interrupted (older than `min_age` seconds)."""
    root = data_dir / UPLOADS_DIR
    now = time.time()
    for leftover in root.glob("*") if root.is_dir() else []:
        if now - leftover.stat().st_mtime >= min_age:
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _scratch_dir(state: ServerState) -> Iterator[Path]:
    """A temporary directory on the data directory's filesystem, removed on exit whatever happened."""
    root = state.config.data_dir / UPLOADS_DIR
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _unpack_upload(uploads: list[UploadFile], scratch: Path, max_unpacked_bytes: int) -> Path:
    """Write the uploaded PEFT files (or one archive's) into `scratch`; returns the adapter directory."""
    if not uploads:
        raise AdapterError("files", f"upload {CONFIG_FILE} and {WEIGHTS_FILE}, or one archive of them")
    names = [Path(upload.filename or "").name for upload in uploads]
    for name in names:
        if name in PICKLE_FILES or name.endswith(_PICKLE_SUFFIXES):
            raise AdapterError(name, "is a pickle file and is never loaded; only safetensors are accepted")
    if archives := [u for u, n in zip(uploads, names, strict=True) if n.endswith(SUFFIXES)]:
        if len(uploads) != 1:
            raise AdapterError("files", "send one archive alone, or the PEFT files without an archive")
        archive = scratch / names[0]
        _save(archives[0], archive)
        return extract_adapter_archive(archive, scratch / "adapter", max_unpacked_bytes)
    if unexpected := sorted(set(names) - {CONFIG_FILE, WEIGHTS_FILE}):
        raise AdapterError("files", f"unexpected file {unexpected[0]!r}; send {CONFIG_FILE} and {WEIGHTS_FILE}")
    for upload, name in zip(uploads, names, strict=True):
        _save(upload, scratch / name)
    return scratch


def _save(upload: UploadFile, path: Path) -> None:
    upload.file.seek(0)
    with path.open("wb") as out:
        shutil.copyfileobj(upload.file, out, 1 << 20)
