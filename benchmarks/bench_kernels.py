"""SGMV/BGMV kernels on a CUDA GPU: time, achieved memory bandwidth, and its share of the peak.

    python -m benchmarks.bench_kernels            # table into docs/benchmarks.md (needs CUDA)
    python -m benchmarks.bench_kernels --quick    # a smoke run, nothing written

LoRA shrink and expand move far more bytes than they compute (a rank-16 adapter does 32
flops per weight it reads), so the yardstick is memory bandwidth. Bytes counted are the
fewest a launch must move: x (or y), the rows of every distinct adapter once, and the
output (the expand reads and writes it). Peak is measured, not taken from a datasheet: a
large device-to-device copy, bytes read plus written. Each case is checked against the
torch reference before it is timed. Kernel times are medians of CUDA-graph replays
(`do_bench_cudagraph`: the GPU's time, without Python's launch gaps); the time of one
call from Python (`do_bench`) is reported beside them, since at these sizes launching
costs more than computing. The adapters' rows are scattered over a pool as the engine
keeps them. For context, the same shrink through torch (gather + bmm) is timed too.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch

from benchmarks.report import add_report_flags, reproduce_command, write_section
from sgmv_kernels import (
    PooledLora,
    bgmv_expand,
    bgmv_shrink,
    pool_from_dense,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from sgmv_kernels.cpu import bgmv_shrink_gathered

SECTION = "kernels-gpu"


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    in_features: int
    out_features: int
    rows_per_adapter: list[int]  # one segment per entry, each its own adapter
    rank: int
    decode: bool  # BGMV (one row each) or SGMV (segments)


def cases(quick: bool) -> list[Case]:
    decode = [
        Case("SmolLM2 gate/up, decode", 576, 1536, [1] * 64, 16, True),
        Case("SmolLM2 down, decode", 1536, 576, [1] * 64, 16, True),
        Case("Llama-8B q/o, decode", 4096, 4096, [1] * 64, 16, True),
        Case("Llama-8B gate/up, decode", 4096, 14336, [1] * 64, 16, True),
        Case("Llama-8B down, decode", 14336, 4096, [1] * 64, 16, True),
        Case("Llama-8B q/o, decode, rank 64", 4096, 4096, [1] * 64, 64, True),
        Case("Llama-8B q/o, decode, 256 rows", 4096, 4096, [1] * 256, 16, True),
    ]
    prefill = [
        Case("SmolLM2 gate/up, prefill", 576, 1536, [128] * 8, 16, False),
        Case("Llama-8B q/o, prefill", 4096, 4096, [128] * 8, 16, False),
        Case("Llama-8B gate/up, prefill", 4096, 14336, [256] * 4, 16, False),
    ]
    return [decode[0], prefill[0]] if quick else decode + prefill


def peak_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read and write."""
    from triton.testing import do_bench

    source = torch.randn(1 << 28, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), warmup=50, rep=200, return_mode="median")
    return 2 * source.numel() * source.element_size() / (ms * 1e-3)


def make_case(case: Case, dtype: torch.dtype, gen: torch.Generator):
    num_slots = len(case.rows_per_adapter)
    lora_a = torch.randn(num_slots, case.rank, case.in_features, generator=gen) / case.in_features**0.5
    lora_b = torch.randn(num_slots, case.out_features, case.rank, generator=gen) / case.rank**0.5
    ranks = torch.full((num_slots,), case.rank, dtype=torch.int32)
    scales = torch.rand(num_slots, generator=gen)
    pooled = pool_from_dense(lora_a.to(dtype), lora_b.to(dtype), ranks, scales, gen)
    indptr = torch.tensor([0, *torch.tensor(case.rows_per_adapter).cumsum(0).tolist()], dtype=torch.int32)
    seg_slots = torch.arange(num_slots, dtype=torch.int32)
    x = torch.randn(int(indptr[-1]), case.in_features, generator=gen).to(dtype)
    return pooled, indptr, seg_slots, x


def to_cuda(pooled: PooledLora) -> PooledLora:
    return PooledLora(*(t.cuda() for t in dataclasses.astuple(pooled)))


