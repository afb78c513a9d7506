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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_vectors.h"

namespace {

// The next row's K and V blocks, asked for a few cache lines per token of the current row:
// the next row then starts with its context on its way instead of waiting on memory block
// by block (blocks lie scattered, so the hardware prefetchers cannot guess them).
template <typename T>
struct UpcomingRow {
    const T* k_cache;
    const T* v_cache;
    int64_t block_stride, lines_per_block;
    const int64_t* table;
    int64_t num_blocks;
    int64_t lines_per_token;  // set so that the whole row is asked for over the current row's tokens
    int64_t block = 0, line = 0;  // the cursor: K's blocks, then V's (block num_blocks .. 2 num_blocks - 1)

    void fetch() {
        for (int64_t n = 0; n < lines_per_token && block < 2 * num_blocks; n++) {
            const T* cache = block < num_blocks ? k_cache + table[block] * block_stride
                                                : v_cache + table[block - num_blocks] * block_stride;
            prefetch_line(reinterpret_cast<const char*>(cache) + line * 64);
            if (++line == lines_per_block) line = 0, block++;
        }
    }
};

// Where one row's tokens lie in the cache, and the shapes every phase needs.
template <typename T>
struct RowCache {
    const T* cache;  // k_cache or v_cache
    int64_t block_stride, block_size, token_stride;
    const int64_t* table;  // this row's block table
    int64_t length;        // its context length
    int64_t num_heads, num_kv_heads, head_dim;
    UpcomingRow<T>* upcoming;  // the row this thread takes next (nothing to fetch after its last)

    const T* token(int64_t l) const { return cache + table[l / block_size] * block_stride + (l % block_size) * token_stride; }

