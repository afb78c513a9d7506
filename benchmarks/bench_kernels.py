"""SGMV/BGMV kernels on a CUDA GPU: time, achieved memory bandwidth, and its share of the peak.

    python -m benchmarks.bench_kernels            # table into docs/benchmarks.md (needs CUDA)
    python -m benchmarks.bench_kernels --quick    # a smoke run, nothing written
    python -m benchmarks.bench_kernels --sweep    # launch shapes against each other, printed

Each case is the engine's form of the kernels (`sgmv_shrink_group` / `sgmv_expand_group`): the
projections that share an input (q/k/v, gate/up) in one launch each, rows of one adapter in
one segment. A decode step's rows come sorted by adapter, so 64 rows over 32 adapters are
32 segments of 2; a row per adapter (BGMV's case) is a segment per row.

LoRA shrink and expand move far more bytes than they compute (a rank-16 adapter does 32
flops per weight it reads), so the yardstick is memory bandwidth. Bytes counted are the
fewest a launch must move: x (or y), the rows of every distinct adapter once, and the
output (the expand reads and writes it); the shrink's split-K partials, which the expand
sums as it reads them, are overhead and not counted. Peak is measured, not taken from a
datasheet: a large device-to-device copy, bytes read plus written. Each case is checked
against the torch reference before it is timed. Kernel times are medians of CUDA-graph
replays (`do_bench_cudagraph`: the GPU's time, without Python's launch gaps); the time of
one call from Python (`do_bench`) is reported beside them, since at these sizes launching
costs more than computing. The adapters' rows are scattered over a pool as the engine
keeps them.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.report import add_report_flags, reproduce_command, write_section
from sgmv_kernels import (
    expand,
    pool_from_dense,
    sgmv_expand_group,
    sgmv_expand_reference,
    sgmv_shrink_group,
    sgmv_shrink_reference,
    shrink,
)
from sgmv_kernels.layout import PooledLora

SECTION = "kernels-gpu"
PAIRS = [2] * 32  # a decode step of 64 rows over 32 adapters, sorted by adapter


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    in_features: int
    widths: list[int]  # the projections sharing x, side by side in the output
    rows_per_adapter: list[int]  # one segment per entry, each its own adapter
    rank: int
    prompt: bool = False  # rows spread over programs, as in an eager step; decode runs as in a CUDA graph


def cases(quick: bool) -> list[Case]:
    decode = [
        Case("SmolLM2 q/k/v, decode", 576, [576, 192, 192], PAIRS, 16),
        Case("SmolLM2 gate/up, decode", 576, [1536, 1536], PAIRS, 16),
        Case("SmolLM2 down, decode", 1536, [576], PAIRS, 16),
        Case("Llama-8B q/k/v, decode", 4096, [4096, 1024, 1024], PAIRS, 16),
        Case("Llama-8B o, decode", 4096, [4096], PAIRS, 16),
        Case("Llama-8B gate/up, decode", 4096, [14336, 14336], PAIRS, 16),
        Case("Llama-8B down, decode", 14336, [4096], PAIRS, 16),
        Case("Llama-8B q/k/v, decode, a row per adapter (BGMV)", 4096, [4096, 1024, 1024], [1] * 64, 16),
        Case("Llama-8B gate/up, decode, a row per adapter (BGMV)", 4096, [14336, 14336], [1] * 64, 16),
        Case("Llama-8B q/k/v, decode, rank 64", 4096, [4096, 1024, 1024], PAIRS, 64),
    ]
    prefill = [
        Case("Llama-8B q/k/v, prefill", 4096, [4096, 1024, 1024], [128] * 8, 16, prompt=True),
        Case("Llama-8B gate/up, prefill", 4096, [14336, 14336], [256] * 4, 16, prompt=True),
    ]
    return [decode[0], prefill[0]] if quick else decode + prefill


def peak_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read and write."""
    from triton.testing import do_bench

    source = torch.randn(1 << 28, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), warmup=50, rep=200, return_mode="median")
    return 2 * source.numel() * source.element_size() / (ms * 1e-3)


@dataclasses.dataclass
class Prepared:
    """One case's inputs on the GPU and the reference results (computed on the CPU)."""

    pooled: list[PooledLora]
    group: tuple[torch.Tensor, ...]  # pool, a_rows, b_rows, ranks, scales as the engine groups them
    indptr: torch.Tensor
    seg_slots: torch.Tensor
    x: torch.Tensor
    out: torch.Tensor
    y_ref: list[torch.Tensor]
    out_ref: torch.Tensor


