// KV-cache writes and block copies. Caches are contiguous [num_blocks, block_size, num_kv_heads, head_dim], so
// the row of slot s (= block * block_size + offset) starts at element s * num_kv_heads * head_dim.
#include "pagoda_common.cuh"

// One thread block per token: writes key[t] and value[t] ([num_kv_heads, head_dim] each) into slot_mapping[t].
// key/value may be strided views (e.g. slices of a fused QKV projection); their last dim must be contiguous.
extern "C" __global__ void pagoda_reshape_and_cache(
    const scalar_t* __restrict__ key,    // [num_tokens, num_kv_heads, head_dim]
    const scalar_t* __restrict__ value,  // [num_tokens, num_kv_heads, head_dim]
    scalar_t* __restrict__ k_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
    scalar_t* __restrict__ v_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
    const long long* __restrict__ slot_mapping,  // [num_tokens], negative = padding
    int key_token_stride, int key_head_stride, int value_token_stride, int value_head_stride,
    int num_kv_heads, int head_dim) {
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const int row = num_kv_heads * head_dim;
    scalar_t* k_dst = k_cache + slot * row;
    scalar_t* v_dst = v_cache + slot * row;
    const scalar_t* k_src = key + token * key_token_stride;
    const scalar_t* v_src = value + token * value_token_stride;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int head = i / head_dim;
        const int d = i - head * head_dim;
        k_dst[i] = k_src[head * key_head_stride + d];
        v_dst[i] = v_src[head * value_head_stride + d];
    }
}

// Copy-on-write for every layer in one launch: grid (num_pairs, num_layers). The caches of all layers share
// one shape, and their base addresses arrive as arrays of device pointers.
extern "C" __global__ void pagoda_copy_blocks(
    const long long* __restrict__ k_cache_ptrs,  // [num_layers] addresses of scalar_t caches
    const long long* __restrict__ v_cache_ptrs,  // [num_layers]
    const long long* __restrict__ block_pairs,   // [num_pairs, 2] (src, dst)
    int block_numel) {                           // block_size * num_kv_heads * head_dim
    const long long pair = blockIdx.x;
    const int layer = blockIdx.y;
    scalar_t* k_cache = reinterpret_cast<scalar_t*>(k_cache_ptrs[layer]);
    scalar_t* v_cache = reinterpret_cast<scalar_t*>(v_cache_ptrs[layer]);
    const long long src = block_pairs[2 * pair] * block_numel;
    const long long dst = block_pairs[2 * pair + 1] * block_numel;
    for (int i = threadIdx.x; i < block_numel; i += blockDim.x) {
        k_cache[dst + i] = k_cache[src + i];
        v_cache[dst + i] = v_cache[src + i];
    }
}
