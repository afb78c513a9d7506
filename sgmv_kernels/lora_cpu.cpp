// Multi-LoRA on the CPU: out += LoRA(x) with each row's own adapter, weights read in the pool.
//
// The semantics of the Triton kernels (shrink.py, expand.py), for a group of projections
// that share the input x and whose outputs lie side by side in `out` (q/k/v, gate/up; o and
// down alone):
//
//     for each adapted row t with slot w, and each projection j of the group:
//         y = x[t] @ A_j[w]^T                                  (rank ranks[j][w], float32)
//         out[t, columns of j] += (y @ B_j[w]^T) * scales[j][w]
//
// A's rows and B^T's rows are read where the pool keeps them (row tables, layout.py), at each
// adapter's true rank. Rows arrive sorted by slot and cut into chunks of at most kChunkRows
// rows of one slot: a chunk reads its adapter's rows once for all of its rows, so a decode
// step streams each running adapter's weights once. Chunks are shared out over the OpenMP
// threads (the libgomp team torch uses); fewer chunks than threads (one chat) are each split
// instead, A's rows and then B's columns shared out, so every core reads the adapter. Either
// way each sum is taken in the same order, so a row's result does not depend on the split.
// Math in float32; each output element is rounded once, as torch's out.add_(float32 delta)
// rounds it.
//
// Built by native.py with the host compiler (-O3 -march=native), no torch headers.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_vectors.h"

