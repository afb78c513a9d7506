"""SGMV/BGMV kernels on a CUDA GPU: time, achieved memory bandwidth, and its share of the peak.

    python -m benchmarks.bench_kernels            # table into docs/benchmarks/gpu.md (needs CUDA)
    python -m benchmarks.bench_kernels --quick    # a smoke run, nothing written
    python -m benchmarks.bench_kernels --sweep    # launch shapes against each other, then the table
    python -m benchmarks.bench_kernels --sweep --write-tuned   # and keep the winner for this GPU

Each case is the engine's form of the kernels (`sgmv_shrink_group` / `sgmv_expand_group`): the
projections that share an input (q/k/v, gate/up) in one launch each, rows of one adapter in
one segment. A decode step's rows come sorted by adapter, so 64 rows over 32 adapters are
32 segments of 2; a row per adapter (BGMV's case) is a segment per row.

LoRA shrink and expand move far more bytes than they compute (a rank-16 adapter does 32
flops per weight it reads), so the yardstick is memory bandwidth. Bytes counted are the
fewest a launch must move: x (or y), the rows of every distinct adapter once, and the
output (the expand reads and writes it); the shrink's split-K partials, which its last split
sums, are overhead and not counted. Peak is measured, not taken from a
datasheet: a large device-to-device copy, bytes read plus written. Each case is checked
against the torch reference before it is timed. Kernel times are medians of CUDA-graph
replays (`do_bench_cudagraph`: the GPU's time, without Python's launch gaps), once with warm
caches and once "cold": L2 flushed before every launch, as a decode step meets the adapters
after streaming the base weights through L2. The time of one call from Python (`do_bench`)
is reported beside them, since at these sizes launching costs more than computing. The
adapters' rows are scattered over a pool as the engine keeps them.

The sweep tries every launch shape of a grid (sgmv_kernels/launch.py) on the Llama-8B decode
cases and ranks them by the cold time of a layer's four launch pairs: the shrink's grid with
the default expand, then the expand's with the best shrink. `--write-tuned` records the
winner in sgmv_kernels/tuned/ for this GPU's name, which the kernels then launch with.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from collections.abc import Callable

import torch

from benchmarks.report import add_report_flags, page, reproduce_command, write_section
from sgmv_kernels import (
    pool_from_dense,
    sgmv_expand_group,
    sgmv_expand_reference,
    sgmv_shrink_group,
    sgmv_shrink_reference,
)
from sgmv_kernels.launch import DEFAULT, ExpandShape, LaunchShapes, ShrinkShape, forced, shapes_for, write_tuned
from sgmv_kernels.layout import PooledLora, row_alignment
from sgmv_kernels.shrink import k_splits

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
    alignment: int  # of every row offset, as the engine tells the kernels
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
    if not case.prompt:  # as a CUDA graph lays decode out: a segment per row, the unused ones empty
        rows = int(indptr[-1])
        indptr = torch.cat([indptr, indptr[-1:].expand(rows - num_slots)])
        seg_slots = torch.cat([seg_slots, torch.full((rows - num_slots,), -1, dtype=torch.int32)])
    x = torch.randn(int(indptr[-1]), case.in_features, generator=gen).to(dtype)
    out = torch.randn(x.shape[0], sum(case.widths), generator=gen).to(dtype)
    y_ref, out_ref, column = [], out.clone(), 0
    for w, width in zip(pooled, case.widths, strict=True):
        y_ref.append(sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots))
        part = out_ref[:, column : column + width]
        sgmv_expand_reference(y_ref[-1], w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, part)
        column += width
    group = engine_group(pooled)
    alignment = row_alignment(*group[1].flatten().tolist(), *group[2].flatten().tolist())
    return Prepared(pooled, group, alignment, indptr.cuda(), seg_slots.cuda(), x.cuda(), out.cuda(), y_ref, out_ref)


def engine_group(pooled: list[PooledLora]) -> tuple[torch.Tensor, ...]:
    """The projections' rows in one pool and [P, slots, rank] tables, as lora/slots.py keeps a layer's."""
    offsets = torch.tensor([0, *[w.pool.numel() for w in pooled]]).cumsum(0).tolist()
    pool = torch.cat([w.pool for w in pooled]).cuda()
    a_rows = torch.stack([w.a_rows + offset for w, offset in zip(pooled, offsets, strict=False)]).cuda()
    b_rows = torch.stack([w.b_rows + offset for w, offset in zip(pooled, offsets, strict=False)]).cuda()
    ranks = torch.stack([w.ranks for w in pooled]).cuda()
    return pool, a_rows, b_rows, ranks, torch.stack([w.scales for w in pooled]).cuda()


def launches(case: Case, p: Prepared, out: torch.Tensor):
    """(shrink, expand, y): the two launches as callables; expand reads the y of one shrink and adds
    to `out`."""
    pool, a_rows, b_rows, ranks, scales = p.group
    longest = max(case.rows_per_adapter) if case.prompt else None
    busy = None if case.prompt else len(case.rows_per_adapter)  # as the engine tells a graph's kernels

    def run_shrink() -> torch.Tensor:
        tables = (pool, a_rows, ranks, p.indptr, p.seg_slots, longest)
        return sgmv_shrink_group(p.x, *tables, row_alignment=p.alignment, busy_segments=busy)

    y = run_shrink()

    def run_expand() -> None:
        tables = (pool, b_rows, ranks, scales, p.indptr, p.seg_slots, out, case.widths, longest, p.alignment, busy)
        sgmv_expand_group(y, *tables)

    return run_shrink, run_expand, y


def checked_launches(case: Case, p: Prepared, dtype: torch.dtype) -> tuple[Callable, Callable, torch.Tensor]:
    """The case's two launches, after checking what they compute against the torch reference."""
    out = p.out.clone()
    run_shrink, run_expand, y = launches(case, p, out)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    for projection, y_ref in enumerate(p.y_ref):  # every row has an adapter of the pool's full rank
        torch.testing.assert_close(y[projection].cpu(), y_ref, **tolerance)
    run_expand()
    torch.testing.assert_close(out.cpu(), p.out_ref, **tolerance)
    return run_shrink, run_expand, y


