"""Import directions the design relies on: every module imports only from its own layer or below
(server -> engine -> lora/models -> memory and kernels), a torch-free scheduler side, a torch-free
package root and HTTP clients, a self-contained kernel package."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "__init__": 4, "cli": 4, "admin_client": 4, "chat_client": 4,
    "cluster": 4,  # the single server, as Ray Serve replicas
    "server": 3,
    "engine": 2, "llm": 2, "registry": 2, "tools": 2,
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


def _imports_no_torch(code: str) -> None:
    """Runs `code` in a fresh interpreter in the checkout (its loraserve first on the path), which must not have
    imported torch by its end."""
    code += "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_package_root_imports_no_torch():
    _imports_no_torch("import loraserve")


def test_the_cli_commands_that_are_clients_import_no_torch(tmp_path):
    """`loraserve adapters list` printed four lines in 4.5 s when the package root loaded the engine."""
    remote = ["--url", "http://127.0.0.1:9", "--admin-token", "unused-admin-token"]  # nothing answers: an error
    commands = [
        *(["adapters", *action, *remote] for action in (
            ["list"], ["show", "a"], ["delete", "a"], ["upload", "a", "missing"], ["rollback", "a", "0" * 64],
            ["mix", "a", "b", "--weights", "1", "1", "--prompt", "Hi"],
        )),
        ["auth", *remote], ["chat", "--url", "http://127.0.0.1:9"],
        ["registry", "check", "--data-dir", str(tmp_path / "data")],
    ]  # fmt: skip
    code = f"""
from loraserve.cli import main
for argv in {commands!r}:
    try:
        main(argv)
    except SystemExit:
        pass  # the error for an unreachable server
"""
    _imports_no_torch(code)


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


# Where the device may be named: the platforms (models/platform.py chooses one) and the kernels.
PLATFORMS = ("models/cpu/", "models/cuda/", "models/platform.py")
OUTSIDE_THE_PLATFORMS = {  # each with the reason it reaches CUDA or a compiled kernel itself
    "lora/backends.py": "the LoRA backend is the kernels' own seam, chosen once; Triton's side stream in a capture",
    "lora/slots.py": "an adapter's weights are copied on a CUDA side stream",
    "memory/pool.py": "the pool is sized from the device's free memory",
}


def _device_reaches(path: Path) -> list[str]:
    """The platform modules, compiled-kernel loaders and torch.cuda that `path` reaches."""
    reaches = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) == ("torch", "cuda"):
                reaches.append("torch.cuda")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [alias.name for alias in node.names]
            if node.module.startswith(("loraserve.models.cpu", "loraserve.models.cuda", "sgmv_kernels.build")):
                reaches.append(node.module)
            elif node.module == "sgmv_kernels.native" and any(name.startswith("load_") for name in names):
                reaches.append("sgmv_kernels.native's kernel loader")
        elif isinstance(node, ast.Import):
            reaches += [
                a.name for a in node.names if a.name.startswith(("loraserve.models.cpu", "loraserve.models.cuda"))
            ]
    return reaches


def test_only_the_platforms_and_the_kernels_reach_the_device():
    seen = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(PLATFORMS) or relative in OUTSIDE_THE_PLATFORMS:
            continue
        seen += [f"{relative}: {reach}" for reach in _device_reaches(path)]
    assert not seen, "device code outside the platforms (models/cpu, models/cuda): " + "; ".join(seen)
