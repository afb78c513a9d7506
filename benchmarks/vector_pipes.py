"""Which AVX-512 instructions share the multiply pipes with the dot products (needs AVX512-VNNI and -BF16).

The int8 and bfloat16 matmul tiles (loraserve/models/cpu/linear.cpp) issue dot products back to
back; what else a tile does is free only where it runs on other pipes. This times 24 independent
`vpdpwssd` a loop iteration alone, then with 4 other instructions beside them, and prints cycles an
iteration (the clock read off a chain of dependent adds). Also the dot products' own throughputs.

    python -m benchmarks.vector_pipes
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ACCUMULATORS = 24  # zmm0..23; zmm24..27 take the instruction under test, zmm30/31 are the sources
BESIDE = {
    "vfmadd231ps": "vfmadd231ps %%zmm30, %%zmm31, %%zmm{r}",
    "vmulps": "vmulps %%zmm30, %%zmm31, %%zmm{r}",
    "vpmaddwd": "vpmaddwd %%zmm30, %%zmm31, %%zmm{r}",
    "vcvtdq2ps": "vcvtdq2ps %%zmm30, %%zmm{r}",
    "vpmovzxbw (load)": "vpmovzxbw (%0), %%zmm{r}",
    "vpbroadcastd (load)": "vpbroadcastd (%0), %%zmm{r}",
    "vpaddd": "vpaddd %%zmm30, %%zmm31, %%zmm{r}",
    "vaddps": "vaddps %%zmm30, %%zmm31, %%zmm{r}",
}
DOTS = {
    "vpdpwssd": "vpdpwssd %%zmm30, %%zmm31, %%zmm{r}",
    "vpdpbusd": "vpdpbusd %%zmm30, %%zmm31, %%zmm{r}",
    "vdpbf16ps": "vdpbf16ps %%zmm30, %%zmm31, %%zmm{r}",
}


def _asm(template: str, registers: range) -> str:
    return "".join(f'"{template.format(r=r)}\\n\\t"' for r in registers) if template else ""


def _loop(dot: str, beside: str) -> str:
    body = _asm(dot, range(ACCUMULATORS)) + _asm(beside, range(24, 28))
    clobbers = ", ".join(f'"zmm{r}"' for r in range(28))
    return f'for (long n = 0; n < N; n++) asm volatile({body} :: "r"(buffer) : {clobbers});'


def source() -> str:
    timings = [(f"24 {name} alone", _loop(asm, "")) for name, asm in DOTS.items()]
    timings += [(f"24 vpdpwssd + 4 {name}", _loop(DOTS["vpdpwssd"], asm)) for name, asm in BESIDE.items()]
    report = 'std::printf("%-36s %6.2f cycles\\n", "{}", (now() - t) * ghz * 1e9 / N);'
    cases = "\n".join(f"    {{ auto t = now(); {loop} {report.format(label)} }}" for label, loop in timings)
    return f"""#include <chrono>
#include <cstdio>
alignas(64) unsigned char buffer[4096];
static double now() {{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}}
int main() {{
    const long N = 20000000;
    long chain = 0;
    auto t = now();
    for (long n = 0; n < N; n++)
        asm volatile("add $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0" : "+r"(chain));
    const double ghz = 4.0 * N / (now() - t) / 1e9;
    std::printf("clock about %.2f GHz (dependent adds)\\n", ghz);
{cases}
}}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        program = Path(scratch) / "pipes"
        (Path(scratch) / "pipes.cpp").write_text(source())
        subprocess.run(["c++", "-O2", "-march=native", "-o", str(program), str(program) + ".cpp"], check=True)
        print(f"cycles a loop iteration of {ACCUMULATORS} independent dot products (two a cycle: 12):")
        subprocess.run([str(program)], check=True)


if __name__ == "__main__":
    main()
