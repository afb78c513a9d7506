// The small per-layer operations of a decoder layer on the CPU, each fused into one pass:
//
//   add_rms_norm:     residual += delta; out = weight * rms_norm(residual)   (before attention and MLP)
//   silu_mul:         out = silu(gate) * up                                  (the MLP's activation)
//   rotary_store_kv:  rotate q and k in place; write k and v to their cache slots
//
// Done one torch op at a time these are ~20 ops per layer, each a pass over memory and a
// dispatch: ~40% of a bfloat16 decode step outside its matmuls. Every intermediate is
// rounded to the model dtype exactly where the torch ops (and transformers) round it, so
// rotary_store_kv equals them bit for bit; add_rms_norm and silu_mul differ at most by the
// order of a float32 sum and by exp's last bit.
//
// Built by sgmv_kernels/build.py with the host compiler, no torch headers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "cpu_vectors.h"

namespace {

// Below this many elements a step runs on one thread: waking the others costs more.
constexpr int64_t kParallelElements = 1 << 14;

// v rounded to T and back, as storing it in a tensor of dtype T would round it.
inline Floats rounded(Floats v, const float*) { return v; }
inline Floats rounded(Floats v, const BFloat16*) {
    const Words bits = bfloat16_bits(v);
    Floats result;
    std::memcpy(&result, &bits, sizeof result);
    return result;
}
inline float rounded(float v, const float*) { return v; }
inline float rounded(float v, const BFloat16*) {
    BFloat16 half;
    store(&half, v);
    return load(half);
}

// x * sigmoid(x) from e = e^-|x| <= 1, which never overflows: x / (1 + e) for x >= 0, x e / (1 + e) below.
inline Floats silu(Floats x) {
    const Floats e = exp_nonpositive(x < 0 ? x : -x);
    return (x < 0 ? x * e : x) / (1.0f + e);
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width, int num_threads) {
    const T* tag = nullptr;
    const int64_t vectorized = width / kLanes * kLanes;
#pragma omp parallel for num_threads(num_threads) if (rows * width >= kParallelElements)
    for (int64_t row = 0; row < rows; row++) {
        const T* gate = gate_up + row * 2 * width;
        const T* up = gate + width;
        T* y = out + row * width;
        for (int64_t i = 0; i < vectorized; i += kLanes)
            store_vector(y + i, rounded(silu(load_vector(gate + i)), tag) * load_vector(up + i));
        for (int64_t i = vectorized; i < width; i++) {
            const float g = load(gate[i]);
            store(y + i, rounded(g / (1.0f + std::exp(-g)), tag) * load(up[i]));
        }
    }
}

// From here on no fused multiply-add: x * cos + rotated * sin must round both products, as
// torch does. (SiLU's e^x above keeps it: its polynomial is half as many instructions with it.)
#pragma GCC optimize("fp-contract=off")

template <typename T>
void add_rms_norm(const T* delta, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps,
                  int num_threads) {
    const T* tag = nullptr;
    const int64_t vectorized = hidden / kLanes * kLanes;
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelElements)
    for (int64_t row = 0; row < rows; row++) {
        T* x = residual + row * hidden;
        const T* d = delta == nullptr ? nullptr : delta + row * hidden;
        T* y = out + row * hidden;
        Floats squares = {};
        float tail_squares = 0.0f;
        for (int64_t i = 0; i < vectorized; i += kLanes) {
            Floats v = load_vector(x + i);
            if (d != nullptr) {
                v = rounded(v + load_vector(d + i), tag);
                store_vector(x + i, v);
            }
            squares += v * v;
        }
        for (int64_t i = vectorized; i < hidden; i++) {
            float v = load(x[i]);
            if (d != nullptr) {
                v = rounded(v + load(d[i]), tag);
                store(x + i, v);
            }
            tail_squares += v * v;
        }
        const float inverse_rms = 1.0f / std::sqrt((lanes_sum(squares) + tail_squares) / float(hidden) + eps);
        for (int64_t i = 0; i < vectorized; i += kLanes)
            store_vector(y + i, load_vector(weight + i) * rounded(load_vector(x + i) * inverse_rms, tag));
        for (int64_t i = vectorized; i < hidden; i++)
            store(y + i, load(weight[i]) * rounded(load(x[i]) * inverse_rms, tag));
    }
}