    // At the first token of each block, ask for the block two ahead (the first two at the start).
    void prefetch_ahead(int64_t l) const {
        upcoming->fetch();
        const int64_t bytes = block_size * token_stride * int64_t(sizeof(T));
        if (l == 0)
            for (int64_t ahead = 0; ahead < 2 && ahead * block_size < length; ahead++)
                prefetch_lines(cache + table[ahead] * block_stride, bytes);
        if (l % block_size == 0 && l + 2 * block_size < length)
            prefetch_lines(cache + table[l / block_size + 2] * block_stride, bytes);
    }
};

// scores[head, l] = queries[head] . K[l, head / G], any head_dim: one dot product at a time.
template <typename T>
void score_keys(const RowCache<T>& keys, const float* queries, float* scores) {
    const int64_t head_dim = keys.head_dim, per_kv_head = keys.num_heads / keys.num_kv_heads;
    const int64_t vectorized = head_dim / kLanes * kLanes, length = keys.length;
    for (int64_t l = 0; l < length; l++) {
        keys.prefetch_ahead(l);
        const T* token = keys.token(l);
        for (int64_t head = 0; head < keys.num_heads; head++) {
            const float* q = queries + head * head_dim;
            const T* k = token + (head / per_kv_head) * head_dim;
            Floats sum = {};
            for (int64_t d = 0; d < vectorized; d += kLanes) sum += load_vector(q + d) * load_vector(k + d);
            float total = lanes_sum(sum);
            for (int64_t d = vectorized; d < head_dim; d++) total += q[d] * load(k[d]);
            scores[head * length + l] = total;
        }
    }
}

// The lanes that round `round` of sum_each takes from a pair of vectors: each half of the
// result holds one vector's lanes, pairs of groups of (kLanes / 2 >> round) added, the low
// groups here, the high ones that many lanes further.
template <int LANES>
struct Pairing;
template <>
struct Pairing<16> {
    static constexpr int kRounds = 4;
    static constexpr int32_t kLow[4][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                            {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                                            {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                                            {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
};
template <>
struct Pairing<8> {
    static constexpr int kRounds = 3;
    static constexpr int32_t kLow[3][8] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
};

// kLanes vectors in, one out whose lane i is the sum of vector i's lanes: rounds of pairing
// halves (45 shuffles and adds for 16 sums, against ~10 per sum one at a time).
inline Floats sum_each(Floats (&v)[kLanes]) {
    using Tables = Pairing<kLanes>;
    int count = kLanes;
    for (int round = 0; round < Tables::kRounds; round++) {
        Ints low;
        std::memcpy(&low, Tables::kLow[round], sizeof low);
        const Ints high = low + (kLanes / 2 >> round);
        count /= 2;
        for (int i = 0; i < count; i++)
            v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], low) + __builtin_shuffle(v[2 * i], v[2 * i + 1], high);
    }
    return v[0];
}

// score_keys for head_dim = kLanes V: each key is loaded once for its G query heads, and the
// products of kLanes tokens are summed together by sum_each.
template <typename T, int V>
void score_keys_blocked(const RowCache<T>& keys, const float* queries, float* scores) {
    const int64_t num_heads = keys.num_heads, per_kv_head = num_heads / keys.num_kv_heads, length = keys.length;
    thread_local std::vector<Floats> products;  // [num_heads][kLanes]
    products.resize(num_heads * kLanes);
    for (int64_t first = 0; first < length; first += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, length - first);
        for (int64_t t = 0; t < kLanes; t++) {
            if (t >= count) {
                for (int64_t head = 0; head < num_heads; head++) products[head * kLanes + t] = Floats{};
                continue;
            }
            keys.prefetch_ahead(first + t);
            const T* token = keys.token(first + t);
            for (int64_t kv_head = 0; kv_head < keys.num_kv_heads; kv_head++) {
                Floats k[V];
                for (int v = 0; v < V; v++) k[v] = load_vector(token + (kv_head * V + v) * kLanes);
                for (int64_t head = kv_head * per_kv_head; head < (kv_head + 1) * per_kv_head; head++) {
                    const float* q = queries + head * V * kLanes;
                    Floats sum = load_vector(q) * k[0];
                    for (int v = 1; v < V; v++) sum += load_vector(q + v * kLanes) * k[v];
                    products[head * kLanes + t] = sum;
                }
            }
        }
        for (int64_t head = 0; head < num_heads; head++) {
            Floats (&group)[kLanes] = *reinterpret_cast<Floats(*)[kLanes]>(&products[head * kLanes]);
            const Floats sums = sum_each(group);
            std::memcpy(scores + head * length + first, &sums, count * sizeof(float));
        }
    }
}

// sums[head] = sum over l of probs[head, l] * V[l, head / G], any shape: one head at a time.
template <typename T>
void sum_values(const RowCache<T>& values, const float* probs, float* sums) {
    const int64_t head_dim = values.head_dim, per_kv_head = values.num_heads / values.num_kv_heads;
    const int64_t vectorized = head_dim / kLanes * kLanes, length = values.length;
    std::fill(sums, sums + values.num_heads * head_dim, 0.0f);
    for (int64_t l = 0; l < length; l++) {
        values.prefetch_ahead(l);
        const T* token = values.token(l);
        for (int64_t head = 0; head < values.num_heads; head++) {
            float* acc = sums + head * head_dim;
            const float weight = probs[head * length + l];
            const T* v = token + (head / per_kv_head) * head_dim;
            for (int64_t d = 0; d < vectorized; d += kLanes) {
                const Floats sum = load_vector(acc + d) + weight * load_vector(v + d);
                std::memcpy(acc + d, &sum, sizeof sum);
            }
            for (int64_t d = vectorized; d < head_dim; d++) acc[d] += weight * load(v[d]);
        }
    }
}

// sum_values for head_dim = kLanes V and G query heads per KV head: the G heads' sums of C
// of the V vectors (all V where their sums and values fit in the registers) stay in registers
// while a span of the row's values streams past (spans of 128 tokens, so the other KV heads
// and vectors find them in cache).
template <typename T, int V, int G>
void sum_values_blocked(const RowCache<T>& values, const float* probs, float* sums) {
    constexpr int64_t kSpan = 128;
    constexpr int C = vectors_that_fit(V, G + 1);
    const int64_t length = values.length;
    std::fill(sums, sums + values.num_heads * V * kLanes, 0.0f);
    for (int64_t first = 0; first < length; first += kSpan) {
        const int64_t last = std::min(first + kSpan, length);
        for (int64_t kv_head = 0; kv_head < values.num_kv_heads; kv_head++) {
            const float* head_probs = probs + kv_head * G * length;
            for (int pass = 0; pass < V; pass += C) {
                float* head_sums = sums + (kv_head * G * V + pass) * kLanes;
                Floats acc[G][C];
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < C; i++) acc[g][i] = load_vector(head_sums + (g * V + i) * kLanes);
                for (int64_t l = first; l < last; l++) {
                    if (kv_head == 0 && pass == 0) values.prefetch_ahead(l);
                    const T* token = values.token(l) + (kv_head * V + pass) * kLanes;
                    Floats v[C];
                    for (int i = 0; i < C; i++) v[i] = load_vector(token + i * kLanes);
                    for (int g = 0; g < G; g++)
                        for (int i = 0; i < C; i++) acc[g][i] += head_probs[g * length + l] * v[i];
                }
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < C; i++) store_vector(head_sums + (g * V + i) * kLanes, acc[g][i]);
            }
        }
    }
}

