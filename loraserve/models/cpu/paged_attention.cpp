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
// Math in float32. The work is cut into spans of at most kSpanTokens of a row's context, shared
// out over the OpenMP threads (the libgomp team torch uses): one long chat keeps every core
// reading its context, not one. A row of one span is computed as a whole; a longer row's spans
// each keep their softmax's maximum and sum with their unnormalized sum of values, and are
// merged after (flash-decoding). Spans depend on the row's own length alone, so a row's result
// does not change with the batch around it or the number of threads.
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

constexpr int64_t kSpanTokens = 256;  // rounded down to whole blocks (at least one)

// The next span's K and V blocks, asked for a few cache lines per token of the current span:
// the next span then starts with its context on its way instead of waiting on memory block
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

// Each token's offset in the cache (K's and V's alike) for a span: computed once a span, so the
// phases' loops over tokens do no integer division (one a token and pass before; with the buffers
// kept between calls, a row of 50 tokens now takes 21% fewer instructions).
void token_offsets(const int64_t* table, int64_t length, int64_t block_size, int64_t block_stride,
                   int64_t token_stride, std::vector<int64_t>& offsets) {
    offsets.resize(length);
    for (int64_t l = 0, block = 0; l < length; block++)
        for (int64_t t = 0; t < block_size && l < length; t++, l++)
            offsets[l] = table[block] * block_stride + t * token_stride;
}

// Where one span's tokens lie in the cache, and the shapes every phase needs.
template <typename T>
struct RowCache {
    const T* cache;  // k_cache or v_cache
    int64_t block_stride, block_size, token_stride;
    const int64_t* table;    // the span's blocks: its row's block table from the span's first block
    const int64_t* offsets;  // [length] each token's, from token_offsets
    int64_t length;          // its tokens
    int64_t num_heads, num_kv_heads, head_dim;
    UpcomingRow<T>* upcoming;  // the span this thread takes next (nothing to fetch after its last)
    mutable int64_t next_block_start = 0;  // prefetch_ahead's cursor: the tokens come in order

    const T* token(int64_t l) const { return cache + offsets[l]; }