namespace {

constexpr int kChunkRows = 8;

// A row of T to float32 (the FMA shrink reads x as float32): vectors, then the tail one by one.
template <typename T>
inline void load_row(const T* source, int64_t length, float* target) {
    int64_t h = 0;
    for (; h + kLanes <= length; h += kLanes) store_vector(target + h, load_vector(source + h));
    for (; h < length; h++) target[h] = load(source[h]);
}


// Independent sums to keep in flight: an FMA waits ~4 cycles for the previous one into the
// same register, and two FMA units want ~8 chains busy. Fewer rows, more chains per row.
template <int ROWS>
constexpr int chains_per_row() {
    return ROWS >= 8 ? 1 : 8 / ROWS;
}

// Asked for while A's row k is computed: the row after next (this row's lines are on their way
// already) and B^T's row k, which the expand reads next. Returns where the row after next starts.
template <typename T>
inline const char* prefetch_for_row(const T* pool, const int64_t* a_rows, const int64_t* b_rows, int k, int rank,
                                    int64_t width) {
    prefetch_lines(pool + b_rows[k], width * sizeof(T));
    return reinterpret_cast<const char*>(pool + a_rows[k + 2 < rank ? k + 2 : rank - 1]);
}

// y[i * max_rank + k] = xs[i] . A[k] for the chunk's ROWS rows (xs: float32, in_features apart).
template <int ROWS, typename T>
void shrink(const float* xs, int64_t in_features, const T* pool, const int64_t* a_rows, int rank, float* y,
            int64_t max_rank, const int64_t* b_rows, int64_t width) {
    constexpr int kChains = chains_per_row<ROWS>();
    const int64_t unrolled = in_features / (kLanes * kChains) * (kLanes * kChains);
    const int64_t vectorized = in_features / kLanes * kLanes;
    for (int k = 0; k < rank; k++) {
        const T* a = pool + a_rows[k];
        const char* ahead = prefetch_for_row(pool, a_rows, b_rows, k, rank, width);
        Floats sums[ROWS][kChains] = {};
        int64_t h = 0;
        for (; h < unrolled; h += kLanes * kChains) {
            prefetch_lines(ahead + h * sizeof(T), kLanes * kChains * sizeof(T));
            for (int chain = 0; chain < kChains; chain++) {
                const Floats weights = load_vector(a + h + chain * kLanes);
                for (int i = 0; i < ROWS; i++)
                    sums[i][chain] += load_vector(xs + i * in_features + h + chain * kLanes) * weights;
            }
        }
        for (; h < vectorized; h += kLanes) {
            const Floats weights = load_vector(a + h);
            for (int i = 0; i < ROWS; i++) sums[i][0] += load_vector(xs + i * in_features + h) * weights;
        }
        for (int i = 0; i < ROWS; i++) {
            for (int chain = 1; chain < kChains; chain++) sums[i][0] += sums[i][chain];
            float sum = lanes_sum(sums[i][0]);
            for (int64_t tail = vectorized; tail < in_features; tail++)
                sum += xs[i * in_features + tail] * load(a[tail]);
            y[i * max_rank + k] = sum;
        }
    }
}

#ifdef __AVX512BF16__
// shrink() for bfloat16 rows on the CPU's bf16 dot-product instruction (vdpbf16ps): 32 of A's
// weights against 32 of x's values as they are, with no conversion to float32 (which made the
// shrink compute-bound). A product of two bfloat16 is exact in float32 and the products are
// summed in float32, as shrink() sums them, in another order (and denormals count as zero).
constexpr bool kBf16DotProducts = true;

template <int ROWS>
void shrink_bf16(const BFloat16* const* x_rows, int64_t in_features, const BFloat16* pool, const int64_t* a_rows,
                 int rank, float* y, int64_t max_rank, const int64_t* b_rows, int64_t width) {
    constexpr int kPairLanes = 32;  // bfloat16 per vector
    constexpr int kChains = chains_per_row<ROWS>();
    const int64_t unrolled = in_features / (kPairLanes * kChains) * (kPairLanes * kChains);
    for (int k = 0; k < rank; k++) {
        const BFloat16* a = pool + a_rows[k];
        const char* ahead = prefetch_for_row(pool, a_rows, b_rows, k, rank, width);
        __m512 sums[ROWS][kChains];
        for (int i = 0; i < ROWS; i++)
            for (int chain = 0; chain < kChains; chain++) sums[i][chain] = _mm512_setzero_ps();
        int64_t h = 0;
        for (; h < unrolled; h += kPairLanes * kChains) {
            prefetch_lines(ahead + h * sizeof(BFloat16), kPairLanes * kChains * sizeof(BFloat16));
            for (int chain = 0; chain < kChains; chain++) {
                const __m512bh weights = (__m512bh)_mm512_loadu_si512(a + h + chain * kPairLanes);
                for (int i = 0; i < ROWS; i++) {
                    const __m512bh xs = (__m512bh)_mm512_loadu_si512(x_rows[i] + h + chain * kPairLanes);
                    sums[i][chain] = _mm512_dpbf16_ps(sums[i][chain], weights, xs);
                }
            }
        }
        for (; h < in_features; h += kPairLanes) {  // masked: lanes past the row's end load as zeros
            const __mmask32 lanes = in_features - h >= kPairLanes ? ~0u : (1u << (in_features - h)) - 1;
            const __m512bh weights = (__m512bh)_mm512_maskz_loadu_epi16(lanes, a + h);
            for (int i = 0; i < ROWS; i++) {
                const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(lanes, x_rows[i] + h);
                sums[i][0] = _mm512_dpbf16_ps(sums[i][0], weights, xs);
            }
        }
        for (int i = 0; i < ROWS; i++) {
            for (int chain = 1; chain < kChains; chain++) sums[i][0] = _mm512_add_ps(sums[i][0], sums[i][chain]);
            y[i * max_rank + k] = lanes_sum(Floats16(sums[i][0]));
        }
    }
}
#else
constexpr bool kBf16DotProducts = false;

// Declared only: chunk() names it in a branch it never takes here.
template <int ROWS>
void shrink_bf16(const BFloat16* const* x_rows, int64_t in_features, const BFloat16* pool, const int64_t* a_rows,
                 int rank, float* y, int64_t max_rank, const int64_t* b_rows, int64_t width) = delete;
#endif

// Whether rows of T take shrink_bf16, which reads x as it is, or shrink(), which reads float32 copies.
template <typename T>
constexpr bool kDotProductShrink = kBf16DotProducts && std::is_same_v<T, BFloat16>;

// out[i][o .. o + VECTORS * kLanes) += scale * (y[i] @ B^T) for the chunk's ROWS rows: the
// ROWS x VECTORS partial sums stay in registers while B's rows stream past.
template <int ROWS, int VECTORS, typename T>
inline void expand_block(const float* y, int64_t max_rank, const T* pool, const int64_t* b_rows, int rank,
                         float scale, T* const* targets, int64_t o) {
    Floats sums[ROWS][VECTORS] = {};
    for (int k = 0; k < rank; k++) {
        const T* b = pool + b_rows[k] + o;
        prefetch_lines(b + 256 / sizeof(T), VECTORS * kLanes * sizeof(T));
        Floats weights[VECTORS];
        for (int v = 0; v < VECTORS; v++) weights[v] = load_vector(b + v * kLanes);
        for (int i = 0; i < ROWS; i++) {
            const float factor = y[i * max_rank + k];
            for (int v = 0; v < VECTORS; v++) sums[i][v] += factor * weights[v];
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int v = 0; v < VECTORS; v++) {
            T* target = targets[i] + o + v * kLanes;
            store_vector(target, load_vector(target) + sums[i][v] * scale);
        }
}

// The columns expand() takes at a time for ROWS rows: enough sums in flight for few rows, as
// long as each vector's ROWS sums and weights fit.
template <int ROWS>
constexpr int64_t expand_columns() {
    return vectors_that_fit(chains_per_row<ROWS>() > 2 ? chains_per_row<ROWS>() : 2, ROWS + 1) * kLanes;
}

// Columns [o, width) of one projection; o a multiple of expand_columns<ROWS>().
template <int ROWS, typename T>
void expand(const float* y, int64_t max_rank, const T* pool, const int64_t* b_rows, int rank, float scale,
            T* const* targets, int64_t width, int64_t o = 0) {
    constexpr int kVectors = expand_columns<ROWS>() / kLanes;
    for (; o + kVectors * kLanes <= width; o += kVectors * kLanes)
        expand_block<ROWS, kVectors>(y, max_rank, pool, b_rows, rank, scale, targets, o);
    for (; o + kLanes <= width; o += kLanes)
        expand_block<ROWS, 1>(y, max_rank, pool, b_rows, rank, scale, targets, o);
    for (; o < width; o++)  // the last few columns, one at a time
        for (int i = 0; i < ROWS; i++) {
            float sum = 0.0f;
            for (int k = 0; k < rank; k++) sum += y[i * max_rank + k] * load(pool[b_rows[k] + o]);
            store(targets[i] + o, load(targets[i][o]) + sum * scale);
        }
}

// This thread's part of a chunk that all `threads` work on together (threads 1: the whole).
struct Split {
    int64_t thread, threads;
};

// One chunk (ROWS rows of one slot) through every projection of the group. Split over threads,
// each takes a share of A's rows into the shared y, and after a barrier a share of B's columns.
template <int ROWS, typename T>
void chunk(const T* x, int64_t x_stride, int64_t in_features, const T* pool, const int64_t* a_rows,
           const int64_t* b_rows, const int32_t* ranks, const float* scales, int64_t num_slots, int64_t max_rank,
           const int64_t* widths, int64_t num_projections, const int64_t* rows, int32_t slot, T* out,
           int64_t out_stride, float* xs, float* y, Split split) {
    const T* x_rows[ROWS];
    for (int i = 0; i < ROWS; i++) x_rows[i] = x + rows[i] * x_stride;
    if constexpr (!kDotProductShrink<T>)
        for (int i = 0; i < ROWS; i++) load_row(x_rows[i], in_features, xs + i * in_features);
    T* targets[ROWS];
    for (int i = 0; i < ROWS; i++) targets[i] = out + rows[i] * out_stride;
    for (int64_t j = 0; j < num_projections; j++) {
        const int64_t table = j * num_slots + slot;
        const int rank = ranks[table];
        if (rank > 0) {
            const int64_t* a_table = a_rows + table * max_rank;
            const int64_t* b_table = b_rows + table * max_rank;
            const auto [k, k_end] = thread_share(rank, split.thread, split.threads);
            const int part = int(k_end - k);
            if constexpr (kDotProductShrink<T>)
                shrink_bf16<ROWS>(x_rows, in_features, pool, a_table + k, part, y + k, max_rank, b_table + k, widths[j]);
            else
                shrink<ROWS>(xs, in_features, pool, a_table + k, part, y + k, max_rank, b_table + k, widths[j]);
            const int64_t blocks = (widths[j] + expand_columns<ROWS>() - 1) / expand_columns<ROWS>();
            const auto [block, block_end] = thread_share(blocks, split.thread, split.threads);
            if (split.threads > 1) {
#pragma omp barrier
            }
            expand<ROWS>(y, max_rank, pool, b_table, rank, scales[table], targets,
                         std::min(widths[j], block_end * expand_columns<ROWS>()), block * expand_columns<ROWS>());
            if (split.threads > 1) {  // y is the next projection's
#pragma omp barrier
            }
        }
        for (int i = 0; i < ROWS; i++) targets[i] += widths[j];
    }
}

// Shapes: x rows x_stride apart (in_features used); out rows out_stride apart; a_rows, b_rows
// [projections, slots, max_rank] element offsets into pool; ranks, scales [projections, slots];
// widths [projections] output columns of each projection; order [N] the adapted rows sorted by
// slot; chunks [num_chunks, 3] (first, end, slot) into order.
template <typename T>
void lora_add(const T* x, int64_t x_stride, int64_t in_features, const T* pool, const int64_t* a_rows,
              const int64_t* b_rows, const int32_t* ranks, const float* scales, int64_t num_slots, int64_t max_rank,
              const int64_t* widths, int64_t num_projections, const int64_t* order, const int32_t* chunks,
              int64_t num_chunks, T* out, int64_t out_stride, int num_threads) {
    std::vector<float> shared_y(kChunkRows * max_rank);  // a split chunk's y, which every thread reads
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> xs(kDotProductShrink<T> ? 0 : kChunkRows * in_features), own_y(kChunkRows * max_rank);
        const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
        // Each thread takes a contiguous share of the chunks: a slot's chunks mostly stay on one
        // thread, which then reads its adapter's weights once. Fewer chunks than threads: every
        // thread on each chunk in turn.
        const bool split = num_chunks < threads;
        const auto [begin, end] = split ? Share{0, num_chunks} : thread_share(num_chunks, thread, threads);
        float* y = split ? shared_y.data() : own_y.data();
        const Split part = split ? Split{thread, threads} : Split{0, 1};
        for (int64_t c = begin; c < end; c++) {
            const int32_t first = chunks[3 * c], rows = chunks[3 * c + 1] - first, slot = chunks[3 * c + 2];
            // One instance per row count: the per-row partial sums then live in registers.
            switch (rows) {
#define LORA_CHUNK(ROWS)                                                                                          \
    case ROWS:                                                                                                    \
        chunk<ROWS>(x, x_stride, in_features, pool, a_rows, b_rows, ranks, scales, num_slots, max_rank, widths, \
                    num_projections, order + first, slot, out, out_stride, xs.data(), y, part);                \
        break;
                LORA_CHUNK(1) LORA_CHUNK(2) LORA_CHUNK(3) LORA_CHUNK(4)
                LORA_CHUNK(5) LORA_CHUNK(6) LORA_CHUNK(7) LORA_CHUNK(8)
#undef LORA_CHUNK
            }
        }
    }
}

}  // namespace

#define LORA_ADD_ARGUMENTS(T)                                                                                 \
    const T *x, int64_t x_stride, int64_t in_features, const T *pool, const int64_t *a_rows,                 \
        const int64_t *b_rows, const int32_t *ranks, const float *scales, int64_t num_slots, int64_t max_rank, \
        const int64_t *widths, int64_t num_projections, const int64_t *order, const int32_t *chunks,          \
        int64_t num_chunks, T *out, int64_t out_stride, int num_threads
#define LORA_ADD_CALL                                                                                      \
    lora_add(x, x_stride, in_features, pool, a_rows, b_rows, ranks, scales, num_slots, max_rank, widths, \
             num_projections, order, chunks, num_chunks, out, out_stride, num_threads)

extern "C" {
void lora_add_float32(LORA_ADD_ARGUMENTS(float)) { LORA_ADD_CALL; }
void lora_add_bfloat16(LORA_ADD_ARGUMENTS(BFloat16)) { LORA_ADD_CALL; }
}
