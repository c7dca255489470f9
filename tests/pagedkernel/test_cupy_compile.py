"""The CuPy backend's CUDA sources compile, without a GPU, for every specialisation the runtime uses.

The sources and -D options come from `pagoda.pagedkernel.csrc` and `.cupy_kernels`, the same functions
`cupy_backend` hands to `cupy.RawModule`, so this compiles exactly what the runtime compiles (with nvcc instead of NVRTC). `-cubin` also
runs ptxas, which checks the inline PTX that `-ptx` alone would pass through unchecked.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pagoda.pagedkernel import KernelBackend, csrc, cupy_kernels
from pagoda.pagedkernel.testing import make_case, quantize_case, relative_error
from pagoda.pagedkernel.torch_backend import TorchBackend
from torch import Tensor

TORCH = TorchBackend()
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
ARCH = "sm_90"
# Head dims: below the 128-thread block (grouped value pass), not a multiple of 32 (partial lanes), equal to
# it, and the largest (two dims per thread).
HEAD_DIMS = (64, 80, 128, 256)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

SPECIALISATIONS = (
    [
        pytest.param(cupy_kernels.CACHE_OPS_FILE, dtype, None, False, id=f"cache_ops-{DTYPE_NAMES[dtype]}")
        for dtype in csrc.DTYPE_IDS
    ]
    + [
        pytest.param(
            cupy_kernels.ATTENTION_FILE,
            dtype,
            head_dim,
            False,
            id=f"attention-{DTYPE_NAMES[dtype]}-d{head_dim}",
        )
        for dtype in csrc.DTYPE_IDS
        for head_dim in HEAD_DIMS
    ]
    + [  # over int8 caches with scales (--kv-cache-dtype int8)
        pytest.param(
            cupy_kernels.ATTENTION_FILE,
            dtype,
            head_dim,
            True,
            id=f"attention-int8kv-{DTYPE_NAMES[dtype]}-d{head_dim}",
        )
        for dtype in csrc.DTYPE_IDS
        for head_dim in (80, 256)
    ]
)


def test_every_kernel_file_is_covered() -> None:
    """Each .cu file shipped in csrc/ is listed in KERNELS, so the compile test below reaches it."""
    shipped = {path.name for path in Path(csrc.__file__).parent.glob("*.cu")}
    assert shipped == set(cupy_kernels.KERNELS)


def test_sources_are_self_contained() -> None:
    """Local includes are inlined and no CUDA header is needed (NVRTC from the pip wheels has no toolkit)."""
    for file in cupy_kernels.KERNELS:
        source = csrc.read_source(file)
        assert re.search(r"^\s*#\s*include", source, re.MULTILINE) is None, file


def test_compile_options_reject_unsupported() -> None:
    """Unsupported dtypes and head dims fail before reaching the compiler."""
    assert cupy_kernels.compile_options(torch.bfloat16, 128) == ("-DPAGODA_DTYPE=2", "-DPAGODA_HEAD_DIM=128")
    with pytest.raises(TypeError, match="float64"):
        cupy_kernels.compile_options(torch.float64)
    with pytest.raises(ValueError, match="head_dim"):
        cupy_kernels.compile_options(torch.float16, cupy_kernels.MAX_HEAD_DIM + 1)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize(("file", "dtype", "head_dim", "int8_cache"), SPECIALISATIONS)
def test_kernels_compile(
    tmp_path: Path, file: str, dtype: torch.dtype, head_dim: int | None, int8_cache: bool
) -> None:
    """nvcc compiles the file for sm_90 with the runtime's options, warning-free, and emits each kernel."""
    assert NVCC is not None
    source = tmp_path / file
    source.write_text(csrc.read_source(file))
    cubin = tmp_path / "kernels.cubin"
    command = [
        NVCC,
        "-cubin",
        f"-arch={ARCH}",
        "--Werror",
        "all-warnings",
        *cupy_kernels.compile_options(dtype, head_dim, int8_cache=int8_cache),
        str(source),
        "-o",
        str(cubin),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"
    binary = cubin.read_bytes()
    for kernel in cupy_kernels.KERNELS[file]:
        # extern "C" keeps the names unmangled, which is what get_function looks up.
        assert kernel.encode() + b"\0" in binary, kernel


def _nvrtc_library() -> Path | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (a dependency of CUDA torch builds), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except ModuleNotFoundError:
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    for folder in spec.submodule_search_locations:
        for library in sorted(Path(folder).glob("**/libnvrtc.so*")):
            return library
    return None


NVRTC = _nvrtc_library()


@pytest.mark.skipif(NVRTC is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
@pytest.mark.parametrize(("file", "dtype", "head_dim", "int8_cache"), SPECIALISATIONS)
def test_kernels_compile_with_nvrtc(
    file: str, dtype: torch.dtype, head_dim: int | None, int8_cache: bool
) -> None:
    """NVRTC, the compiler cupy uses at run time, builds each specialisation from the bare source (no headers)."""
    assert NVRTC is not None
    nvrtc = ctypes.CDLL(str(NVRTC))
    program = ctypes.c_void_p()
    source = csrc.read_source(file).encode()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, file.encode(), 0, None, None) == 0
    # What cupy passes besides ours: the device's virtual arch and flushing denormals to zero.
    options = [
        f"-arch=compute_{ARCH.removeprefix('sm_')}",
        "-ftz=true",
        *cupy_kernels.compile_options(dtype, head_dim, int8_cache=int8_cache),
    ]
    status = nvrtc.nvrtcCompileProgram(
        program, len(options), (ctypes.c_char_p * len(options))(*map(str.encode, options))
    )
    log_size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
    log = ctypes.create_string_buffer(log_size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    assert status == 0, log.value.decode()
    ptx_size = ctypes.c_size_t()
    nvrtc.nvrtcGetPTXSize(program, ctypes.byref(ptx_size))
    ptx = ctypes.create_string_buffer(ptx_size.value)
    nvrtc.nvrtcGetPTX(program, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    for kernel in cupy_kernels.KERNELS[file]:
        assert f".entry {kernel}(" in ptx.value.decode(), kernel


def test_import_without_cupy_names_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the backend without cupy raises an ImportError that says to install cupy-cuda12x."""
    # A fresh import, whatever an earlier test imported (restored afterwards).
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.delitem(sys.modules, "pagoda.pagedkernel.cupy_backend", raising=False)
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed")
    with pytest.raises(ImportError, match="cupy-cuda12x"):
        importlib.import_module("pagoda.pagedkernel.cupy_backend")


# --- The kernels run on the CPU -------------------------------------------------------------------------------
#
# Without a GPU in CI, the kernels' logic is checked by compiling the same sources with g++ against a tiny
# emulation of the CUDA execution model: one thread block at a time, one ucontext fiber per CUDA thread,
# __syncthreads and warp shuffles as cooperative barriers that abort on divergence, and threads run in a random
# order between barriers to expose missing ones. A stand-in for `cupy` loads the result and checks every kernel
# argument's type against the kernel's C signature, so this runs the real `cupy_backend` launch code end to end.
# It cannot see timing, memory coalescing or true concurrency within a phase; float16 is left to the GPU tests
# (its conversions are PTX instructions).

EMULATOR = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>
#include <ucontext.h>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline dim3 blockIdx, gridDim, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __shared__ static
enum { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
struct Fiber { ucontext_t context; int state; std::vector<char> stack; };
inline std::vector<Fiber> fibers;
inline ucontext_t scheduler;
inline unsigned current;
inline const std::function<void()>* kernel_body;
inline float shuffle_slots[1024];
inline void wait_at(int state) { fibers[current].state = state; swapcontext(&fibers[current].context, &scheduler); }
inline void __syncthreads() { wait_at(AT_BLOCK_BARRIER); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const unsigned t = threadIdx.x;
    shuffle_slots[t] = v; wait_at(AT_WARP_BARRIER);
    const float r = shuffle_slots[t ^ lane_mask]; wait_at(AT_WARP_BARRIER);
    return r;
}
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline void fiber_main() { (*kernel_body)(); wait_at(DONE); }
inline void fail(const char* what) { std::fprintf(stderr, "emulator: %s\n", what); std::abort(); }
inline void emulate(unsigned gx, unsigned gy, unsigned gz, unsigned threads, const std::function<void()>& body) {
    if (threads % 32 != 0 || threads > 1024) fail("block size must be a multiple of 32, at most 1024");
    gridDim = {gx, gy, gz}; blockDim = {threads, 1, 1}; kernel_body = &body;
    fibers.resize(threads);
    for (Fiber& f : fibers) f.stack.resize(1 << 16);
    // Between two barriers the fibers run one after another, in a fresh random order every time, so that a
    // read of another thread's write without a barrier in between changes the result (and fails the test).
    std::vector<unsigned> order(threads);
    std::iota(order.begin(), order.end(), 0u);
    std::mt19937 rng(12345);
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        for (Fiber& f : fibers) {
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = f.stack.data(); f.context.uc_stack.ss_size = f.stack.size();
            makecontext(&f.context, fiber_main, 0); f.state = RUNNABLE;
        }
        for (;;) {
            std::shuffle(order.begin(), order.end(), rng);
            for (unsigned t : order) {
                while (fibers[t].state == RUNNABLE) {
                    current = t; threadIdx = {t, 0, 0};
                    swapcontext(&scheduler, &fibers[t].context);
                }
            }
            int waiting[4] = {0, 0, 0, 0};
            for (const Fiber& f : fibers) ++waiting[f.state];
            if (waiting[DONE] == (int)threads) break;
            bool released = false;
            for (unsigned w = 0; w < threads / 32; ++w) {  // a warp goes on once all its 32 lanes shuffle
                bool all = true;
                for (unsigned t = 32 * w; t < 32 * w + 32; ++t) all = all && fibers[t].state == AT_WARP_BARRIER;
                if (all) { for (unsigned t = 32 * w; t < 32 * w + 32; ++t) fibers[t].state = RUNNABLE; released = true; }
            }
            if (released) continue;
            if (waiting[AT_BLOCK_BARRIER] != (int)threads) fail("divergent barrier or shuffle (deadlock)");
            for (Fiber& f : fibers) f.state = RUNNABLE;
        }
    }
}
"""

_KERNEL_SIGNATURE = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\(\w+\) )?(\w+)\(([^{]*?)\)\s*\{', re.S
)


class _EmulatedKernel:
    """A kernel of an emulated module, called like a cupy RawKernel: (grid, block, args)."""

    def __init__(self, library: ctypes.CDLL, name: str, param_types: list[str]) -> None:
        self.entry = getattr(library, f"emulate_{name}")
        self.name = name
        self.param_types = param_types

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[object, ...]) -> None:
        assert len(args) == len(self.param_types), f"{self.name}: {len(args)} args for {self.param_types}"
        values: list[ctypes.c_int64 | ctypes.c_int32 | ctypes.c_float] = []
        for arg, param in zip(args, self.param_types, strict=True):
            # What cupy would pass: a Python int as 8 bytes (right for pointers), numpy scalars by their size.
            if "*" in param:
                assert type(arg) is int, f"{self.name}: pointer {param} given {type(arg)}"
                values.append(ctypes.c_int64(arg))
            elif param == "int":
                assert type(arg) is np.int32, f"{self.name}: int given {type(arg)}"
                values.append(ctypes.c_int32(int(arg)))
            else:
                assert param == "float" and type(arg) is np.float32, f"{self.name}: {param} given {type(arg)}"
                values.append(ctypes.c_float(float(arg)))
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        gx, gy, gz = (*grid, 1, 1)[:3]
        (threads,) = block
        self.entry(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz), ctypes.c_uint(threads), pointers)


class _EmulatedModule:
    """Stand-in for cupy.RawModule: g++ builds the source with the emulator into a shared library."""

    def __init__(self, build_dir: Path, code: str, options: tuple[str, ...]) -> None:
        self.signatures = {
            m.group(1): [" ".join(p.replace("__restrict__", "").split()[:-1]) for p in m.group(2).split(",")]
            for m in _KERNEL_SIGNATURE.finditer(re.sub(r"//[^\n]*", "", code))
        }
        launchers = [
            f'extern "C" void emulate_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, void** a) {{'
            f" emulate(gx, gy, gz, threads, [&] {{ {name}("
            + ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(types))
            + "); }); }"
            for name, types in self.signatures.items()
        ]
        source = "\n".join([EMULATOR, code, *launchers])
        library = build_dir / f"{hashlib.sha256((source + repr(options)).encode()).hexdigest()[:16]}.so"
        if not library.exists():  # built once per specialisation for the whole session
            cpp = library.with_suffix(".cpp")
            cpp.write_text(source)
            command = [
                GXX or "g++",
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                *options,
                str(cpp),
                "-o",
                str(library),
            ]
            subprocess.run(command, check=True, capture_output=True, text=True)
        self.library = ctypes.CDLL(str(library))

    def get_function(self, name: str) -> _EmulatedKernel:
        """The kernel `name`, as cupy's RawModule.get_function returns it."""
        return _EmulatedKernel(self.library, name, self.signatures[name])


