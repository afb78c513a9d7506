"""Writing results into the pages of docs/benchmarks/: one marked section per benchmark, the rest kept
(docs/benchmarks.md sums up the pages' current figures by hand)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import triton

from loraserve.config import DTYPES, ModelConfig
from loraserve.models.dtypes import cpu_has_bf16_dot_products, cpu_has_native_bf16


def machine_description(device: str = "cpu") -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return (
            f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}"
        )
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    threads = torch.get_num_threads()
    return f"{_cpu_name()}, {os.cpu_count()} cores ({cpu_isa()}; {bf16}), torch {torch.__version__}, {threads} threads"


def weights_modes() -> list[str]:
    """The compute:weights pairs this CPU runs, for the benchmarks that compare them."""
    modes = ["float32:float32", "float32:bfloat16", "float32:int8"]
    if cpu_has_bf16_dot_products():
        modes.append("float32:bfloat16-dot")
    if cpu_has_native_bf16():
        modes += ["bfloat16:bfloat16", "bfloat16:int8"]
    return modes


_ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
              "avx_vnni": "AVX-VNNI", "amx_bf16": "AMX"}  # fmt: skip


def cpu_isa() -> str:
    """The vector extensions the kernels can use here, e.g. 'AVX2' or 'AVX-512, AVX512-BF16, AVX512-VNNI, AMX'."""
    flags = set(_cpu_fields().get("flags", "").split())
    found = [name for flag, name in _ISA_FLAGS.items() if flag in flags]
    if "AVX-512" in found:
        found.remove("AVX2")
    return ", ".join(found) or platform.machine()


def cpu_class_suffix() -> str:
    """The suffix of the sections whose figures depend on the CPU class, so a run on one class does not
    replace another's: none on an AVX-512 CPU without AMX, "-amx" with it (bfloat16 compute and tiles),
    "-avx2" on an AVX2-only one, else "-" and the machine."""
    isa = cpu_isa()
    if "AVX-512" in isa:
        return "-amx" if "AMX" in isa else ""
    return "-avx2" if "AVX2" in isa else f"-{platform.machine().lower()}"


def cpu_class_title() -> str:
    """What a section's title adds for its CPU class (see cpu_class_suffix)."""
    titles = {"": "", "-amx": " (AMX)", "-avx2": " (AVX2 only)"}
    return titles.get(cpu_class_suffix(), f" ({platform.machine()})")


def _cpu_name() -> str:
    """The CPU's model name with its family and model numbers: VMs that all call themselves
    "AMD EPYC" differ by generation (family 25 model 17 is a Zen 4, family 26 a Zen 5)."""
    fields = _cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _cpu_fields() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields (none where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the section between `<!-- name:start -->` and `<!-- name:end -->`, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def run_suffix(systems: list[str], full: set[str]) -> str:
    """ "" when `systems` covers the full comparison `full`; else "-" and the peers run, so a run
    of some of them gets a section and plots of its own instead of replacing the full one."""
    if set(systems) >= full:
        return ""
    return "".join(f"-{name}" for name in systems if name != "loraserve")


def page(topic: str) -> Path:
    """docs/benchmarks/TOPIC.md: the page of one topic's sections and the readings written beside them."""
    return Path("docs/benchmarks") / f"{topic}.md"


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    """--output (where the section goes; a harness defaults it to its topic's page) and --quick (a smoke
    run that writes nothing), for every harness."""
    parser.add_argument("--output", type=Path, default=None, help="default: its page of docs/benchmarks/")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --device and --dtype: the default model on the CPU, in the dtype the server would pick."""
    parser.add_argument("--model", default=None, help="HF safetensors directory (default: the embedded model)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--random-weights", action="store_true",
        help="seeded random weights made on the device: --model needs only config.json and a tokenizer "
        "(python -m benchmarks.random_model --shapes llama3-8b OUT writes one)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES,
        help="auto (default), as the server picks: bfloat16 on CUDA or a CPU with AMX, else float32",
    )  # fmt: skip


def model_config_of(args: argparse.Namespace, dtype: str | None = None) -> ModelConfig:
    """The model the flags of `add_model_flags` name, in `dtype` (default: --dtype)."""
    return ModelConfig(
        model=args.model, dtype=dtype or args.dtype, device=args.device, random_weights=args.random_weights
    )


def reproduce_command(module: str) -> str:
    """The command line that made this run, for the report."""
    return " ".join([f"python -m {module}", *sys.argv[1:]])


def bench_command(kind: str, argv: list[str] | None) -> str:
    """The command line of a `loraserve bench KIND` run: the CLI passes its options as argv, and
    `python -m benchmarks.KIND` leaves argv None and its options in sys.argv."""
    return reproduce_command(f"benchmarks.{kind}") if argv is None else " ".join([f"loraserve bench {kind}", *argv])


def median_spread(values: Sequence[float]) -> str:
    """'median (min-max)', whole numbers: how results are reported when repeats vary."""
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def not_run_row(label: str, reason: str, num_columns: int) -> str:
    """A table row saying why a system has no figures, padded to the table's columns."""
    return f"| {label} | not run: {reason} |" + " |" * (num_columns - 2)
