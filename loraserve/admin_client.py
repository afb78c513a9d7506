"""`loraserve adapters ...` and `loraserve auth`: the admin API from the terminal, against a running server."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from loraserve.errors import LoraserveError
from loraserve.lora.peft_files import CONFIG_FILE, WEIGHTS_FILE


class AdminClient:
    def __init__(self, url: str, admin_token: str | None, timeout: float = 600) -> None:
        if not admin_token:
            raise LoraserveError("set --admin-token or LORASERVE_ADMIN_TOKEN (the server prints its token at start)")
        headers = {"Authorization": f"Bearer {admin_token}"}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def upload(
        self, name: str, path: Path, system_prompt: str | None, description: str | None, replace: bool = False
    ) -> dict[str, Any]:
        """Upload a PEFT directory (its two files) or an archive of one; `replace`: as new weights of the adapter."""
        files = [path / CONFIG_FILE, path / WEIGHTS_FILE] if path.is_dir() else [path]
        if missing := [str(f) for f in files if not f.is_file()]:
            raise LoraserveError(f"not found: {', '.join(missing)}")
        fields = {"name": name, "system_prompt": system_prompt, "description": description}
        with ExitStack() as stack:
            parts = [("files", (f.name, stack.enter_context(f.open("rb")))) for f in files]
            data = {k: v for k, v in fields.items() if v is not None}
            if replace:
                return self._call("PUT", f"/admin/adapters/{name}", data=data, files=parts)
            return self._call("POST", "/admin/adapters", data=data, files=parts)

    def rollback(self, name: str, sha256: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/adapters/{name}/rollback", json={"sha256": sha256})

    def list(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/adapters")["data"])

    def show(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/admin/adapters/{name}")

    def delete(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/admin/adapters/{name}")

    def auth(self, mode: str | None = None) -> dict[str, Any]:
        """The inference-auth mode, set to `mode` first if given."""
        if mode is None:
            return self._call("GET", "/admin/auth")
        return self._call("PUT", "/admin/auth", json={"mode": mode})

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise LoraserveError(f"cannot reach the server at {self.http.base_url}: {error}") from error
        if response.is_error:
            raise error_of(response)
        return response.json()


def error_of(response: httpx.Response) -> LoraserveError:
    """A server's error answer as LoraserveError, with the message of its JSON body when it has one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return LoraserveError(f"{response.status_code}: {message}")


def format_table(records: list[dict[str, Any]]) -> str:
    columns = ("name", "status", "rank", "residency", "request_count", "description")
    rows = [[str(record.get(c) or "") for c in columns] for record in records]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_record(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False)