class _NoContext:
    """Stand-in for cupy.cuda.Device and ExternalStream (one emulated device, one stream)."""

    def __init__(self, *args: object) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _fake_cupy(build_dir: Path) -> types.ModuleType:
    """A `cupy` module with just what cupy_backend uses, backed by the emulator."""
    cupy = types.ModuleType("cupy")
    cupy.RawModule = lambda code, options: _EmulatedModule(build_dir, code, options)  # type: ignore[attr-defined]
    runtime = types.SimpleNamespace(
        memcpyDefault=4, memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size)
    )
    cupy.cuda = types.SimpleNamespace(Device=_NoContext, ExternalStream=_NoContext, runtime=runtime)  # type: ignore[attr-defined]
    return cupy


@pytest.fixture(scope="module")
def emulated() -> Iterator[KernelBackend]:
    """A `CupyBackend` of `pagoda.pagedkernel.cupy_backend` imported against the emulated cupy, seeing CPU tensors
    as device 0."""
    if GXX is None:
        pytest.skip("g++ is not installed")
    with tempfile.TemporaryDirectory() as build_dir, pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "cupy", _fake_cupy(Path(build_dir)))
        sys.modules.pop("pagoda.pagedkernel.cupy_backend", None)
        backend = importlib.import_module("pagoda.pagedkernel.cupy_backend")
        patch.setattr(backend, "_device_index", lambda t: 0)
        patch.setattr(backend, "_sm_count", lambda device: 132)  # an H100/H200: decides when decode splits
        patch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
        yield backend.CupyBackend()
        sys.modules.pop("pagoda.pagedkernel.cupy_backend", None)


