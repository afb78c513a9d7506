// Base-model matmuls on the CPU with weights narrower than the activations, for decode-sized
// batches: y[M, N] = x[M, K] W[N, K]^T, x and y float32 or bfloat16, sums in float32.
//
// A decode step reads every weight once and does little with it, so its time is the bytes of
// the weights over the memory bandwidth: 16-bit weights halve float32's, int8 quarters it.
//
//   bfloat16 weights: widened to float32 in registers (a shift), FMA in float32. Exact to the
//   weights' own values: the same sums as x @ W.float()^T, in another order.
//   int8 weights (llama.cpp's q8_0): blocks of 32 along K, each with its float16 scale
//   absmax / 127; x is quantized the same way per call, and each block's dot product is an
//   integer one (AVX2: vpmaddubsw + vpmaddwd; AVX512-VNNI: vpdpbusd), scaled by both blocks'
//   scales. Rows are padded to a multiple of 64 with zero blocks (a 512-bit vector is two).
//
// Weights go by tiles of kTileOutputs rows: a tile is widened (or sign-split) once a row tile
// of x and stays in L1 while every row tile of x passes over it, so a step streams each weight
// once whatever the batch. Tiles are shared out over the OpenMP threads. Built by
// cpu_linear.py with the host compiler, no torch headers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_vectors.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTileOutputs = 4;
// Rows of x a weight tile serves at once: its sums (kTileOutputs each), the tile's vectors and
// one of x in registers.
constexpr int kTileRows = kRegisters >= 32 ? 4 : 2;
constexpr int kBlock = 32;  // int8 weights: elements a scale covers

// x's rows as float32, K apart: bfloat16 rows widened once per call into `scratch`.
inline const float* float_rows(const float* x, int64_t, int64_t, std::vector<float>&) { return x; }
inline const float* float_rows(const BFloat16* x, int64_t rows, int64_t k, std::vector<float>& scratch) {
    scratch.resize(rows * k);
    for (int64_t i = 0; i < rows * k; i++) scratch[i] = load(x[i]);
    return scratch.data();
}

// ---- bfloat16 weights --------------------------------------------------------------------
//
// Packed once at load into panels of kLanes outputs, [panels][k][kLanes] (outputs past n are
// zeros): one vector load is one k for kLanes outputs, so a tile multiplies PANELS such vectors
// by ROWS broadcast activations, as a GEMM micro-kernel does, with no horizontal sums.

constexpr int kMaxPanelRows = 6;

// A vector of v in every lane, in one vbroadcastss (`Floats{} + v` costs an add before it).
inline Floats splat(float v) {
#if defined(__AVX512F__)
    return Floats(_mm512_set1_ps(v));
#elif defined(__AVX__)
    return Floats(_mm256_set1_ps(v));
#else
    Floats out;
    for (int lane = 0; lane < kLanes; lane++) out[lane] = v;
    return out;
#endif
}

// Panels a tile of `rows` rows takes: its sums, the panels' vectors and one broadcast x fit.
constexpr int panels_for(int rows) { return rows <= 2 || kRegisters >= 32 ? 4 : 2; }

int64_t panel_count(int64_t n) { return (n + kLanes - 1) / kLanes; }

