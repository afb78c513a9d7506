// Decode attention on the CPU, reading K and V in the paged cache where they lie.
//
// One query token per row (a decode step): for row b and KV head h, the query heads that
// share h (GQA) score every cached key of the row, take a softmax, and sum the values:
//
//     scores[g, l] = (q[b, h * G + g] . K[l, h]) * scale     for l < context_lens[b]
//     out[b, h * G + g] = softmax(scores[g]) @ V[:, h]
//
// Token l of row b is at offset l % block_size of block block_tables[b, l / block_size]; a
// block holds [block_size, Hkv, D] contiguous elements and blocks lie block_stride apart.
// Gathering the blocks first (as the torch path does) copies every key and value once more
// per layer; here each is read once, a whole block at a time with the next one prefetched.
// Math in float32; rows spread over the OpenMP threads (the libgomp team torch uses).
//
// Built by sgmv_kernels/build.py with the host compiler, no torch headers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;

#include "cpu_vectors.h"

// q . k over head_dim, q already in float32.
template <typename T>
inline float dot(const float* q, const T* k, int64_t head_dim) {
    const int64_t vectorized = head_dim / kLanes * kLanes;
    Floats sum = {};
    for (int64_t d = 0; d < vectorized; d += kLanes) sum += load_vector(q + d) * load_vector(k + d);
    float total = lanes_sum(sum);
    for (int64_t d = vectorized; d < head_dim; d++) total += q[d] * load(k[d]);
    return total;
}

// acc += weight * v over head_dim.
template <typename T>
inline void add_scaled(float* acc, float weight, const T* v, int64_t head_dim) {
    const int64_t vectorized = head_dim / kLanes * kLanes;
    for (int64_t d = 0; d < vectorized; d += kLanes) {
        const Floats sum = load_vector(acc + d) + weight * load_vector(v + d);
        std::memcpy(acc + d, &sum, sizeof sum);
    }
    for (int64_t d = vectorized; d < head_dim; d++) acc[d] += weight * load(v[d]);
}

// Ask for every cache line of a block ahead of its use: blocks lie scattered in the pool.
inline void prefetch_lines(const void* start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(static_cast<const char*>(start) + offset);
}

template <typename T>
void paged_decode_attention(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                            int64_t block_stride, const int64_t* block_tables, int64_t max_blocks,
                            const int64_t* context_lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, T* out, int num_threads) {
    const int64_t per_kv_head = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t block_bytes = block_size * token_stride * int64_t(sizeof(T));
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> queries(num_heads * head_dim), sums(num_heads * head_dim);
        std::vector<float> scores(num_heads * max_blocks * block_size);
        // One row per item, all of its heads: each of its blocks is read once, as a whole.
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < rows; b++) {
            const int64_t length = context_lens[b];
            const int64_t* table = block_tables + b * max_blocks;
            for (int64_t ahead = 0; ahead < 2 && ahead * block_size < length; ahead++)
                prefetch_lines(k_cache + table[ahead] * block_stride, block_bytes);
            for (int64_t d = 0; d < num_heads * head_dim; d++)
                queries[d] = load(q[b * q_row_stride + d]) * scale;
            for (int64_t l = 0; l < length; l++) {
                if (l % block_size == 0 && l + 2 * block_size < length)
                    prefetch_lines(k_cache + table[l / block_size + 2] * block_stride, block_bytes);
                const T* token = k_cache + table[l / block_size] * block_stride + (l % block_size) * token_stride;
                for (int64_t head = 0; head < num_heads; head++)
                    scores[head * length + l] =
                        dot(queries.data() + head * head_dim, token + (head / per_kv_head) * head_dim, head_dim);
            }
            for (int64_t ahead = 0; ahead < 2 && ahead * block_size < length; ahead++)
                prefetch_lines(v_cache + table[ahead] * block_stride, block_bytes);
            for (int64_t head = 0; head < num_heads; head++) {
                float* row = scores.data() + head * length;
                float highest = row[0];
                for (int64_t l = 1; l < length; l++) highest = row[l] > highest ? row[l] : highest;
                float total = 0.0f;
                int64_t l = 0;
                for (; l + kLanes <= length; l += kLanes) {
                    const Floats e = exp_nonpositive(load_vector(row + l) - highest);
                    std::memcpy(row + l, &e, sizeof e);
                    total += lanes_sum(e);
                }
                for (; l < length; l++) {
                    row[l] = std::exp(row[l] - highest);
                    total += row[l];
                }
                const float inverse = 1.0f / total;
                for (int64_t l = 0; l < length; l++) row[l] *= inverse;
            }
            std::fill(sums.begin(), sums.end(), 0.0f);
            for (int64_t l = 0; l < length; l++) {
                if (l % block_size == 0 && l + 2 * block_size < length)
                    prefetch_lines(v_cache + table[l / block_size + 2] * block_stride, block_bytes);
                const T* token = v_cache + table[l / block_size] * block_stride + (l % block_size) * token_stride;
                for (int64_t head = 0; head < num_heads; head++)
                    add_scaled(sums.data() + head * head_dim, scores[head * length + l],
                               token + (head / per_kv_head) * head_dim, head_dim);
            }
            for (int64_t d = 0; d < num_heads * head_dim; d++) store(out + b * num_heads * head_dim + d, sums[d]);
        }
    }
}

}  // namespace

#define ATTENTION_ARGUMENTS(T)                                                                                  \
    const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache, int64_t block_stride,                \
        const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, int64_t rows,            \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out, \
        int num_threads
#define ATTENTION_CALL                                                                                        \
    paged_decode_attention(q, q_row_stride, k_cache, v_cache, block_stride, block_tables, max_blocks,         \
                           context_lens, rows, num_heads, num_kv_heads, head_dim, block_size, scale, out, \
                           num_threads)

extern "C" {
void paged_decode_attention_float32(ATTENTION_ARGUMENTS(float)) { ATTENTION_CALL; }
void paged_decode_attention_bfloat16(ATTENTION_ARGUMENTS(BFloat16)) { ATTENTION_CALL; }
}
