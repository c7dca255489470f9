// Paged attention for decode and prefill: one thread block per (query row, head, key partition).
//
// A block scores its keys CHUNK at a time (one warp per key, the dot product split over lanes), keeps an online
// softmax (running max and sum) across chunks, and accumulates probabilities times values in float32. Decode
// rows are sequences; prefill rows are query tokens, each finding its sequence in query_start_loc and seeing the
// keys up to its own position, which makes causal prefill the same computation as decode. The price: prefill
// reads each key once per query row (from L2), so long prompts are far slower here than in a tiled tensor-core
// kernel such as the Triton backend's; it is exact, and fine for chunked prefill of moderate chunks.
//
// With one partition the block writes the normalised output. With several (long decode contexts and too few
// rows to fill the GPU), each block writes its partition's normalised partial output, max logit and exp sum,
// and pagoda_paged_attention_reduce merges them, as in vLLM's paged_attention_v2.
//
// Compile-time: PAGODA_DTYPE (pagoda_common.cuh) and PAGODA_HEAD_DIM (<= 256; any value, multiples of 32 best).
// With PAGODA_KV_INT8 the caches are int8 with scales (kv_quant.py): keys one per block, KV head and channel
// (k_scale, bfloat16 bits [num_blocks, num_kv_heads, HEAD_DIM]), values one per slot and KV head (v_scale, float32
// [num_blocks, block_size, num_kv_heads]); keys are dequantized as they are read, a value row's scale weights
// its probability. Without it the scale pointers are null and unread.
#include "pagoda_common.cuh"

#ifdef PAGODA_KV_INT8
typedef signed char cache_t;
__device__ __forceinline__ float cache_to_float(cache_t x) { return (float)x; }
#else
typedef scalar_t cache_t;
__device__ __forceinline__ float cache_to_float(cache_t x) { return to_float(x); }
#endif

#ifndef PAGODA_HEAD_DIM
#error "compile with -DPAGODA_HEAD_DIM=<head_dim>"
#endif

#define HEAD_DIM PAGODA_HEAD_DIM
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
#define CHUNK 128  // keys scored per step; their logits and cache slots live in shared memory
// Value pass: a head_dim below NUM_THREADS leaves room for GROUPS thread groups that split a chunk's keys
// (merged at the end); a larger head_dim gives every thread DIMS_PER_THREAD dims instead.
#define GROUPS (HEAD_DIM >= NUM_THREADS ? 1 : NUM_THREADS / HEAD_DIM)
#define DIMS_PER_THREAD ((HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS)

// Block-wide max of v; every thread gets the result. scratch holds NUM_WARPS floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    v = warp_max(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < NUM_WARPS; ++w) r = fmaxf(r, scratch[w]);
    __syncthreads();  // scratch is reused by the next reduction
    return r;
}

// Block-wide sum of v; every thread gets the result (summed in the same order, so bit-identical everywhere).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < NUM_WARPS; ++w) r += scratch[w];
    __syncthreads();
    return r;
}