template <int ROWS, int PANELS, typename Y>
void panel_tile(const float* x, int64_t k, const BFloat16* panels, Y* y, int64_t n, int64_t first_output) {
    Floats acc[ROWS][PANELS] = {};
    for (int64_t h = 0; h < k; h++) {
        Floats weights[PANELS];
        for (int j = 0; j < PANELS; j++) weights[j] = load_vector(panels + (j * k + h) * kLanes);
        for (int i = 0; i < ROWS; i++) {
            const Floats broadcast = splat(x[i * k + h]);
            for (int j = 0; j < PANELS; j++) acc[i][j] += broadcast * weights[j];
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < PANELS; j++) {
            const int64_t output = first_output + j * kLanes;
            if (output + kLanes <= n && std::is_same_v<Y, float>) {
                store_vector(reinterpret_cast<float*>(y) + i * n + output, acc[i][j]);
            } else {
                for (int lane = 0; lane < kLanes && output + lane < n; lane++)
                    store(y + i * n + output + lane, acc[i][j][lane]);
            }
        }
}

// One instance per (rows, panels) of a tile: the sums then live in registers.
template <typename Y>
void dispatch_panel_tile(int rows, int panels, const float* x, int64_t k, const BFloat16* w, Y* y, int64_t n,
                         int64_t first_output) {
#define PANEL_CASE(R, P)                                                               \
    case (R) * 8 + (P):                                                                \
        if constexpr (P <= panels_for(R)) panel_tile<R, P>(x, k, w, y, n, first_output); \
        return;
    switch (rows * 8 + panels) {
        PANEL_CASE(1, 1) PANEL_CASE(1, 2) PANEL_CASE(1, 3) PANEL_CASE(1, 4)
        PANEL_CASE(2, 1) PANEL_CASE(2, 2) PANEL_CASE(2, 3) PANEL_CASE(2, 4)
        PANEL_CASE(3, 1) PANEL_CASE(3, 2) PANEL_CASE(3, 3) PANEL_CASE(3, 4)
        PANEL_CASE(4, 1) PANEL_CASE(4, 2) PANEL_CASE(4, 3) PANEL_CASE(4, 4)
        PANEL_CASE(5, 1) PANEL_CASE(5, 2) PANEL_CASE(5, 3) PANEL_CASE(5, 4)
        PANEL_CASE(6, 1) PANEL_CASE(6, 2) PANEL_CASE(6, 3) PANEL_CASE(6, 4)
    }
#undef PANEL_CASE
}

template <typename X>
void linear_bf16(const X* x, int64_t rows, int64_t k, const BFloat16* packed, int64_t n, X* y, int num_threads) {
    std::vector<float> scratch;
    const float* xs = float_rows(x, rows, k, scratch);
    const int group = panels_for(rows < kMaxPanelRows ? int(rows) : kMaxPanelRows);  // fits every row tile
#pragma omp parallel num_threads(num_threads)
    {
        // Each thread its own panels; a group of them stays in cache while every row tile passes.
        const auto [begin, end] = thread_share(panel_count(n), omp_get_thread_num(), omp_get_num_threads());
        for (int64_t panel = begin; panel < end; panel += group) {
            const int panels = end - panel < group ? int(end - panel) : group;
            for (int64_t row = 0; row < rows; row += kMaxPanelRows) {
                const int tile_rows = rows - row < kMaxPanelRows ? int(rows - row) : kMaxPanelRows;
                dispatch_panel_tile(tile_rows, panels, xs + row * k, k, packed + panel * k * kLanes, y + row * n, n,
                                    panel * kLanes);
            }
        }
    }
}

// w [n, k] into panels (see above).
void pack_bf16(const BFloat16* w, int64_t n, int64_t k, BFloat16* packed) {
    for (int64_t panel = 0; panel < panel_count(n); panel++)
        for (int64_t h = 0; h < k; h++)
            for (int lane = 0; lane < kLanes; lane++) {
                const int64_t output = panel * kLanes + lane;
                packed[(panel * k + h) * kLanes + lane] = output < n ? w[output * k + h] : BFloat16{0};
            }
}

// ---- int8 weights ------------------------------------------------------------------------

// x quantized as the weights are: per row, blocks of 32 with scale absmax / 127, rounded to
// nearest; `padded` (a multiple of 64) past k is zeros.
struct QuantizedRows {
    std::vector<int8_t> values;  // [rows, padded]
    std::vector<float> scales;   // [rows, padded / 32]
};

void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t padded, QuantizedRows& q) {
    const int64_t blocks = padded / kBlock;
    q.values.assign(rows * padded, 0);
    q.scales.assign(rows * blocks, 0.0f);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < blocks && b * kBlock < k; b++) {
            const float* block = x + i * k + b * kBlock;
            const int64_t length = k - b * kBlock < kBlock ? k - b * kBlock : kBlock;
            float amax = 0.0f;
            for (int64_t t = 0; t < length; t++) amax = std::max(amax, std::abs(block[t]));
            const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
            q.scales[i * blocks + b] = scale;
            for (int64_t t = 0; t < length; t++)
                q.values[i * padded + b * kBlock + t] = int8_t(__builtin_nearbyintf(block[t] * inverse));
        }
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24
        const float value = float(mantissa) * 5.9604645e-8f;
        std::memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// sums[i][o] = sum over blocks of (qx_i . qw_o)_block * sx_i,block * sw_o,block.
