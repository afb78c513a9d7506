"""Import directions the design relies on: a torch-free scheduler side, a self-contained kernel package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loraserve"
TORCH_FREE = [
    "engine/scheduler.py",
    "engine/block_manager.py",
    "engine/sequence.py",
    "engine/batch.py",
    "engine/stop_checker.py",
    "engine/detokenizer.py",
    "engine/sampling_params.py",
    "engine/outputs.py",
]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_scheduler_side_imports_no_torch():
    for relative in TORCH_FREE:
        seen, todo = set(), [PACKAGE / relative]
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            for name in _imports(path):
                assert not name.startswith("torch"), f"{relative} reaches torch through {path.name}"
                if name.startswith("loraserve."):
                    module = PACKAGE.parent / (name.replace(".", "/") + ".py")
                    if module.is_file():
                        todo.append(module)


def test_sgmv_kernels_import_nothing_from_loraserve():
    for path in (ROOT / "sgmv_kernels").glob("*.py"):
        assert not any(name.startswith("loraserve") for name in _imports(path)), path.name