EMULATED_DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
EMULATED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (seqs as (context_len, q_len), (num_heads, num_kv_heads, head_dim, block_size), sliding_window, logit_softcap).
# With at most a few (row, head) pairs, decode contexts over 512 keys run split into partitions plus the reduce.
EMULATED_ATTENTION = [
    pytest.param([(1, 1), (16, 1), (17, 1), (530, 1)], (2, 1, 64, 16), None, None, id="decode-split-gqa-d64"),
    pytest.param([(3, 1), (40, 1), (700, 1)], (2, 2, 80, 8), 600, 5.0, id="decode-split-window-softcap-d80"),
    pytest.param([(9, 1), (33, 1)], (2, 1, 256, 16), None, 30.0, id="decode-softcap-d256"),
    pytest.param([(24, 24), (50, 6), (9, 1)], (4, 2, 64, 8), 16, None, id="prefill-window-gqa-d64"),
    pytest.param([(40, 40), (200, 3)], (2, 1, 80, 16), None, 20.0, id="prefill-softcap-d80"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so that NaN slots compare equal."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", EMULATED_DTYPES)
def test_emulated_cache_ops(emulated: KernelBackend, dtype: torch.dtype) -> None:
    """reshape_and_cache (strided keys, padding slots), copy_blocks and swap_blocks equal the torch backend."""
    gen = torch.Generator().manual_seed(0)
    shape = (4, 8, 2, 32)  # [num_blocks, block_size, num_kv_heads, head_dim]
    qkv = torch.randn(12, 6, 32, generator=gen).to(dtype)  # a fused projection: keys and values are views
    key, value = qkv[:, 2:4], qkv[:, 4:]
    slots = torch.tensor([5, 6, 7, 8, 9, -1, 30, 0, 31, -3, 17, 16])
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    emulated.reshape_and_cache(key, value, caches[0], caches[1], slots)
    TORCH.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(_bits(caches[0]), _bits(caches[2])) and torch.equal(_bits(caches[1]), _bits(caches[3]))

    layers = [torch.randn(shape, generator=gen).to(dtype) for _ in range(6)]
    expected = [layer.clone() for layer in layers]
    pairs = torch.tensor([[0, 3], [2, 1]])
    emulated.copy_blocks(layers[:3], layers[3:], pairs)
    TORCH.copy_blocks(expected[:3], expected[3:], pairs)
    assert all(torch.equal(a, b) for a, b in zip(layers, expected, strict=True))

    host = torch.zeros(shape, dtype=dtype)
    emulated.swap_blocks(layers[0], host, torch.tensor([[1, 2], [3, 0]]))
    assert torch.equal(host[2], layers[0][1]) and torch.equal(host[0], layers[0][3])
    assert not host[1].any() and not host[3].any()
    with pytest.raises(IndexError):
        emulated.swap_blocks(layers[0], host, torch.tensor([[0, 4]]))


@pytest.mark.parametrize("dtype", EMULATED_DTYPES)
@pytest.mark.parametrize(("seqs", "dims", "sliding_window", "logit_softcap"), EMULATED_ATTENTION)
def test_emulated_attention(
    emulated: KernelBackend,
    dtype: torch.dtype,
    seqs: list[tuple[int, int]],
    dims: tuple[int, int, int, int],
    sliding_window: int | None,
    logit_softcap: float | None,
) -> None:
    """Decode (split and unsplit) and varlen prefill match the torch backend; every output element is written."""
    num_heads, num_kv_heads, head_dim, block_size = dims
    case = make_case(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison_unused=True,  # NaN in every cache slot outside the contexts: a read would reach the output
    )
    out = torch.full_like(case.q, float("nan"))
    tables, lens = case.block_tables, case.context_lens
    if all(q_len == 1 for _, q_len in seqs):
        result = emulated.paged_decode_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            tables,
            lens,
            case.scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )
        spec = TORCH.paged_decode_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            tables,
            lens,
            case.scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
    else:
        starts = case.query_start_loc
        result = emulated.paged_prefill_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            tables,
            starts,
            lens,
            case.scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )
        spec = TORCH.paged_prefill_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            tables,
            starts,
            lens,
            case.scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
    assert result is out
    assert not out.isnan().any()
    assert relative_error(out, spec) < EMULATED_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", EMULATED_DTYPES)