// grid (num_rows * num_heads, num_partitions), NUM_THREADS threads. Heads vary fastest, so the query heads
// that share a KV head run side by side and read its keys and values through L2 once. sliding_window == 0 and
// softcap == 0 mean "off" (the Python wrapper maps None to 0).
extern "C" __global__ void __launch_bounds__(NUM_THREADS) pagoda_paged_attention(
    scalar_t* __restrict__ out,              // [num_rows, num_heads, HEAD_DIM] (strided), if one partition
    float* __restrict__ part_out,            // [num_rows, num_heads, num_partitions, HEAD_DIM], if several
    float* __restrict__ part_max,            // [num_rows, num_heads, num_partitions]
    float* __restrict__ part_sum,            // [num_rows, num_heads, num_partitions]
    const scalar_t* __restrict__ q,          // [num_rows, num_heads, HEAD_DIM] (strided)
    const cache_t* __restrict__ k_cache,     // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const cache_t* __restrict__ v_cache,     // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const unsigned short* __restrict__ k_scale,  // int8: bfloat16 bits [num_blocks, num_kv_heads, HEAD_DIM]; else null
    const float* __restrict__ v_scale,       // int8: [num_blocks, block_size, num_kv_heads]; else null
    const int* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,    // [num_seqs]
    const int* __restrict__ query_start_loc, // [num_seqs + 1] (prefill), or null (decode: row = sequence)
    int num_seqs, int q_row_stride, int q_head_stride, int out_row_stride, int out_head_stride,
    int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq,
    float scale, float softcap, int sliding_window, int partition_size) {
    const int row = blockIdx.x / num_heads;
    const int head = blockIdx.x % num_heads;
    const int part = blockIdx.y;
    const int num_partitions = gridDim.y;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;

    // The query's sequence and its position in it.
    int seq = row;
    int pos;
    if (query_start_loc != nullptr) {
        int lo = 0, hi = num_seqs;  // invariant: query_start_loc[lo] <= row < query_start_loc[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (query_start_loc[mid] <= row) lo = mid; else hi = mid;
        }
        seq = lo;
        const int q_len = query_start_loc[seq + 1] - query_start_loc[seq];
        pos = context_lens[seq] - q_len + (row - query_start_loc[seq]);
    } else {
        pos = context_lens[seq] - 1;
    }
    // Visible keys [key_begin, pos]; this block takes partition `part` of them.
    const int key_begin = sliding_window > 0 ? imax(0, pos + 1 - sliding_window) : 0;
    const int begin = key_begin + part * partition_size;
    const int end = imin(pos + 1, begin + partition_size);
    const long long part_index = ((long long)row * num_heads + head) * num_partitions + part;
    scalar_t* out_row = out + (long long)row * out_row_stride + (long long)head * out_head_stride;

    if (begin >= end) {  // nothing to see: a partition past the context, or a row without context
        if (num_partitions == 1) {
            for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) out_row[d] = from_float(0.0f);
        } else if (tid == 0) {
            part_max[part_index] = PAGODA_NEG_INF;
            part_sum[part_index] = 0.0f;  // the reduce skips it, so part_out stays unread
        }
        return;
    }

    __shared__ float q_sh[HEAD_DIM];
    __shared__ float logits[CHUNK];
    __shared__ int slots[CHUNK];
    __shared__ float scratch[NUM_WARPS];
    __shared__ float merged[GROUPS * HEAD_DIM];

    const scalar_t* q_row = q + (long long)row * q_row_stride + (long long)head * q_head_stride;
    for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) q_sh[d] = to_float(q_row[d]);

    const int kv_head = head / (num_heads / num_kv_heads);
    const long long slot_stride = (long long)num_kv_heads * HEAD_DIM;
    const cache_t* k_head = k_cache + (long long)kv_head * HEAD_DIM;
    const cache_t* v_head = v_cache + (long long)kv_head * HEAD_DIM;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;

    const int group = GROUPS > 1 ? tid / HEAD_DIM : 0;
    const int dim0 = GROUPS > 1 ? tid % HEAD_DIM : tid;
    const bool in_group = group < GROUPS;  // threads past GROUPS * HEAD_DIM idle in the value pass
    float acc[DIMS_PER_THREAD];
    for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] = 0.0f;
    float running_max = PAGODA_NEG_INF;
    float running_sum = 0.0f;

    for (int chunk = begin; chunk < end; chunk += CHUNK) {
        const int n = imin(CHUNK, end - chunk);
        for (int j = tid; j < n; j += NUM_THREADS) {
            const int token = chunk + j;
            slots[j] = table[token / block_size] * block_size + token % block_size;
        }
        __syncthreads();  // slots (and, on the first chunk, q_sh) are ready

        // Unrolled so that a warp's loads for its next keys are in flight while it reduces the current one.
#pragma unroll 4
        for (int j = warp; j < n; j += NUM_WARPS) {
            const cache_t* k = k_head + slots[j] * slot_stride;
            float s = 0.0f;
#ifdef PAGODA_KV_INT8
            const unsigned short* ks =
                k_scale + ((long long)(slots[j] / block_size) * num_kv_heads + kv_head) * HEAD_DIM;
            for (int d = lane; d < HEAD_DIM; d += 32)
                s += q_sh[d] * (__uint_as_float(((unsigned int)ks[d]) << 16) * cache_to_float(k[d]));
#else
            for (int d = lane; d < HEAD_DIM; d += 32) s += q_sh[d] * cache_to_float(k[d]);
#endif
            s = warp_sum(s) * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (lane == 0) logits[j] = s;
        }
        __syncthreads();

        float local_max = PAGODA_NEG_INF;
        for (int j = tid; j < n; j += NUM_THREADS) local_max = fmaxf(local_max, logits[j]);
        const float new_max = fmaxf(running_max, block_max(local_max, scratch));
        float local_sum = 0.0f;
        for (int j = tid; j < n; j += NUM_THREADS) {
            const float p = expf(logits[j] - new_max);
            logits[j] = p;  // each thread rewrites only the entries it read
            local_sum += p;
        }
        const float chunk_sum = block_sum(local_sum, scratch);  // its barriers also publish the new logits
        const float alpha = expf(running_max - new_max);  // rescales what earlier chunks accumulated; 0 at first
        running_sum = running_sum * alpha + chunk_sum;
        running_max = new_max;

        for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] *= alpha;
        if (in_group) {
#pragma unroll 4
            for (int j = group; j < n; j += GROUPS) {
#ifdef PAGODA_KV_INT8
                const float p = logits[j] * v_scale[(long long)slots[j] * num_kv_heads + kv_head];
#else
                const float p = logits[j];
#endif
                const cache_t* v = v_head + slots[j] * slot_stride;
                for (int i = 0; i < DIMS_PER_THREAD; ++i) {
                    const int d = dim0 + i * NUM_THREADS;
                    if (d < HEAD_DIM) acc[i] += p * cache_to_float(v[d]);
                }
            }
        }
        __syncthreads();  // the next chunk overwrites slots and logits
    }

    // Merge the groups (each saw every GROUPS-th key of every chunk) and normalise.
    if (in_group) {
        for (int i = 0; i < DIMS_PER_THREAD; ++i) {
            const int d = dim0 + i * NUM_THREADS;
            if (d < HEAD_DIM) merged[group * HEAD_DIM + d] = acc[i];
        }
    }
    __syncthreads();
    const float inv_sum = 1.0f / running_sum;  // >= 1 term (the max key contributes exp(0))
    for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) {
        float v = 0.0f;
        for (int g = 0; g < GROUPS; ++g) v += merged[g * HEAD_DIM + d];
        if (num_partitions == 1) {
            out_row[d] = from_float(v * inv_sum);
        } else {
            part_out[part_index * HEAD_DIM + d] = v * inv_sum;
        }
    }
    if (num_partitions > 1 && tid == 0) {
        part_max[part_index] = running_max;
        part_sum[part_index] = running_sum;
    }
}

