"""The CPU's arithmetic peak: multiply-adds a second of the dot-product instructions the kernels are built on.

A physical limit beside the bandwidth one: a step that must do M multiply-adds cannot take less than M over the
peak of the instruction that does them. For each instruction this CPU has (AVX-512 or AVX2 float32 FMA, int8 dot
products: AVX-512 VNNI `vpdpbusd` or AVX2 `vpmaddubsw` + `vpmaddwd`, AVX-512 BF16 `vdpbf16ps`), a C loop of 16
independent accumulator chains (more than the latency times the issue rate, so it measures throughput) runs on one
thread, then on `--threads` threads at once (ctypes releases the GIL), best of `--repeats`. The table names the CPU.

    python tools/bench_peak.py [--threads 2] [--seconds 0.3] [--json peak.json]

Measured on the 2-core AMD EPYC Zen 4 of the test machines (2026-12-05, the machine faster and slower by the hour):
int8 `vpdpbusd` 430-500 G multiply-adds a second on both cores, bfloat16 `vdpbf16ps` 200-245 G, float32 FMA ~80 G;
the numbers issue #44's saturation paragraph (README) uses. Those were taken before the loops were unrolled (below):
the float32 figure may be low there too. On a 2-core AMD EPYC Zen 3 (AVX2 only, 2026-12-05): float32 FMA 99-101 G
(51 a thread), int8 `vpmaddubsw` + `vpmaddwd` 96-141 G (63-71 a thread; the second core's share swings on this VM).
Until then the AVX2 loops measured 25 G and ~95 G: sixteen 256-bit chains and their operands spilled out of AVX2's
sixteen registers, the rolled loop (-O2) kept the accumulators in memory, and the int8 pair sums of constant
operands were hoisted out of the loop, which then timed the integer adds alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pagoda.pagedkernel.cbuild import build, cpu_name

# One function per kind; a kind this build's target lacks returns 0 (not measured). Each step of the loop issues
# 16 independent instructions, so their latency (4-6 cycles) never limits the rate.
SOURCE = r"""
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
volatile float pagoda_peak_sink_f;
volatile int32_t pagoda_peak_sink_i;
#define CHAINS 16
/* AVX2 has 16 vector registers: 16 chains and the operands spilled (the float32 loop ran at a third of the
 * rate). 12 chains still cover the latency times the issue rate (4 cycles x 2 a cycle for FMA). */
#define CHAINS_256 12
/* Every step's chains unrolled (the pragma before each loop over them): rolled up at -O2, the accumulators lived
 * in memory and each instruction waited on the store before it (the float32 loop ran at a quarter of the rate). */
#if defined(__AVX2__)
static float sum8f(__m256 v) {
  float t[8], s = 0.0f;
  _mm256_storeu_ps(t, v);
  for (int e = 0; e < 8; e++) s += t[e];
  return s;
}
static int32_t sum8i(__m256i v) {
  int32_t t[8], s = 0;
  _mm256_storeu_si256((__m256i *)t, v);
  for (int e = 0; e < 8; e++) s += t[e];
  return s;
}
#endif

/* float32 fused multiply-adds: multiply-adds done in `steps` steps (0 without FMA). */
int64_t pagoda_peak_fma(int64_t steps) {
#if defined(__AVX512F__)
  __m512 acc[CHAINS];
  const __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(0.25f);
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_ps(0.001f * (float)j);
  for (int64_t i = 0; i < steps; i++)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  float s = 0.0f;
  for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(acc[j]);
  pagoda_peak_sink_f = s;
  return steps * CHAINS * 16;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[CHAINS_256];
  const __m256 a = _mm256_set1_ps(0.5f), b = _mm256_set1_ps(0.25f);
  for (int j = 0; j < CHAINS_256; j++) acc[j] = _mm256_set1_ps(0.001f * (float)j);
  for (int64_t i = 0; i < steps; i++)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < CHAINS_256; j++) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  float s = 0.0f;
  for (int j = 0; j < CHAINS_256; j++) s += sum8f(acc[j]);
  pagoda_peak_sink_f = s;
  return steps * CHAINS_256 * 8;
#else
  (void)steps;
  return 0;
#endif
}

/* int8 dot products (unsigned by signed bytes into int32): AVX-512 VNNI vpdpbusd, else AVX2's pair sums. */
int64_t pagoda_peak_int8(int64_t steps) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  __m512i acc[CHAINS];
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_epi32(j);
  for (int64_t i = 0; i < steps; i++)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
  int32_t s = 0;
  for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_epi32(acc[j]);
  pagoda_peak_sink_i = s;
  return steps * CHAINS * 64;
