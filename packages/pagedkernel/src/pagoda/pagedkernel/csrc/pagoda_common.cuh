// Shared by every Pagoda kernel: the storage type picked by PAGODA_DTYPE, float conversions, warp reductions.
//
// The runtime (cupy.RawModule, NVRTC) and the compile test (nvcc -ptx) both pass -DPAGODA_DTYPE=<id>; the
// Python side inlines this file in place of its #include line. No CUDA header is included: cupy-cuda12x ships
// cuda_fp16.h but not cuda_bf16.h, so a machine with only the CUDA wheels (no toolkit) could not compile code
// that includes them. 16-bit values are therefore kept as raw `unsigned short` bits and converted here, with
// one PTX instruction for float16 and exact integer arithmetic for bfloat16.

#define PAGODA_FLOAT32 0
#define PAGODA_FLOAT16 1
#define PAGODA_BFLOAT16 2

#ifndef PAGODA_DTYPE
#error "compile with -DPAGODA_DTYPE=0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

#if PAGODA_DTYPE == PAGODA_FLOAT32
typedef float scalar_t;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
#elif PAGODA_DTYPE == PAGODA_FLOAT16
typedef unsigned short scalar_t;  // IEEE binary16 bits
__device__ __forceinline__ float to_float(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned short x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
}
#elif PAGODA_DTYPE == PAGODA_BFLOAT16
typedef unsigned short scalar_t;  // bfloat16 bits: the high half of a float32
__device__ __forceinline__ float to_float(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}
#else
#error "PAGODA_DTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

// -inf without math.h (NVRTC has no standard headers).
#define PAGODA_NEG_INF (-__int_as_float(0x7f800000))

// Integer min/max of our own: the int overloads of min/max come from headers nvcc includes and NVRTC may not.
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}