def prepare(case: Case, dtype: torch.dtype) -> Prepared:
    gen = torch.Generator().manual_seed(0)
    num_slots = len(case.rows_per_adapter)
    ranks = torch.full((num_slots,), case.rank, dtype=torch.int32)
    pooled = []
    for width in case.widths:
        lora_a = torch.randn(num_slots, case.rank, case.in_features, generator=gen) / case.in_features**0.5
        lora_b = torch.randn(num_slots, width, case.rank, generator=gen) / case.rank**0.5
        scales = torch.rand(num_slots, generator=gen)
        pooled.append(pool_from_dense(lora_a.to(dtype), lora_b.to(dtype), ranks, scales, gen))
    indptr = torch.tensor([0, *torch.tensor(case.rows_per_adapter).cumsum(0).tolist()], dtype=torch.int32)
    seg_slots = torch.arange(num_slots, dtype=torch.int32)
    x = torch.randn(int(indptr[-1]), case.in_features, generator=gen).to(dtype)
    out = torch.randn(x.shape[0], sum(case.widths), generator=gen).to(dtype)
    y_ref, out_ref, column = [], out.clone(), 0
    for w, width in zip(pooled, case.widths, strict=True):
        y_ref.append(sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots))
        part = out_ref[:, column : column + width]
        sgmv_expand_reference(y_ref[-1], w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, part)
        column += width
    return Prepared(pooled, engine_group(pooled), indptr.cuda(), seg_slots.cuda(), x.cuda(), out.cuda(), y_ref, out_ref)


def engine_group(pooled: list[PooledLora]) -> tuple[torch.Tensor, ...]:
    """The projections' rows in one pool and [P, slots, rank] tables, as lora/slots.py keeps a layer's."""
    offsets = torch.tensor([0, *[w.pool.numel() for w in pooled]]).cumsum(0).tolist()
    pool = torch.cat([w.pool for w in pooled]).cuda()
    a_rows = torch.stack([w.a_rows + offset for w, offset in zip(pooled, offsets, strict=False)]).cuda()
    b_rows = torch.stack([w.b_rows + offset for w, offset in zip(pooled, offsets, strict=False)]).cuda()
    ranks = torch.stack([w.ranks for w in pooled]).cuda()
    return pool, a_rows, b_rows, ranks, torch.stack([w.scales for w in pooled]).cuda()


def launches(case: Case, p: Prepared, out: torch.Tensor):
    """(shrink, expand, partials): the two launches as callables; expand reads the partials of one
    shrink and adds to `out`."""
    pool, a_rows, b_rows, ranks, scales = p.group
    longest = max(case.rows_per_adapter) if case.prompt else None

    def run_shrink() -> torch.Tensor:
        return sgmv_shrink_group(p.x, pool, a_rows, ranks, p.indptr, p.seg_slots, longest)

    partials = run_shrink()

    def run_expand() -> None:
        sgmv_expand_group(partials, pool, b_rows, ranks, scales, p.indptr, p.seg_slots, out, case.widths, longest)

    return run_shrink, run_expand, partials