def bench_case(case: Case, dtype: torch.dtype, peak: float) -> dict[str, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    gen = torch.Generator().manual_seed(0)
    pooled, indptr, seg_slots, x = make_case(case, dtype, gen)
    out = torch.randn(x.shape[0], case.out_features, generator=gen).to(dtype)
    # Correct first: the kernels against the torch reference on the CPU.
    y_ref = sgmv_shrink_reference(x, pooled.pool, pooled.a_rows, pooled.ranks, indptr, seg_slots)
    out_ref = out.clone()
    sgmv_expand_reference(y_ref, pooled.pool, pooled.b_rows, pooled.ranks, pooled.scales, indptr, seg_slots, out_ref)
    w, x_c, out_c = to_cuda(pooled), x.cuda(), out.cuda()
    indptr_c, slots_c = indptr.cuda(), seg_slots.cuda()
    longest = max(case.rows_per_adapter)
    if case.decode:
        shrink = partial(bgmv_shrink, x_c, w.pool, w.a_rows, w.ranks, slots_c)
        y = shrink()
        expand = partial(bgmv_expand, y, w.pool, w.b_rows, w.ranks, w.scales, slots_c, out_c)
    else:
        shrink = partial(sgmv_shrink, x_c, w.pool, w.a_rows, w.ranks, indptr_c, slots_c, longest)
        y = shrink()
        expand = partial(sgmv_expand, y, w.pool, w.b_rows, w.ranks, w.scales, indptr_c, slots_c, out_c, longest)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(y.cpu(), y_ref, **tolerance)
    expand()
    torch.testing.assert_close(out_c.cpu(), out_ref, **tolerance)
    torch_shrink = partial(bgmv_shrink_gathered, x_c, w.pool, w.a_rows, w.ranks, slots_of_rows(indptr_c))
    timings = {
        "shrink": do_bench_cudagraph(shrink, rep=100, return_mode="median"),
        "expand": do_bench_cudagraph(expand, rep=100, return_mode="median"),
        "torch_shrink": do_bench(torch_shrink, warmup=25, rep=100, return_mode="median"),  # it syncs: no graph
        "python": do_bench(lambda: (shrink(), expand()), warmup=25, rep=100, return_mode="median"),
    }
    rows, adapters, item = x.shape[0], len(case.rows_per_adapter), torch.finfo(dtype).bits // 8
    a_bytes = adapters * case.rank * case.in_features * item
    b_bytes = adapters * case.rank * case.out_features * item
    y_bytes = rows * case.rank * 4
    moved = {
        "shrink": rows * case.in_features * item + a_bytes + y_bytes,
        "expand": y_bytes + b_bytes + 2 * rows * case.out_features * item,
    }
    result = {"rows": rows, "adapters": adapters}
    for op in ("shrink", "expand"):
        seconds = timings[op] * 1e-3
        result[f"{op}_us"] = seconds * 1e6
        result[f"{op}_gbs"] = moved[op] / seconds / 1e9
        result[f"{op}_peak"] = moved[op] / seconds / peak
    result["torch_shrink_us"] = timings["torch_shrink"] * 1e3
    result["python_us"] = timings["python"] * 1e3
    return result


def slots_of_rows(indptr: torch.Tensor) -> torch.Tensor:
    """Each row's adapter slot (segment s is slot s)."""
    lengths = indptr.diff()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=indptr.device, dtype=torch.int32), lengths)


def render(results: list[tuple[Case, str, dict[str, float]]], peak: float, command: str) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "## SGMV/BGMV kernels on a GPU",
        "",
        f"Command: `{command}`. Device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}.",
        f"Measured peak (1 GiB device-to-device copy, read + write): **{peak / 1e9:.0f} GB/s**.",
        "",
        "Each row is one adapter-batched launch over adapters of one rank scattered in a pool, every row "
        "(decode, BGMV) or every segment (prefill, SGMV) its own adapter. Bytes: x or y, each adapter's rows "
        "once, and the output (read and written by the expand). Medians of `do_bench`; correctness against the "
        "torch reference checked first.",
        "",
        "| case | dtype | rows | adapters x rank | shrink us | GB/s | of peak | expand us | GB/s | of peak "
        "| torch gather+bmm shrink us | shrink + expand called from Python, us |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, dtype, r in results:
        lines.append(
            f"| {case.label} | {dtype} | {r['rows']:.0f} | {r['adapters']:.0f} x {case.rank} | "
            f"{r['shrink_us']:.1f} | {r['shrink_gbs']:.0f} | {r['shrink_peak']:.0%} | "
            f"{r['expand_us']:.1f} | {r['expand_gbs']:.0f} | {r['expand_peak']:.0%} | {r['torch_shrink_us']:.1f} | "
            f"{r['python_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    add_report_flags(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    peak = peak_bandwidth()
    print(f"peak {peak / 1e9:.0f} GB/s", flush=True)
    results = []
    for dtype_name in args.dtypes:
        for case in cases(args.quick):
            r = bench_case(case, getattr(torch, dtype_name), peak)
            results.append((case, dtype_name, r))
            print(
                f"{case.label} {dtype_name}: shrink {r['shrink_us']:.1f} us {r['shrink_peak']:.0%} of peak, "
                f"expand {r['expand_us']:.1f} us {r['expand_peak']:.0%}, torch shrink {r['torch_shrink_us']:.1f} us",
                flush=True,
            )
    body = render(results, peak, reproduce_command("benchmarks.bench_kernels"))
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