template <int ROWS, int OUTS>
void dot_tile_int8(const QuantizedRows& x, int64_t row0, const int8_t* w, const uint16_t* w_scales, int64_t padded,
                   float sums[kTileRows][kTileOutputs]) {
    const int64_t blocks = padded / kBlock;
    const int8_t* xs = x.values.data() + row0 * padded;
    const float* x_scales = x.scales.data() + row0 * blocks;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    // Two blocks a vector. vpdpbusd multiplies unsigned by signed bytes: x + 128 by w, less
    // 128 * sum(w), which is computed once per weight vector for all rows.
    __m512 acc[ROWS][OUTS];
    for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
    const __m512i bias = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < blocks; b += 2) {
        __m512i weights[OUTS], offsets[OUTS];
        __m512 w_scale[OUTS];
        for (int o = 0; o < OUTS; o++) {
            weights[o] = _mm512_loadu_si512(w + o * padded + b * kBlock);
            offsets[o] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, weights[o]), 7);
            const uint16_t* scale = w_scales + o * blocks + b;
            w_scale[o] = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half_to_float(scale[0])),
                                              _mm512_set1_ps(half_to_float(scale[1])));
        }
        for (int i = 0; i < ROWS; i++) {
            const __m512i row = _mm512_xor_si512(_mm512_loadu_si512(xs + i * padded + b * kBlock), bias);
            const float* scale = x_scales + i * blocks + b;
            const __m512 x_scale =
                _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(scale[0]), _mm512_set1_ps(scale[1]));
            for (int o = 0; o < OUTS; o++) {
                const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), row, weights[o]),
                                                     offsets[o]);
                acc[i][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(x_scale, w_scale[o]), acc[i][o]);
            }
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int o = 0; o < OUTS; o++) sums[i][o] = _mm512_reduce_add_ps(acc[i][o]);
#elif defined(__AVX2__)
    // One block a vector. vpmaddubsw multiplies unsigned by signed bytes: |w| by x with w's sign
    // (vpsignb), pairs summed to int16 (at most 2 * 127 * 127: no saturation), then to int32.
    __m256 acc[ROWS][OUTS];
    for (auto& row : acc)
        for (auto& a : row) a = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i weights[OUTS], magnitudes[OUTS];
        float w_scale[OUTS];
        for (int o = 0; o < OUTS; o++) {
            weights[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * padded + b * kBlock));
            magnitudes[o] = _mm256_sign_epi8(weights[o], weights[o]);
            w_scale[o] = half_to_float(w_scales[o * blocks + b]);
        }
        for (int i = 0; i < ROWS; i++) {
            const __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + i * padded + b * kBlock));
            const float x_scale = x_scales[i * blocks + b];
            for (int o = 0; o < OUTS; o++) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitudes[o], _mm256_sign_epi8(row, weights[o]));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                acc[i][o] = _mm256_fmadd_ps(dot, _mm256_set1_ps(x_scale * w_scale[o]), acc[i][o]);
            }
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int o = 0; o < OUTS; o++) sums[i][o] = lanes_sum(Floats8(acc[i][o]));
#else
    for (int i = 0; i < ROWS; i++)
        for (int o = 0; o < OUTS; o++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int t = 0; t < kBlock; t++)
                    dot += int32_t(xs[i * padded + b * kBlock + t]) * int32_t(w[o * padded + b * kBlock + t]);
                sum += float(dot) * x_scales[i * blocks + b] * half_to_float(w_scales[o * blocks + b]);
            }
            sums[i][o] = sum;
        }
#endif
}

// ---- the matmul over tiles ---------------------------------------------------------------

