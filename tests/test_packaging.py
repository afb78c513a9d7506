"""The wheel serves: built from this checkout, installed into a fresh virtual environment and
started from a directory outside the checkout, it migrates its registry, serves the admin page
and registers the four sample adapters, all read from inside the installed package (the
checkout's top-level adapters/, admin_ui/ and migrations/, mapped into it by pyproject.toml).

The new environment installs only the wheel; its dependencies (the local CPU torch among them)
come from the test's own environment through a path file, which adds that directory to
sys.path without running its .pth files, so the checkout's editable install stays out."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from loraserve.resources import MIGRATIONS_DIR
from tests.server.conftest import free_port
from tests.server.server_process import ServerProcess, wait_until_ready

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "packaging-test-admin-token-0123456789"
SAMPLES = ["french-tutor", "pirate", "robot", "shakespeare"]


def run(*command: str | Path, cwd: Path) -> None:
    subprocess.run([str(part) for part in command], cwd=cwd, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The virtual environment's bin directory, with the wheel of this checkout installed."""
    work = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist", ROOT,
        cwd=work)  # fmt: skip
    (wheel,) = (work / "dist").glob("loraserve-*.whl")
    venv = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel, cwd=work)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version / "site-packages" / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"])
    return venv / "bin"


def test_pyproject_lists_every_package_of_the_checkout():
    """setuptools' find cannot map the top-level directories into the package, so pyproject lists the packages: a
    directory added to the checkout and not to the list would be missing from the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"loraserve": ROOT / "loraserve", "sgmv_kernels": ROOT / "sgmv_kernels"}
    roots.update({name: ROOT / path for name, path in setuptools["package-dir"].items()})
    found = {
        ".".join([name, *directory.relative_to(root).parts])
        for name, root in roots.items()
        for directory in [root, *root.rglob("*")]
        if directory.is_dir() and "__pycache__" not in directory.parts
    }
    assert set(setuptools["packages"]) == found


@pytest.mark.slow
def test_the_installed_wheel_serves_from_outside_the_checkout(installed, tmp_path):
    package = subprocess.run(
        [installed / "python", "-c", "import loraserve; print(loraserve.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert not package.startswith(str(ROOT)), f"imported the checkout, not the wheel: {package}"
    port, data_dir = free_port(), tmp_path / "data"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [installed / "loraserve", "serve", "--port", str(port), "--data-dir", data_dir, "--admin-token", TOKEN]
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(ServerProcess(server, url, log))
        assert httpx.get(f"{url}/health").status_code == 200
        page = httpx.get(f"{url}/admin/ui/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(f"{url}/admin/ui/api.js").status_code == 200
        admin = {"Authorization": f"Bearer {TOKEN}"}
        listed = httpx.get(f"{url}/admin/adapters", headers=admin).json()
        assert sorted(adapter["name"] for adapter in listed["data"]) == SAMPLES
        models = {model["id"] for model in httpx.get(f"{url}/v1/models").json()["data"]}
        assert set(SAMPLES) <= models
    finally:
        server.kill()
        server.wait(timeout=30)
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    with sqlite3.connect(data_dir / "registry.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