// One head rotated in place, rotate-half convention: out = x * cos + (-x2, x1) * sin, each
// product rounded to T before the sum.
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t head_dim) {
    const T* tag = nullptr;
    const int64_t half = head_dim / 2, vectorized = half / kLanes * kLanes;
    for (int64_t i = 0; i < vectorized; i += kLanes) {
        const Floats first = load_vector(x + i), second = load_vector(x + half + i);
        store_vector(x + i, rounded(first * load_vector(cos + i), tag) - rounded(second * load_vector(sin + i), tag));
        store_vector(x + half + i, rounded(second * load_vector(cos + half + i), tag) +
                                       rounded(first * load_vector(sin + half + i), tag));
    }
    for (int64_t i = vectorized; i < half; i++) {
        const float first = load(x[i]), second = load(x[half + i]);
        store(x + i, rounded(first * load(cos[i]), tag) - rounded(second * load(sin[i]), tag));
        store(x + half + i, rounded(second * load(cos[half + i]), tag) + rounded(first * load(sin[half + i]), tag));
    }
}

// qkv rows: [q heads | k heads | v heads], row_stride apart; cos/sin: [rows, head_dim].
// Token t's k and v go to offset slot_offsets[t] of block slot_blocks[t] ([block_size, Hkv, D]).
template <typename T>
void rotary_store_kv(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t rows, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, T* k_cache, T* v_cache, int64_t block_stride,
                     const int64_t* slot_blocks, const int64_t* slot_offsets, int num_threads) {
    const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (rows * row_stride >= kParallelElements)
    for (int64_t t = 0; t < rows; t++) {
        T* row = qkv + t * row_stride;
        for (int64_t head = 0; head < num_heads + num_kv_heads; head++)
            rotate_head(row + head * head_dim, cos + t * head_dim, sin + t * head_dim, head_dim);
        const int64_t slot = slot_blocks[t] * block_stride + slot_offsets[t] * kv_width;
        std::memcpy(k_cache + slot, row + num_heads * head_dim, kv_width * sizeof(T));
        std::memcpy(v_cache + slot, row + (num_heads + num_kv_heads) * head_dim, kv_width * sizeof(T));
    }
}

}  // namespace

#define NORM_ARGUMENTS(T) \
    const T *delta, T *residual, const T *weight, T *out, int64_t rows, int64_t hidden, float eps, int num_threads
#define SILU_ARGUMENTS(T) const T *gate_up, T *out, int64_t rows, int64_t width, int num_threads
#define ROTARY_ARGUMENTS(T)                                                                                       \
    T *qkv, int64_t row_stride, const T *cos, const T *sin, int64_t rows, int64_t num_heads, int64_t num_kv_heads, \
        int64_t head_dim, T *k_cache, T *v_cache, int64_t block_stride, const int64_t *slot_blocks,               \
        const int64_t *slot_offsets, int num_threads
#define ROTARY_CALL                                                                                     \
    rotary_store_kv(qkv, row_stride, cos, sin, rows, num_heads, num_kv_heads, head_dim, k_cache, v_cache, \
                    block_stride, slot_blocks, slot_offsets, num_threads)

extern "C" {
void add_rms_norm_float32(NORM_ARGUMENTS(float)) {
    add_rms_norm(delta, residual, weight, out, rows, hidden, eps, num_threads);
}
void add_rms_norm_bfloat16(NORM_ARGUMENTS(BFloat16)) {
    add_rms_norm(delta, residual, weight, out, rows, hidden, eps, num_threads);
}
void silu_mul_float32(SILU_ARGUMENTS(float)) { silu_mul(gate_up, out, rows, width, num_threads); }
void silu_mul_bfloat16(SILU_ARGUMENTS(BFloat16)) { silu_mul(gate_up, out, rows, width, num_threads); }
void rotary_store_kv_float32(ROTARY_ARGUMENTS(float)) { ROTARY_CALL; }
void rotary_store_kv_bfloat16(ROTARY_ARGUMENTS(BFloat16)) { ROTARY_CALL; }
}