// grid (num_rows * num_heads), NUM_THREADS threads: merges the partitions of pagoda_paged_attention, weighting
// each normalised partial output by its exp sum rescaled to the global max logit.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) pagoda_paged_attention_reduce(
    scalar_t* __restrict__ out,             // [num_rows, num_heads, HEAD_DIM] (strided)
    const float* __restrict__ part_out,     // [num_rows, num_heads, num_partitions, HEAD_DIM]
    const float* __restrict__ part_max,     // [num_rows, num_heads, num_partitions]
    const float* __restrict__ part_sum,     // [num_rows, num_heads, num_partitions]
    int out_row_stride, int out_head_stride, int num_heads, int num_partitions) {
    const int row = blockIdx.x / num_heads;
    const int head = blockIdx.x % num_heads;
    const long long base = ((long long)row * num_heads + head) * num_partitions;
    float global_max = PAGODA_NEG_INF;
    for (int p = 0; p < num_partitions; ++p) {
        if (part_sum[base + p] > 0.0f) global_max = fmaxf(global_max, part_max[base + p]);
    }
    float total = 0.0f;
    for (int p = 0; p < num_partitions; ++p) {
        if (part_sum[base + p] > 0.0f) total += part_sum[base + p] * expf(part_max[base + p] - global_max);
    }
    scalar_t* out_row = out + (long long)row * out_row_stride + (long long)head * out_head_stride;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
        float v = 0.0f;
        for (int p = 0; p < num_partitions; ++p) {
            const float s = part_sum[base + p];
            if (s > 0.0f) v += s * expf(part_max[base + p] - global_max) * part_out[(base + p) * HEAD_DIM + d];
        }
        out_row[d] = from_float(total > 0.0f ? v / total : 0.0f);
    }
}