def bench_case(case: Case, p: Prepared, dtype: torch.dtype, peak: float, rep: int = 100) -> dict[str, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    out = p.out.clone()
    run_shrink, run_expand, partials = launches(case, p, out)
    # Correct first: the kernels against the torch reference on the CPU.
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    for projection, y_ref in enumerate(p.y_ref):  # every row has an adapter of the pool's full rank
        torch.testing.assert_close(partials[:, projection].sum(0).cpu(), y_ref, **tolerance)
    run_expand()
    torch.testing.assert_close(out.cpu(), p.out_ref, **tolerance)
    timings = {
        "shrink": do_bench_cudagraph(run_shrink, rep=rep, return_mode="median"),
        "expand": do_bench_cudagraph(run_expand, rep=rep, return_mode="median"),
        "python": do_bench(lambda: (run_shrink(), run_expand()), warmup=25, rep=rep, return_mode="median"),
    }
    x_rows, adapters, item = p.x.shape[0], len(case.rows_per_adapter), torch.finfo(dtype).bits // 8
    projections, out_features = len(case.widths), sum(case.widths)
    y_bytes = x_rows * case.rank * 4 * projections
    moved = {
        "shrink": x_rows * case.in_features * item
        + adapters * case.rank * case.in_features * item * projections
        + y_bytes,
        "expand": y_bytes + adapters * case.rank * out_features * item + 2 * x_rows * out_features * item,
    }
    result = {"rows": x_rows, "adapters": adapters, "splits": partials.shape[0]}
    for op in ("shrink", "expand"):
        seconds = timings[op] * 1e-3
        result[f"{op}_us"] = seconds * 1e6
        result[f"{op}_gbs"] = moved[op] / seconds / 1e9
        result[f"{op}_peak"] = moved[op] / seconds / peak
    result["python_us"] = timings["python"] * 1e3
    return result


SWEEP = {  # module attribute -> values tried, one at a time against the defaults
    (shrink, "BLOCK_K"): [64, 128, 256],
    (shrink, "SPLIT_WAVES"): [1, 2, 4, 8],
    (shrink, "NUM_WARPS"): [2, 4, 8],
    (expand, "NUM_WARPS"): [2, 4, 8],
    (expand, "SINGLE_COLUMN_BLOCK"): [64, 128, 256],
}


def sweep(peak: float) -> None:
    """Each launch parameter varied alone over the Llama-8B decode cases (bfloat16): us per launch."""
    decode = [case for case in cases(False) if case.label.startswith("Llama-8B") and case.rows_per_adapter == PAIRS]
    decode = [case for case in decode if case.rank == 16]
    prepared = [prepare(case, torch.bfloat16) for case in decode]
    for (module, name), values in SWEEP.items():
        default = getattr(module, name)
        for value in values:
            setattr(module, name, value)
            try:
                times = [
                    bench_case(case, p, torch.bfloat16, peak, rep=30) for case, p in zip(decode, prepared, strict=True)
                ]
            finally:
                setattr(module, name, default)
            total = sum(t["shrink_us"] + t["expand_us"] for t in times)
            detail = ", ".join(f"{t['shrink_us']:.1f}+{t['expand_us']:.1f}" for t in times)
            mark = " (default)" if value == default else ""
            print(f"sweep {module.__name__}.{name}={value}{mark}: {total:.1f} us per layer [{detail}]", flush=True)


def render(results: list[tuple[Case, str, dict[str, float]]], peak: float, command: str) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "## SGMV/BGMV kernels on a GPU",
        "",
        f"Command: `{command}`. Device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}.",
        f"Measured peak (1 GiB device-to-device copy, read + write): **{peak / 1e9:.0f} GB/s**.",
        "",
        "Each row is the engine's launch pair for one projection group (q/k/v or gate/up together) over "
        "adapters of one rank scattered in a pool: decode rows sorted by adapter (64 rows over 32 adapters: "
        "segments of 2), or a row per adapter (BGMV), or prompts (SGMV). Bytes: x or y, each adapter's rows "
        "once, and the output (read and written by the expand); the split-K partials the expand sums are not "
        "counted. Medians of CUDA-graph replays; correctness against the torch reference checked first.",
        "",
        "| case | dtype | rows | adapters x rank | K splits | shrink us | GB/s | of peak | expand us | GB/s "
        "| of peak | shrink + expand called from Python, us |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, dtype, r in results:
        lines.append(
            f"| {case.label} | {dtype} | {r['rows']:.0f} | {r['adapters']:.0f} x {case.rank} | {r['splits']:.0f} | "
            f"{r['shrink_us']:.1f} | {r['shrink_gbs']:.0f} | {r['shrink_peak']:.0%} | "
            f"{r['expand_us']:.1f} | {r['expand_gbs']:.0f} | {r['expand_peak']:.0%} | {r['python_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--sweep", action="store_true", help="time launch parameters against each other")
    add_report_flags(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    peak = peak_bandwidth()
    print(f"peak {peak / 1e9:.0f} GB/s", flush=True)
    if args.sweep:
        sweep(peak)
        return
    results = []
    for dtype_name in args.dtypes:
        for case in cases(args.quick):
            dtype = getattr(torch, dtype_name)
            r = bench_case(case, prepare(case, dtype), dtype, peak)
            results.append((case, dtype_name, r))
            print(
                f"{case.label} {dtype_name}: shrink {r['shrink_us']:.1f} us {r['shrink_peak']:.0%} of peak, "
                f"expand {r['expand_us']:.1f} us {r['expand_peak']:.0%}, from Python {r['python_us']:.0f} us",
                flush=True,
            )
    body = render(results, peak, reproduce_command("benchmarks.bench_kernels"))
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