class ColdTimer:
    """GPU ms of one call with L2 flushed before it: a CUDA graph of `repeats` x (flush, call) against
    one of `repeats` x flush, each replayed several times; the difference of their medians."""

    def __init__(self, repeats: int = 20, replays: int = 7) -> None:
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        self.flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")  # written: evicts all of L2
        self.repeats, self.replays = repeats, replays
        self._flush_only_ms: float | None = None

    def _graph_ms(self, call: Callable | None) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.repeats):
                self.flush.zero_()
                if call is not None:
                    call()
        samples = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples)

    def __call__(self, call: Callable) -> float:
        call()  # compiled and warm before the capture
        torch.cuda.synchronize()
        if self._flush_only_ms is None:
            self._flush_only_ms = self._graph_ms(None)
        return max(self._graph_ms(call) - self._flush_only_ms, 0.0) / self.repeats


def bench_case(case: Case, p: Prepared, dtype: torch.dtype, peak: float, cold: ColdTimer) -> dict[str, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    run_shrink, run_expand, _ = checked_launches(case, p, dtype)
    timings = {
        "shrink": do_bench_cudagraph(run_shrink, rep=100, return_mode="median"),
        "expand": do_bench_cudagraph(run_expand, rep=100, return_mode="median"),
        "shrink_cold": cold(run_shrink),
        "expand_cold": cold(run_expand),
        "python": do_bench(lambda: (run_shrink(), run_expand()), warmup=25, rep=100, return_mode="median"),
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
    longest = max(case.rows_per_adapter) if case.prompt else None
    busy = None if case.prompt else len(case.rows_per_adapter)
    splits = k_splits(p.x, p.group[1], p.seg_slots, longest, busy)[0]
    result = {"rows": x_rows, "adapters": adapters, "splits": splits}
    for op, when in itertools.product(("shrink", "expand"), ("", "_cold")):
        seconds = timings[op + when] * 1e-3
        result[f"{op}{when}_us"] = seconds * 1e6
        result[f"{op}{when}_peak"] = moved[op] / seconds / peak if seconds else float("nan")
    result["python_us"] = timings["python"] * 1e3
    return result


SHRINK_GRID = [
    ShrinkShape(block_k, waves, warps, stages)
    for block_k, waves, warps, stages in itertools.product([128, 256], [1, 2, 4], [2, 4], [3])
]
EXPAND_GRID = [ExpandShape(*shape) for shape in itertools.product([128, 256], [4, 8], [4, 16, 64], [True, False])]


def layer_cold_us(shapes: LaunchShapes, decode: list[tuple[Case, Prepared]], cold: ColdTimer) -> float | None:
    """Cold us of a layer's launch pairs with these shapes; None if a launch fails or computes wrong."""
    total = 0.0
    with forced(shapes):
        for case, p in decode:
            try:
                run_shrink, run_expand, _ = checked_launches(case, p, torch.bfloat16)
            except Exception as error:  # a shape the GPU cannot launch (shared memory) or a wrong result
                print(f"  {shapes}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                return None
            total += (cold(run_shrink) + cold(run_expand)) * 1e3
    return total


def sweep(cold: ColdTimer) -> tuple[LaunchShapes, dict]:
    """The shrink's grid with the default expand, then the expand's grid with the best shrink, each
    ranked by a Llama-8B decode layer's cold time; returns the winner and what it measured."""
    decode = [case for case in cases(False) if case.label.startswith("Llama-8B") and case.rows_per_adapter == PAIRS]
    prepared = [(case, prepare(case, torch.bfloat16)) for case in decode if case.rank == 16]
    start = shapes_for(torch.device("cuda"))
    baseline = layer_cold_us(DEFAULT, prepared, cold)
    best, best_us = start, baseline if start == DEFAULT else layer_cold_us(start, prepared, cold)
    for stage, grid in (("shrink", SHRINK_GRID), ("expand", EXPAND_GRID)):
        for shape in grid:
            candidate = dataclasses.replace(best, **{stage: shape})
            us = layer_cold_us(candidate, prepared, cold)
            print(f"sweep {stage} {shape}: {us if us is None else round(us, 1)} us per layer, cold", flush=True)
            if us is not None and (best_us is None or us < best_us):
                best, best_us = candidate, us
    measured = {
        "layer_cold_us": {"defaults": baseline, "tuned": best_us},
        "cases": [case.label for case, _ in prepared],
    }
    print(f"sweep: defaults {baseline} us per layer cold, best {best_us}: {best}", flush=True)
    return best, measured


def render(results: list[tuple[Case, str, dict[str, float]]], peak: float, command: str) -> str:
    props = torch.cuda.get_device_properties(0)
    shapes = shapes_for(torch.device("cuda"))
    lines = [
        "## SGMV/BGMV kernels on a GPU",
        "",
        f"Command: `{command}`. Device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}.",
        f"Measured peak (1 GiB device-to-device copy, read + write): **{peak / 1e9:.0f} GB/s**. "
        f"Launch shapes: {'the defaults' if shapes == DEFAULT else 'tuned for this GPU'}, {shapes}.",
        "",
        "Each row is the engine's launch pair for one projection group (q/k/v or gate/up together) over "
        "adapters of one rank scattered in a pool: decode rows sorted by adapter (64 rows over 32 adapters: "
        "segments of 2, laid out as a CUDA graph's tables are, a segment per row with the unused ones empty), "
        "or a row per adapter (BGMV), or prompts (SGMV). Bytes: x or y, each adapter's rows "
        "once, and the output (read and written by the expand); the split-K partials the shrink sums are not "
        "counted. Medians of CUDA-graph replays, with warm caches and cold (L2 flushed before each launch, "
        "as in a decode step); correctness against the torch reference checked first.",
        "",
        "| case | dtype | rows | adapters x rank | K splits | shrink us warm / cold | of peak warm / cold "
        "| expand us warm / cold | of peak warm / cold | shrink + expand called from Python, us |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, dtype, r in results:
        cells = [
            f"{r[op + '_us']:.1f} / {r[op + '_cold_us']:.1f} | {r[op + '_peak']:.0%} / {r[op + '_cold_peak']:.0%}"
            for op in ("shrink", "expand")
        ]
        lines.append(
            f"| {case.label} | {dtype} | {r['rows']:.0f} | {r['adapters']:.0f} x {case.rank} | {r['splits']:.0f} | "
            f"{cells[0]} | {cells[1]} | {r['python_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--sweep", action="store_true", help="time launch shapes against each other first")
    parser.add_argument("--write-tuned", action="store_true", help="keep the sweep's winner for this GPU")
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("gpu")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    peak = peak_bandwidth()
    print(f"peak {peak / 1e9:.0f} GB/s", flush=True)
    cold = ColdTimer()
    if args.sweep:
        best, measured = sweep(cold)
        if args.write_tuned:
            print(f"wrote {write_tuned(torch.cuda.get_device_name(0), best, measured)}", flush=True)
    results = []
    for dtype_name in args.dtypes:
        for case in cases(args.quick):
            dtype = getattr(torch, dtype_name)
            r = bench_case(case, prepare(case, dtype), dtype, peak, cold)
            results.append((case, dtype_name, r))
            print(
                f"{case.label} {dtype_name}: shrink {r['shrink_us']:.1f} / {r['shrink_cold_us']:.1f} us "
                f"{r['shrink_cold_peak']:.0%} of peak cold, expand {r['expand_us']:.1f} / {r['expand_cold_us']:.1f} us "
                f"{r['expand_cold_peak']:.0%}, from Python {r['python_us']:.0f} us",
                flush=True,
            )
    body = render(results, peak, reproduce_command("benchmarks.bench_kernels"))
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