@pytest.mark.parametrize(("seqs", "dims", "sliding_window", "logit_softcap"), EMULATED_ATTENTION)
def test_emulated_int8_attention(
    emulated: KernelBackend,
    dtype: torch.dtype,
    seqs: list[tuple[int, int]],
    dims: tuple[int, int, int, int],
    sliding_window: int | None,
    logit_softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over int8 caches (written by the torch reference in rounds, every scale NaN until written, random bytes in
    unwritten slots) the kernel reads the rows and both scales itself and matches the torch reference."""
    num_heads, num_kv_heads, head_dim, block_size = dims
    case = make_case(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison_unused=True,
    )

    def write(
        key: Tensor, value: Tensor, k: Tensor, v: Tensor, slots: Tensor, k_scale: Tensor, v_scale: Tensor
    ) -> None:
        TORCH.reshape_and_cache(key, value, k, v, slots, k_scale=k_scale, v_scale=v_scale)

    qc = quantize_case(case, write)
    caches = (qc.k_cache, qc.v_cache)
    k_scale, v_scale = qc.k_scale, qc.v_scale
    window, softcap = sliding_window, logit_softcap
    tables, lens = case.block_tables, case.context_lens
    decode = all(q_len == 1 for _, q_len in seqs)
    if decode:
        spec = TORCH.paged_decode_attention(
            case.q,
            *caches,
            tables,
            lens,
            case.scale,
            sliding_window=window,
            logit_softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    else:
        starts = case.query_start_loc
        spec = TORCH.paged_prefill_attention(
            case.q,
            *caches,
            tables,
            starts,
            lens,
            case.scale,
            sliding_window=window,
            logit_softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def refuse(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the cupy backend handed an int8 cache to the torch reference")

    monkeypatch.setattr(TorchBackend, "paged_decode_attention", refuse)
    monkeypatch.setattr(TorchBackend, "paged_prefill_attention", refuse)
    out = torch.full_like(case.q, float("nan"))
    if decode:
        result = emulated.paged_decode_attention(
            case.q,
            *caches,
            tables,
            lens,
            case.scale,
            out=out,
            sliding_window=window,
            logit_softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    else:
        result = emulated.paged_prefill_attention(
            case.q,
            *caches,
            tables,
            case.query_start_loc,
            lens,
            case.scale,
            out=out,
            sliding_window=window,
            logit_softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    assert result is out
    assert not out.isnan().any()
    assert relative_error(out, spec) < EMULATED_TOLERANCE[dtype]


def test_emulated_edge_cases(emulated: KernelBackend) -> None:
    """Empty batches, a row without context (zeros), a sequence without queries, and rejected arguments."""
    case = make_case([(5, 1), (30, 4), (9, 3)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
    caches = (case.k_cache, case.v_cache)
    empty = case.q[:0]
    assert emulated.paged_decode_attention(
        empty, *caches, case.block_tables, case.context_lens, 1.0
    ).shape == (0, 2, 64)
    emulated.reshape_and_cache(empty[:, :1], empty[:, :1], *caches, torch.zeros(0, dtype=torch.int64))
    emulated.copy_blocks([case.k_cache], [case.v_cache], torch.zeros(0, 2, dtype=torch.int64))

    # Decode with a padding row (context 0) first: it gets zeros, the real row its attention.
    q = case.q[:2]
    lens = torch.tensor([0, 30], dtype=torch.int32)
    out = emulated.paged_decode_attention(q, *caches, case.block_tables[:2], lens, case.scale)
    spec = TORCH.paged_decode_attention(q[1:], *caches, case.block_tables[1:2], lens[1:], case.scale)
    assert not out[0].any() and relative_error(out[1:], spec) < 1e-5

    # Prefill where the middle sequence has no queries this step (its bounds repeat).
    starts = torch.tensor([0, 1, 1, 4], dtype=torch.int32)
    q = case.q[:4]
    out = emulated.paged_prefill_attention(
        q, *caches, case.block_tables, starts, case.context_lens, case.scale
    )
    spec = TORCH.paged_prefill_attention(q, *caches, case.block_tables, starts, case.context_lens, case.scale)
    assert relative_error(out, spec) < 1e-5

    args = (case.block_tables, case.context_lens, case.scale)
    decode = emulated.paged_decode_attention
    with pytest.raises(ValueError, match="sliding_window"):
        decode(case.q[:3], case.k_cache, case.v_cache, *args, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        decode(case.q[:3], case.k_cache, case.v_cache, *args, logit_softcap=-1.0)
    with pytest.raises(ValueError, match="out"):
        decode(case.q[:3], case.k_cache, case.v_cache, *args, out=torch.empty(3, 2, 64, dtype=torch.bfloat16))
    k_two_heads, v_two_heads = case.k_cache.repeat(1, 1, 2, 1), case.v_cache.repeat(1, 1, 2, 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        decode(
            case.q[:3, :1].repeat(1, 3, 1), k_two_heads, v_two_heads, *args
        )  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="contiguous"):
        decode(case.q[:3], case.k_cache.transpose(0, 1), case.v_cache.transpose(0, 1), *args)
    with pytest.raises(ValueError, match="sequences"):
        decode(case.q, case.k_cache, case.v_cache, *args)  # 8 query rows but 3 sequences