template <typename T>
struct Phases {
    void (*score)(const RowCache<T>&, const float*, float*);
    void (*sum)(const RowCache<T>&, const float*, float*);
};

template <typename T, int V, int G>
Phases<T> blocked() {
    return {score_keys_blocked<T, V>, sum_values_blocked<T, V, G>};
}

// The blocked phases for head_dim 64 or 128 with up to 8 query heads per KV head (every
// common model), the general ones otherwise.
template <typename T>
Phases<T> phases_for(int64_t head_dim, int64_t per_kv_head) {
    constexpr int V64 = 64 / kLanes, V128 = 128 / kLanes;
    static const Phases<T> by_shape[2][8] = {
        {blocked<T, V64, 1>(), blocked<T, V64, 2>(), blocked<T, V64, 3>(), blocked<T, V64, 4>(),
         blocked<T, V64, 5>(), blocked<T, V64, 6>(), blocked<T, V64, 7>(), blocked<T, V64, 8>()},
        {blocked<T, V128, 1>(), blocked<T, V128, 2>(), blocked<T, V128, 3>(), blocked<T, V128, 4>(),
         blocked<T, V128, 5>(), blocked<T, V128, 6>(), blocked<T, V128, 7>(), blocked<T, V128, 8>()}};
    if ((head_dim == 64 || head_dim == 128) && per_kv_head >= 1 && per_kv_head <= 8)
        return by_shape[head_dim == 128][per_kv_head - 1];
    return {score_keys<T>, sum_values<T>};
}

template <typename T>
void paged_decode_attention(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                            int64_t block_stride, const int64_t* block_tables, int64_t max_blocks,
                            const int64_t* context_lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, T* out, int num_threads) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const Phases<T> phases = phases_for<T>(head_dim, num_heads / num_kv_heads);
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> queries(num_heads * head_dim), sums(num_heads * head_dim);
        std::vector<float> scores(num_heads * max_blocks * block_size);
        // One row at a time, all of its heads: each of its blocks is read once, as a whole.
        // Each thread takes a contiguous share of the rows, so it knows which row comes next.
        const auto [begin, end] = thread_share(rows, omp_get_thread_num(), omp_get_num_threads());
        const int64_t block_bytes = block_size * token_stride * int64_t(sizeof(T));
        for (int64_t b = begin; b < end; b++) {
            const int64_t length = context_lens[b];
            const int64_t* table = block_tables + b * max_blocks;
            UpcomingRow<T> upcoming{k_cache, v_cache, block_stride, block_bytes / 64, nullptr, 0, 0};
            if (b + 1 < end) {
                upcoming.table = block_tables + (b + 1) * max_blocks;
                upcoming.num_blocks = (context_lens[b + 1] + block_size - 1) / block_size;
                upcoming.lines_per_token = (2 * upcoming.num_blocks * upcoming.lines_per_block + 2 * length - 1) / (2 * length);
            }
            for (int64_t d = 0; d < num_heads * head_dim; d++)
                queries[d] = load(q[b * q_row_stride + d]) * scale;
            const RowCache<T> keys{k_cache, block_stride, block_size, token_stride, table, length,
                                   num_heads, num_kv_heads, head_dim, &upcoming};
            phases.score(keys, queries.data(), scores.data());
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
            RowCache<T> values = keys;
            values.cache = v_cache;
            phases.sum(values, scores.data(), sums.data());
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