    // At the first token of each block, ask for the block two ahead (the first two at the start).
    void prefetch_ahead(int64_t l) const {
        upcoming->fetch();
        if (l != next_block_start) return;
        const int64_t bytes = block_size * token_stride * int64_t(sizeof(T)), block = l / block_size;
        if (l == 0)
            for (int64_t ahead = 0; ahead < 2 && ahead * block_size < length; ahead++)
                prefetch_lines(cache + table[ahead] * block_stride, bytes);
        if (l + 2 * block_size < length) prefetch_lines(cache + table[block + 2] * block_stride, bytes);
        next_block_start += block_size;
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

// One span of a row's context: tokens [first, first + length).
struct Span {
    int64_t row, first, length;
};

// Every row's spans of at most span_tokens, row after row (a row of no context has none).
std::vector<Span> spans_of(const int64_t* context_lens, int64_t rows, int64_t span_tokens) {
    std::vector<Span> spans;
    for (int64_t b = 0; b < rows; b++)
        for (int64_t first = 0; first < context_lens[b]; first += span_tokens)
            spans.push_back({b, first, std::min(span_tokens, context_lens[b] - first)});
    return spans;
}

// scores[head, :length] -> e^(score - the head's maximum), in place; (maximum, sum) per head.
inline void exponentiate(float* scores, int64_t num_heads, int64_t length, float* highest, float* total) {
    for (int64_t head = 0; head < num_heads; head++) {
        float* row = scores + head * length;
        float top = row[0];
        for (int64_t l = 1; l < length; l++) top = row[l] > top ? row[l] : top;
        float sum = 0.0f;
        int64_t l = 0;
        for (; l + kLanes <= length; l += kLanes) {
            const Floats e = exp_nonpositive(load_vector(row + l) - top);
            std::memcpy(row + l, &e, sizeof e);
            sum += lanes_sum(e);
        }
        for (; l < length; l++) {
            row[l] = std::exp(row[l] - top);
            sum += row[l];
        }
        highest[head] = top;
        total[head] = sum;
    }
}

template <typename T>
void paged_decode_attention(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                            int64_t block_stride, const int64_t* block_tables, int64_t max_blocks,
                            const int64_t* context_lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, T* out, int num_threads) {
    const int64_t token_stride = num_kv_heads * head_dim, width = num_heads * head_dim;
    const Phases<T> phases = phases_for<T>(head_dim, num_heads / num_kv_heads);
    const int64_t span_tokens = std::max<int64_t>(1, kSpanTokens / block_size) * block_size;
    const std::vector<Span> spans = spans_of(context_lens, rows, span_tokens);
    const int64_t count = int64_t(spans.size());
    // A split row's spans: per span, per head, its (unnormalized) sums of values, maximum and sum.
    std::vector<float> partial_sums(count * width), partial_highest(count * num_heads), partial_total(count * num_heads);
    for (int64_t b = 0; b < rows; b++)  // rows of no context: zeros, as softmax over nothing is taken to be
        if (context_lens[b] == 0)
            for (int64_t d = 0; d < width; d++) store(out + b * width + d, 0.0f);
    // One span (one short chat) stays on this thread: waking the others for nothing costs more.
#pragma omp parallel num_threads(count > 1 ? num_threads : 1)
    {
        // Kept between calls (each OpenMP thread its own); every element is written before it is read.
        thread_local std::vector<float> queries, sums, highest, total, scores;
        thread_local std::vector<int64_t> offsets;
        queries.resize(width), sums.resize(width), highest.resize(num_heads), total.resize(num_heads);
        scores.resize(num_heads * std::min(span_tokens, max_blocks * block_size));
        // Each thread takes a contiguous share of the spans, so it knows which one comes next.
        const auto [begin, end] = thread_share(count, omp_get_thread_num(), omp_get_num_threads());
        const int64_t block_bytes = block_size * token_stride * int64_t(sizeof(T));
        for (int64_t n = begin; n < end; n++) {
            const Span span = spans[n];
            const int64_t length = span.length;
            const int64_t* table = block_tables + span.row * max_blocks + span.first / block_size;
            UpcomingRow<T> upcoming{k_cache, v_cache, block_stride, block_bytes / 64, nullptr, 0, 0};
            if (n + 1 < end) {
                const Span next = spans[n + 1];
                upcoming.table = block_tables + next.row * max_blocks + next.first / block_size;
                upcoming.num_blocks = (next.length + block_size - 1) / block_size;
                upcoming.lines_per_token = (2 * upcoming.num_blocks * upcoming.lines_per_block + 2 * length - 1) / (2 * length);
            }
            for (int64_t d = 0; d < width; d++) queries[d] = load(q[span.row * q_row_stride + d]) * scale;
            token_offsets(table, length, block_size, block_stride, token_stride, offsets);
            const RowCache<T> keys{k_cache, block_stride, block_size, token_stride, table, offsets.data(), length,
                                   num_heads, num_kv_heads, head_dim, &upcoming};
            phases.score(keys, queries.data(), scores.data());
            exponentiate(scores.data(), num_heads, length, highest.data(), total.data());
            const bool whole_row = length == context_lens[span.row];
            if (whole_row)  // the probabilities themselves, then their sum of values is the output
                for (int64_t head = 0; head < num_heads; head++) {
                    const float inverse = 1.0f / total[head];
                    float* row = scores.data() + head * length;
                    for (int64_t l = 0; l < length; l++) row[l] *= inverse;
                }
            RowCache<T> values = keys;
            values.cache = v_cache, values.next_block_start = 0;
            phases.sum(values, scores.data(), whole_row ? sums.data() : partial_sums.data() + n * width);
            if (whole_row) {
                for (int64_t d = 0; d < width; d++) store(out + span.row * width + d, sums[d]);
            } else {
                std::copy(highest.begin(), highest.end(), partial_highest.begin() + n * num_heads);
                std::copy(total.begin(), total.end(), partial_total.begin() + n * num_heads);
            }
        }
#pragma omp barrier
        // Each split row's spans merged, every span's part scaled to the row's maximum.
#pragma omp for
        for (int64_t b = 0; b < rows; b++) {
            if (context_lens[b] <= span_tokens) continue;
            const int64_t first = std::lower_bound(spans.begin(), spans.end(), b,
                                                   [](const Span& span, int64_t row) { return span.row < row; }) -
                                  spans.begin();
            const int64_t last = first + (context_lens[b] + span_tokens - 1) / span_tokens;
            for (int64_t head = 0; head < num_heads; head++) {
                float top = partial_highest[first * num_heads + head];
                for (int64_t n = first + 1; n < last; n++) top = std::max(top, partial_highest[n * num_heads + head]);
                float sum = 0.0f;
                for (int64_t d = 0; d < head_dim; d++) sums[d] = 0.0f;
                for (int64_t n = first; n < last; n++) {
                    const float weight = std::exp(partial_highest[n * num_heads + head] - top);
                    sum += weight * partial_total[n * num_heads + head];
                    const float* part = partial_sums.data() + n * width + head * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) sums[d] += weight * part[d];
                }
                const float inverse = 1.0f / sum;
                for (int64_t d = 0; d < head_dim; d++) store(out + b * width + head * head_dim + d, sums[d] * inverse);
            }
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