#elif defined(__AVX2__)
  /* The pair sums do not read the accumulators: with constant operands the compiler hoists them out of the loop
   * (the loop then timed vpaddd alone, ~3x too fast). Each chain multiplies its own bytes, read from memory
   * every step (the empty asm's memory clobber): the loads go to the load ports, beside the multiplies. */
  __m256i acc[CHAINS_256], bytes[CHAINS_256];
  const __m256i a = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int j = 0; j < CHAINS_256; j++) acc[j] = _mm256_set1_epi32(j), bytes[j] = _mm256_set1_epi8((char)(j + 1));
  for (int64_t i = 0; i < steps; i++) {
    __asm__ volatile("" : : "r"(bytes) : "memory");
    _Pragma("GCC unroll 16")
    for (int j = 0; j < CHAINS_256; j++)
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, bytes[j]), ones));
  }
  int32_t s = 0;
  for (int j = 0; j < CHAINS_256; j++) s += sum8i(acc[j]);
  pagoda_peak_sink_i = s;
  return steps * CHAINS_256 * 32;
#else
  (void)steps;
  return 0;
#endif
}

/* bfloat16 pair dot products into float32 (AVX-512 BF16 vdpbf16ps). */
int64_t pagoda_peak_bf16(int64_t steps) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  __m512 acc[CHAINS];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f00), b = (__m512bh)_mm512_set1_epi16(0x3e80);
  for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_set1_ps(0.001f * (float)j);
  for (int64_t i = 0; i < steps; i++)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  float s = 0.0f;
  for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(acc[j]);
  pagoda_peak_sink_f = s;
  return steps * CHAINS * 32;
#else
  (void)steps;
  return 0;
#endif
}
"""

# (kind, the C function, what it runs where the CPU has it)
KINDS = (
    ("float32 FMA", "pagoda_peak_fma", "vfmadd (AVX-512, else AVX2)"),
    ("int8 dot", "pagoda_peak_int8", "vpdpbusd (AVX-512 VNNI), else vpmaddubsw + vpmaddwd (AVX2)"),
    ("bfloat16 dot", "pagoda_peak_bf16", "vdpbf16ps (AVX-512 BF16)"),
)


@dataclass(frozen=True, slots=True)
class Peak:
    """One instruction's measured rate: multiply-adds a second on one thread and on `threads` at once."""

    kind: str
    instruction: str
    one_thread_gmacs: float
    all_threads_gmacs: float
    threads: int


def library() -> ctypes.CDLL:
    """The peak loops, built for this CPU (-march=native, or $PAGODA_CPU_MARCH) and cached like the kernels."""
    path = build(
        "bench_peak.c",
        SOURCE,
        ("-O2", "-march=native"),
        variant="native",
        owner="tools/bench_peak.py",
        instead="run it where a C compiler is installed",
    )
    lib = ctypes.CDLL(str(path))
    for _, name, _ in KINDS:
        getattr(lib, name).restype = ctypes.c_int64
        getattr(lib, name).argtypes = [ctypes.c_int64]
    return lib


def rate(run: Callable[[int], int], steps: int, threads: int) -> float:
    """Multiply-adds a second of `threads` threads each running `steps` steps at once (their total over the
    slowest thread's time)."""
    done = [0] * threads
    seconds = [0.0] * threads
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        done[i] = int(run(steps))
        seconds[i] = time.perf_counter() - t0

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / max(seconds)


def measure(lib: ctypes.CDLL, threads: int, seconds: float, repeats: int) -> list[Peak]:
    """Each kind this build has, on one thread and on `threads`: the best of `repeats` runs of ~`seconds` each."""
    peaks = []
    for kind, name, instruction in KINDS:
        run = getattr(lib, name)
        if run(1) == 0:
            continue
        steps = 1 << 12
        while True:  # size a run to about `seconds` on one thread
            t0 = time.perf_counter()
            run(steps)
            if time.perf_counter() - t0 >= seconds / 4 or steps >= 1 << 40:
                break
            steps *= 2
        steps *= 4
        one = max(rate(run, steps, 1) for _ in range(repeats))
        every = max(rate(run, steps, threads) for _ in range(repeats))
        peaks.append(Peak(kind, instruction, one / 1e9, every / 1e9, threads))
    return peaks


def table(peaks: Sequence[Peak], cpu: str) -> str:
    """The table this tool prints."""
    threads = peaks[0].threads if peaks else 1
    lines = [
        f"{cpu}: arithmetic peak, G multiply-adds a second",
        f"{'kind':<14} {'one thread':>11} {f'{threads} threads':>11}  instruction",
    ]
    for p in peaks:
        lines.append(
            f"{p.kind:<14} {p.one_thread_gmacs:>11.1f} {p.all_threads_gmacs:>11.1f}  {p.instruction}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads at once for the second column")
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long one run takes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("argument --threads: must be >= 1")
    if args.seconds <= 0:
        parser.error("argument --seconds: must be > 0")
    if args.repeats < 1:
        parser.error("argument --repeats: must be >= 1")
    peaks = measure(library(), args.threads, args.seconds, args.repeats)
    cpu = cpu_name()
    print(table(peaks, cpu))
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu, "peaks": [asdict(p) for p in peaks]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
