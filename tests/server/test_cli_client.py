"""`loraserve adapters ...` and `loraserve chat` against a running server."""

from __future__ import annotations

import io
import json
import shutil

import httpx
import pytest

from loraserve.cli import main
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN_TOKEN, start_server

pytestmark = pytest.mark.slow

SAMPLES = SAMPLE_ADAPTERS


def run_cli(capsys, *args: str) -> str:
    main(list(args))
    return capsys.readouterr().out


def test_upload_list_show_chat_delete(server, capsys, monkeypatch, tmp_path):
    admin = ("--url", server.url, "--admin-token", ADMIN_TOKEN)
    archive = shutil.make_archive(str(tmp_path / "robot"), "gztar", SAMPLES / "robot")
    out = run_cli(capsys, "adapters", "upload", "cli-robot", archive, "--description", "beeps", *admin)
    assert out.startswith("uploaded cli-robot: rank 8, q_proj, k_proj, v_proj, o_proj")
    run_cli(capsys, "adapters", "upload", "cli-robot-2", str(SAMPLES / "pirate"), *admin)
    replaced = run_cli(capsys, "adapters", "upload", "cli-robot-2", str(SAMPLES / "robot"), "--replace", *admin)
    assert replaced.startswith("replaced cli-robot-2: rank 8")
    versions = json.loads(run_cli(capsys, "adapters", "show", "cli-robot-2", *admin))["versions"]
    assert [v["current"] for v in versions] == [False, True]
    rolled = run_cli(capsys, "adapters", "rollback", "cli-robot-2", versions[0]["sha256"], *admin)
    assert rolled.strip() == f"cli-robot-2 serves {versions[0]['sha256']} again"
    listing = run_cli(capsys, "adapters", "list", *admin)
    assert listing.splitlines()[0].split()[:2] == ["NAME", "STATUS"]
    assert "cli-robot    ready" in listing and "beeps" in listing
    shown = json.loads(run_cli(capsys, "adapters", "show", "cli-robot", *admin))
    assert shown["name"] == "cli-robot" and shown["description"] == "beeps"

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    chat = run_cli(capsys, "chat", "cli-robot", "--url", server.url, "--max-tokens", "12", "--temperature", "0")
    assert chat.startswith("chatting with cli-robot")
    reply = chat.split("cli-robot> ", 1)[1]
    assert reply.strip(), "a streamed answer was printed"

    mixed = run_cli(capsys, "adapters", "mix", "cli-robot", "cli-robot-2", "--weights", "0.6", "0.4",
                    "--prompt", "Hello there", "--max-tokens", "8", *admin)  # fmt: skip
    assert "404" not in mixed and mixed.strip(), "the mix's reply was printed"
    with pytest.raises(SystemExit, match=r"400: merged_adapters\.weights"):
        main(["adapters", "mix", "cli-robot", "--weights", "1", "2", "--prompt", "Hi", *admin])

    assert run_cli(capsys, "adapters", "delete", "cli-robot", *admin).strip() == "deleted cli-robot"
    with pytest.raises(SystemExit, match="404: no adapter named 'cli-robot'"):
        main(["adapters", "show", "cli-robot", *admin])
    with pytest.raises(SystemExit, match="403: invalid admin token"):
        main(["adapters", "list", "--url", server.url, "--admin-token", "wrong-token"])


def test_auth_shows_and_sets_the_inference_mode(loaded_model, tmp_path, capsys):
    for server in start_server(loaded_model, tmp_path):
        admin = ("--url", server.url, "--admin-token", ADMIN_TOKEN)
        assert run_cli(capsys, "auth", *admin).strip() == "inference: open (any client); 0 stored keys"
        closed = run_cli(capsys, "auth", "keys", *admin)
        assert closed.startswith("inference: keys (an API key (or the admin token) is needed)")
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
        assert run_cli(capsys, "auth", "open", *admin).startswith("inference: open")
