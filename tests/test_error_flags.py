"""Every flag an error message tells the user to change exists in `loraserve serve --help`:
a message naming `--block-size` is useless if serve has no such flag."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import loraserve

PACKAGE = Path(loraserve.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
NOT_OURS = {"--no-deps"}  # pip's, in the message that says how to install the default model


def strings_outside_docstrings(tree: ast.Module) -> list[str]:
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def flags_in_messages() -> dict[str, list[str]]:
    """Flag -> the files whose strings name it; cli.py, which defines the flags, left out."""
    named: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "cli.py":
            continue
        for text in strings_outside_docstrings(ast.parse(path.read_text())):
            for flag in FLAG.findall(text):
                named.setdefault(flag, []).append(str(path.relative_to(PACKAGE)))
    return named


def test_every_flag_an_error_names_is_a_serve_or_cluster_flag():
    offered = set()
    for command in ("serve", "cluster"):
        usage = subprocess.run(
            [sys.executable, "-m", "loraserve.cli", command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        offered |= set(FLAG.findall(usage))
    named = flags_in_messages()
    assert "--block-size" in named and "--pool-memory" in named, "the scan finds the config's messages"
    missing = {flag: files for flag, files in named.items() if flag not in offered and flag not in NOT_OURS}
    assert not missing, f"messages name flags neither serve nor cluster has: {missing}"