// Calls tile(ROWS, OUTS instance, first row, first output) for every tile of the [rows, n]
// output, output tiles shared out over the threads, and stores its sums into y.
template <typename Y, typename TileFunction>
void over_tiles(int64_t rows, int64_t n, Y* y, int num_threads, TileFunction tile) {
    const int64_t tiles = (n + kTileOutputs - 1) / kTileOutputs;
#pragma omp parallel num_threads(num_threads)
    {
        const auto [begin, end] = thread_share(tiles, omp_get_thread_num(), omp_get_num_threads());
        float sums[kTileRows][kTileOutputs];
        for (int64_t t = begin; t < end; t++) {
            const int64_t first_output = t * kTileOutputs;
            const int outs = n - first_output < kTileOutputs ? int(n - first_output) : kTileOutputs;
            for (int64_t row = 0; row < rows; row += kTileRows) {
                const int tile_rows = rows - row < kTileRows ? int(rows - row) : kTileRows;
                tile(tile_rows, outs, row, first_output, sums);
                for (int i = 0; i < tile_rows; i++)
                    for (int o = 0; o < outs; o++) store(y + (row + i) * n + first_output + o, sums[i][o]);
            }
        }
    }
}

// One instance per (rows, outputs) of a tile: the sums then live in registers.
template <template <int, int> class Kernel, typename... Args>
void dispatch_tile(int rows, int outs, Args&&... args) {
    static_assert(kTileOutputs == 4 && (kTileRows == 2 || kTileRows == 4));
#define TILE_CASE(R, O) \
    case (R) * 8 + (O): \
        Kernel<R, O>::run(args...); \
        return;
    switch (rows * 8 + outs) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
    }
#undef TILE_CASE
}

template <int R, int O>
struct Int8Tile {
    static void run(const QuantizedRows& x, int64_t row0, const int8_t* w, const uint16_t* scales, int64_t padded,
                    float (*sums)[kTileOutputs]) {
        if constexpr (R <= kTileRows) dot_tile_int8<R, O>(x, row0, w, scales, padded, sums);
    }
};

template <typename X>
void linear_int8(const X* x, int64_t rows, int64_t k, const int8_t* w, const uint16_t* scales, int64_t padded,
                 int64_t n, X* y, int num_threads) {
    std::vector<float> scratch;
    QuantizedRows quantized;
    quantize_rows(float_rows(x, rows, k, scratch), rows, k, padded, quantized);
    const int64_t blocks = padded / kBlock;
    over_tiles(rows, n, y, num_threads, [&](int tile_rows, int outs, int64_t row, int64_t output, auto sums) {
        dispatch_tile<Int8Tile>(tile_rows, outs, quantized, row, w + output * padded, scales + output * blocks, padded,
                                sums);
    });
}

}  // namespace

extern "C" {
int64_t bf16_packed_elements(int64_t n, int64_t k) { return panel_count(n) * kLanes * k; }
void bf16_pack(const BFloat16* w, int64_t n, int64_t k, BFloat16* packed) { pack_bf16(w, n, k, packed); }
void linear_bf16_float32(const float* x, int64_t rows, int64_t k, const BFloat16* w, int64_t n, float* y, int threads) {
    linear_bf16(x, rows, k, w, n, y, threads);
}
void linear_bf16_bfloat16(const BFloat16* x, int64_t rows, int64_t k, const BFloat16* w, int64_t n, BFloat16* y,
                          int threads) {
    linear_bf16(x, rows, k, w, n, y, threads);
}
void linear_int8_float32(const float* x, int64_t rows, int64_t k, const int8_t* w, const uint16_t* scales,
                         int64_t padded, int64_t n, float* y, int threads) {
    linear_int8(x, rows, k, w, scales, padded, n, y, threads);
}
void linear_int8_bfloat16(const BFloat16* x, int64_t rows, int64_t k, const int8_t* w, const uint16_t* scales,
                          int64_t padded, int64_t n, BFloat16* y, int threads) {
    linear_int8(x, rows, k, w, scales, padded, n, y, threads);
}
// The instruction set this build uses for int8 dot products: what tests and logs report.
const char* int8_path() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}
}
