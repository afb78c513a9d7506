"""Import directions the design relies on: every module imports only from its own layer or below
(server -> engine -> lora/models -> memory and kernels), a torch-free scheduler side, a
self-contained kernel package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loraserve"
TORCH_FREE = [
    "engine/scheduler.py",
    "engine/admission.py",
    "engine/fair_share.py",
    "engine/adapter_admission.py",
    "engine/preemption.py",
    "engine/draft_budget.py",
    "engine/token_recorder.py",
    "engine/block_manager.py",
    "engine/sequence.py",
    "engine/batch.py",
    "engine/stop_checker.py",
    "engine/detokenizer.py",
    "engine/sampling_params.py",
    "engine/outputs.py",
    "engine/step_isolation.py",
]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# Layers by the first part of the module's path under loraserve/: higher ones may import lower ones.
LAYERS = {
    "__init__": 4, "cli": 4, "admin_client": 4, "chat_client": 4, "samples": 4,
    "cluster": 4,  # the single server, as Ray Serve replicas
    "server": 3,
    "engine": 2, "llm": 2, "registry": 2,
    "lora": 1, "models": 1,
    "memory": 0, "openmp": 0, "config": 0, "errors": 0, "resources": 0, "crash_points": 0, "file_digest": 0,
}  # fmt: skip


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def test_every_module_imports_only_its_layer_or_below():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        if "migrations" in relative.parts:
            continue  # Alembic's scripts, run by the registry
        own = _layer(module)
        for name in _imports(path):
            if (name == "loraserve" or name.startswith("loraserve.")) and _layer(name) > own:
                upward.append(f"{module} imports {name}")
    assert not upward, "imports against the layering: " + "; ".join(upward)


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


def test_peer_runners_import_only_the_standard_library_at_module_level():
    # Runners execute inside the peers' own environments, where neither loraserve nor torch may be
    # installed; each imports its system inside setup().
    import sys

    for path in (ROOT / "benchmarks" / "peers").glob("*.py"):
        if path.name == "envs.py":
            continue  # the orchestrator's side
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        for node in top:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                root = name.split(".")[0]
                assert root in sys.stdlib_module_names or root == "__future__" or name == "benchmarks.peers.job", (
                    f"{path.name} imports {name} at module level"
                )
