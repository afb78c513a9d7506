// Base-model matmuls on the CPU with weights narrower than the activations:
// y[M, N] = x[M, K] W[N, K]^T, x and y float32 or bfloat16, sums in float32.
//
// A decode step reads every weight once and does little with it, so its time is the bytes of
// the weights over the memory bandwidth: 16-bit weights halve float32's, int8 quarters it.
//
//   bfloat16 weights: widened to float32 in registers (a shift), FMA in float32: the sums of
//   x @ W.float()^T, in another order. bfloat16 rows on a CPU with bfloat16 dot products
//   (AVX512-BF16) are not widened: vdpbf16ps multiplies a pair of both along K in each lane and
//   adds the two products to its float32 sum, twice the products of an FMA a cycle (a 32-row
//   decode step of the default model: 1.7x faster than widening on a Zen 4, as fast as oneDNN).
//   float32 rows take them too where asked (--weights bfloat16-dot): rounded to bfloat16 as read,
//   sums and outputs float32.
//   int8 weights: blocks of 32 along K, each byte q in 0..255 standing for scale * q + min
//   (float16 scale and min: llama.cpp's Q4_1 at 8 bits). x is quantized per call to int16 blocks
//   of 32 (scale absmax / 32639, float32), and each block's dot product is an integer one
//   on the bytes widened to int16 (AVX2: vpmaddwd; AVX512-VNNI: vpdpwssd, which also adds),
//   scaled by both blocks' scales, plus the weights' min times the block's float sum of x.
//
// Both are packed once at load into panels of a vector of outputs, K running down the panel:
// one vector load holds one k (bfloat16; two for the dot products) or two (int8) for a whole
// vector of outputs. A tile
// multiplies PANELS such vectors by ROWS broadcast activations, as a GEMM micro-kernel does, with
// no horizontal sums; a group of panels stays in cache while every row tile of x passes over it,
// so a step streams each weight once whatever the batch. Threads take contiguous shares of the
// panels.
//
// On a CPU with AMX, batches run in its tiles instead (tdpbf16ps: 16 rows by 32 k by 16 outputs an
// instruction), whose weight tiles are 16 pairs of the bfloat16 dot products' panels as they lie;
// int8 blocks are widened to such tiles a block ahead of the products. Built by linear.py with
// the host compiler, no torch headers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_vectors.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // int8 weights: elements a scale covers
constexpr int64_t kPrefetchAhead = 1024;  // bytes ahead in each panel (the hardware prefetcher lags)

// x's rows as float32, K apart: bfloat16 rows widened once per call into `scratch`.
inline const float* float_rows(const float* x, int64_t, int64_t, std::vector<float>&) { return x; }
inline const float* float_rows(const BFloat16* x, int64_t rows, int64_t k, std::vector<float>& scratch) {
    scratch.resize(rows * k);
    for (int64_t i = 0; i < rows * k; i++) scratch[i] = load(x[i]);
    return scratch.data();
}

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

// Stores one panel's `lanes` sums of a row into y[first_output...], those past n left out.
template <typename Y>
inline void store_panel(const float* sums, int lanes, Y* y, int64_t n, int64_t first_output) {
    const int count = n - first_output < lanes ? int(n - first_output) : lanes;
    if constexpr (std::is_same_v<Y, float>) {
        std::memcpy(y + first_output, sums, count * sizeof(float));
    } else {
        for (int lane = 0; lane < count; lane++) store(y + first_output + lane, sums[lane]);
    }
}

// Stores a bfloat16-weights tile's sums (float32 vectors of kLanes): row i's panel j, whose panels
// lie `spacing` apart, into y[i * n + first_output + j * spacing * kLanes...].
template <int ROWS, int PANELS, typename Sums, typename Y>
inline void store_tile(const Sums (&acc)[ROWS][PANELS], Y* y, int64_t n, int64_t first_output, int64_t spacing) {
    static_assert(sizeof(Sums) == kLanes * sizeof(float));
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < PANELS; j++) {
            float sums[kLanes];
            std::memcpy(sums, &acc[i][j], sizeof sums);
            store_panel(sums, kLanes, y + i * n, n, first_output + j * spacing * kLanes);
        }
}

// Runs tile(rows, panels, first row, first panel, spacing) over all `rows` x `panel_total`
// panels: each thread takes a contiguous share of the panels, and a tile `group` of them
// `spacing` panels apart, so that its panels are read as `group` long streams through the share
// (adjacent panels are short streams, each restarting the hardware prefetcher: one chat's decode
// step took 16% longer that way on a Zen 3). Each tile's panels pass under every row tile of at
// most `max_rows` rows before the next, so they are read from memory once whatever the batch.
// `Tiles` says how its tiles take panels (adjacent or spaced) and what a thread begins and ends
// its work with (AMX tiles are configured a thread).
struct VectorTiles {
    bool adjacent = false;
    void begin() const {}
    void end() const {}
};

template <typename Tile, typename Tiles = VectorTiles>
void over_panels(int64_t rows, int64_t panel_total, int max_rows, int group, int num_threads, Tile tile,
                 Tiles tiles = {}) {
#pragma omp parallel num_threads(num_threads)
    {
        tiles.begin();
        const auto [begin, end] = thread_share(panel_total, omp_get_thread_num(), omp_get_num_threads());
        const int64_t count = end - begin, spacing = tiles.adjacent ? 1 : (count + group - 1) / group;
        const int64_t starts = tiles.adjacent ? (count + group - 1) / group : spacing;
        for (int64_t start = 0; start < starts; start++) {
            const int64_t first = tiles.adjacent ? start * group : start;
            const int panels = int(std::min<int64_t>(group, (count - first + spacing - 1) / spacing));
            for (int64_t row = 0; row < rows; row += max_rows)
                tile(rows - row < max_rows ? int(rows - row) : max_rows, panels, row, begin + first, spacing);
        }
        tiles.end();
    }
}

// Calls Kernel<R, P>::run(args...) for a tile of `rows` rows and `panels` panels, one instance
// per shape so its sums live in registers; shapes past Kernel<R, P>::fits are never asked for.
template <template <int, int> class Kernel, typename... Args>
void dispatch(int rows, int panels, Args&&... args) {
#define TILE_CASE(R, P)                                                    \
    case (R) * 8 + (P):                                                    \
        if constexpr (Kernel<R, P>::fits) Kernel<R, P>::run(args...); \
        return;
#define TILE_ROW(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3) TILE_CASE(R, 4)
    switch (rows * 8 + panels) { TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5) TILE_ROW(6) }
#undef TILE_ROW
#undef TILE_CASE
}

// ---- bfloat16 weights: panels [n / kLanes][k][kLanes] ----------------------------------------

constexpr int kBf16Rows = 6;
// Panels a tile of `rows` rows takes: its sums, the panels' vectors and one broadcast x fit.
constexpr int bf16_panels_for(int rows) { return rows <= 2 || kRegisters >= 32 ? 4 : 2; }

int64_t bf16_panel_count(int64_t n) { return (n + kLanes - 1) / kLanes; }

template <int ROWS, int PANELS>
struct Bf16Tile {
    static constexpr bool fits = ROWS <= kBf16Rows && PANELS <= bf16_panels_for(ROWS);

    template <typename Y>
    static void run(const float* x, int64_t k, const BFloat16* panels, int64_t spacing, Y* y, int64_t n,
                    int64_t first_output) {
        Floats acc[ROWS][PANELS] = {};
        constexpr int64_t kSteps = 64 / (kLanes * sizeof(BFloat16));  // k steps a cache line of a panel lasts
        const int64_t panel_elements = spacing * k * kLanes;  // from one of the tile's panels to the next
        for (int64_t h = 0; h < k; h++) {
            const BFloat16* at = panels + h * kLanes;
            if (h % kSteps == 0)
                for (int j = 0; j < PANELS; j++)
                    prefetch_line(reinterpret_cast<const char*>(at + j * panel_elements) + kPrefetchAhead);
            Floats weights[PANELS];
            for (int j = 0; j < PANELS; j++) weights[j] = load_vector(at + j * panel_elements);
            for (int i = 0; i < ROWS; i++) {
                const Floats broadcast = splat(x[i * k + h]);
                for (int j = 0; j < PANELS; j++) acc[i][j] += broadcast * weights[j];
            }
        }
        store_tile(acc, y, n, first_output, spacing);
    }
};

template <typename X>
void linear_bf16(const X* x, int64_t rows, int64_t k, const BFloat16* packed, int64_t n, X* y, int num_threads) {
    std::vector<float> scratch;
    const float* xs = float_rows(x, rows, k, scratch);
    const int group = bf16_panels_for(rows < kBf16Rows ? int(rows) : kBf16Rows);  // fits every row tile
    over_panels(rows, bf16_panel_count(n), kBf16Rows, group, num_threads,
                [&](int tile_rows, int panels, int64_t row, int64_t panel, int64_t spacing) {
                    dispatch<Bf16Tile>(tile_rows, panels, xs + row * k, k, packed + panel * k * kLanes, spacing,
                                       y + row * n, n, panel * kLanes);
                });
}

void pack_bf16(const BFloat16* w, int64_t n, int64_t k, BFloat16* packed) {
    for (int64_t panel = 0; panel < bf16_panel_count(n); panel++)
        for (int64_t h = 0; h < k; h++)
            for (int lane = 0; lane < kLanes; lane++) {
                const int64_t output = panel * kLanes + lane;
                packed[(panel * k + h) * kLanes + lane] = output < n ? w[output * k + h] : BFloat16{0};
            }
}

// ---- bfloat16 dot products (AVX512-BF16): panels [n / 16][k / 2][16][2] ----------------------
// For bfloat16 rows, and for float32 rows asked to round to bfloat16 as they are read (sums and
// outputs stay float32).

#if defined(__AVX512BF16__)
#define BF16_DOT 1

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AMX_TILES 1
constexpr int kTilePairs = 16;  // pairs along K of an AMX tile row: 32 k, an int8 block
#else
constexpr int kTilePairs = 1;
#endif
// Pairs a row of K: an odd K's last pair has a zero, and with AMX whole tiles' worth (zeros past K).
int64_t bf16_pairs(int64_t k) { return (k + 2 * kTilePairs - 1) / (2 * kTilePairs) * kTilePairs; }
typedef uint32_t Pair __attribute__((may_alias));  // two bfloat16 read as one word

// One row of x into `target`, as bfloat16: copied, or rounded (nearest even, as torch rounds).
inline void bfloat16_row(const BFloat16* source, int64_t k, BFloat16* target) {
    std::memcpy(target, source, k * sizeof(BFloat16));
}
inline void bfloat16_row(const float* source, int64_t k, BFloat16* target) {
    int64_t h = 0;
    for (; h + kLanes <= k; h += kLanes) store_vector(target + h, load_vector(source + h));
    for (; h < k; h++) store(target + h, source[h]);
}

// The calling thread's buffer for pair_rows, kept between calls: no allocation a matmul.
inline std::vector<BFloat16>& kept_pair_rows() {
    thread_local std::vector<BFloat16> kept;
    return kept;
}

// x's rows as pairs along K, one 32-bit word each, bf16_pairs(k) a row: x itself where it is
// bfloat16 and its rows are whole pairs, else its rows in bfloat16 in `scratch`, the pairs past K
// zeros and rows of zeros after them up to `padded_rows` (AMX tiles take whole tiles of rows).
template <typename X>
const Pair* pair_rows(const X* x, int64_t rows, int64_t k, std::vector<BFloat16>& scratch,
                      int64_t padded_rows = 0) {
    const int64_t row_elements = 2 * bf16_pairs(k);
    if (std::is_same_v<X, BFloat16> && k == row_elements && padded_rows <= rows)
        return reinterpret_cast<const Pair*>(x);
    scratch.assign(std::max(rows, padded_rows) * row_elements, BFloat16{0});
    for (int64_t row = 0; row < rows; row++) bfloat16_row(x + row * k, k, &scratch[row * row_elements]);
    return reinterpret_cast<const Pair*>(scratch.data());
}

template <int ROWS, int PANELS>
struct Bf16DotTile {
    static constexpr bool fits = ROWS <= kBf16Rows && PANELS <= bf16_panels_for(ROWS);

    template <typename Y>
    static void run(const Pair* x, int64_t pairs, const BFloat16* panels, int64_t spacing, Y* y, int64_t n,
                    int64_t first_output) {
        __m512 acc[ROWS][PANELS];
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < PANELS; j++) acc[i][j] = _mm512_setzero_ps();
        const int64_t panel_elements = spacing * pairs * 2 * kLanes;  // from one of the tile's panels to the next
        for (int64_t h = 0; h < pairs; h++) {  // a pair of k a cache line of each panel
            const BFloat16* at = panels + h * 2 * kLanes;
            __m512bh weights[PANELS];
            for (int j = 0; j < PANELS; j++) {
                prefetch_line(reinterpret_cast<const char*>(at + j * panel_elements) + kPrefetchAhead);
                weights[j] = (__m512bh)_mm512_loadu_si512(at + j * panel_elements);
            }
            for (int i = 0; i < ROWS; i++) {
                const __m512bh broadcast = (__m512bh)_mm512_set1_epi32(int(x[i * pairs + h]));
                for (int j = 0; j < PANELS; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], broadcast, weights[j]);
            }
        }
        store_tile(acc, y, n, first_output, spacing);
    }
};

#if defined(AMX_TILES)
// ---- AMX tiles: tdpbf16ps multiplies 16 rows by 32 k of x (pairs along K) and 32 k by 16 outputs
// of a weight tile, adding to 16 x 16 float32 sums: 16 times vdpbf16ps's products an instruction.
// The panels of pairs are the weight tiles' layout already: 16 pairs of a panel (64 bytes each)
// are a tile. Tiles: sums 0-3 (row tile r by panel j: 2r + j), x 4-5, weights 6-7.

constexpr int kTileRows = 16;
// Rows from which tiles beat the vector tiles: measured on a Xeon with AMX, the 120 layer matmuls of
// the default model's decode step with bfloat16 rows (benchmarks/cpu_matmuls.py --activations
// bfloat16, tiles against none; docs/benchmarks.md): bfloat16 8 rows 12.3 -> 10.5 ms (6 rows even);
// int8 16 rows 11.9 -> 9.9 (12 rows even: its widening costs the tiles a fixed share); 32 rows
// bfloat16 39.2 -> 12.1, int8 20.3 -> 10.6 (oneDNN's AMX matmul 17.7).
constexpr int64_t kBf16TileRowsFrom = 8, kInt8TileRowsFrom = 16;
constexpr int64_t kTilePrefetchAhead = 2048;  // bytes ahead in each panel

int64_t whole_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// A prompt's rows in blocks, each block's x staying in the L2 cache while every panel passes under
// it (one pass over all the rows reread x from memory a panel: the down projection's 2048 rows took
// 2.3 ms against 1.55 in blocks).
constexpr int64_t kTileRowBlockBytes = 768 << 10;

template <typename Block>
void over_row_blocks(int64_t rows, int64_t pairs, Block block) {
    constexpr int64_t kRowPair = 2 * kTileRows;  // the rows of a tile_sums call
    const int64_t fitting = kTileRowBlockBytes / (pairs * int64_t(sizeof(Pair)));
    const int64_t block_rows = std::max(kRowPair, fitting / kRowPair * kRowPair);
    for (int64_t row = 0; row < rows; row += block_rows) block(row, std::min(block_rows, rows - row));
}

// Linux lends a process the tiles' state only once it asks (arch_prctl); refused, vdpbf16ps serves.
bool tiles_permitted() {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
    return permitted;
}

// A prompt's tiles take adjacent panels: a tile's 32 outputs of a row fill a cache line of bfloat16 y
// (spaced panels wrote each line in halves, far apart: a prompt's y, past the caches, was read for
// each half). A decode step's y stays cached, and its panels stream better spaced.
constexpr int64_t kAdjacentPanelsFrom = 256;  // rows

struct AmxTiles {
    bool adjacent;
    // each thread configures its tiles before its first and releases them after its last
    void begin() const {
        struct {
            uint8_t palette, start_row, reserved[14];
            uint16_t bytes[16];
            uint8_t rows[16];
        } config{};
        config.palette = 1;
        for (int t = 0; t < 8; t++) config.bytes[t] = 64, config.rows[t] = kTileRows;
        _tile_loadconfig(&config);
    }
    void end() const { _tile_release(); }
};

// Weight tiles read as they are (bfloat16 panels); int8 panels are widened into them first (below).
struct PanelsAsTheyAre {
    void operator()(int64_t) const {}
};

// ROW_TILES tiles of x's rows (`pairs` words a row) by PANELS panels `panel_elements` apart, into
// out[ROW_TILES][2][kTileRows][kLanes]. `ready(h)` makes the weight tiles at pair h: called a step
// ahead of the tiles that read them, so that its vector work overlaps their products. The panels
// are prefetched where they `stream` from memory (the first row tiles; the rest find them cached,
// where prefetches cost a fifth of a prompt's time).
template <int ROW_TILES, int PANELS, typename Ready>
void tile_sums(const Pair* x, int64_t pairs, const BFloat16* panel, int64_t panel_elements, float* out,
               bool stream, Ready ready) {
    constexpr int kTile = kTileRows * kLanes;
    const int64_t x_stride = pairs * sizeof(Pair);
    _tile_zero(0);
    if constexpr (PANELS > 1) _tile_zero(1);
    if constexpr (ROW_TILES > 1) _tile_zero(2);
    if constexpr (ROW_TILES > 1 && PANELS > 1) _tile_zero(3);
    ready(0);
    for (int64_t h = 0; h < pairs; h += kTilePairs) {
        const BFloat16* weights = panel + h * 2 * kLanes;
        for (int j = 0; j < PANELS && stream; j++)
            prefetch_lines(weights + j * panel_elements + kTilePrefetchAhead / sizeof(BFloat16), 64 * kTilePairs);
        _tile_loadd(4, x + h, x_stride);
        _tile_loadd(6, weights, 64);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (PANELS > 1) {
            _tile_loadd(7, weights + panel_elements, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if constexpr (ROW_TILES > 1) {
            _tile_loadd(5, x + kTileRows * pairs + h, x_stride);
            _tile_dpbf16ps(2, 5, 6);
        }
        if constexpr (ROW_TILES > 1 && PANELS > 1) _tile_dpbf16ps(3, 5, 7);
        if (h + kTilePairs < pairs) ready(h + kTilePairs);
    }
    _tile_stored(0, out, 64);
    if constexpr (PANELS > 1) _tile_stored(1, out + kTile, 64);
    if constexpr (ROW_TILES > 1) _tile_stored(2, out + 2 * kTile, 64);
    if constexpr (ROW_TILES > 1 && PANELS > 1) _tile_stored(3, out + 3 * kTile, 64);
}

// x's `rows` (pairs along K, zero rows after them to whole tiles) by `panels` panels from `panel`,
// `panel_elements` apart, into y's outputs from first_output, `spacing` panels apart. The first
// pass over the panels calls ready(h) (tile_sums); the later ones find the tiles made.
template <typename Y, typename Ready = PanelsAsTheyAre>
void tile_panels(const Pair* x, int64_t rows, int64_t pairs, const BFloat16* panel, int panels,
                 int64_t panel_elements, Y* y, int64_t n, int64_t first_output, int64_t spacing, Ready ready = {}) {
    alignas(64) float out[2][2][kTileRows][kLanes];
    for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
        const int row_tiles = rows - row > kTileRows ? 2 : 1;
        const bool first = row == 0;
        const auto first_pass = [&](int64_t h) {
            if (first) ready(h);
        };
        const Pair* xs = x + row * pairs;
        float* sums = &out[0][0][0][0];
        if (row_tiles == 2 && panels > 1) tile_sums<2, 2>(xs, pairs, panel, panel_elements, sums, first, first_pass);
        else if (row_tiles == 2) tile_sums<2, 1>(xs, pairs, panel, panel_elements, sums, first, first_pass);
        else if (panels > 1) tile_sums<1, 2>(xs, pairs, panel, panel_elements, sums, first, first_pass);
        else tile_sums<1, 1>(xs, pairs, panel, panel_elements, sums, first, first_pass);
        for (int r = 0; r < row_tiles; r++)
            for (int i = 0; i < kTileRows && row + r * kTileRows + i < rows; i++)
                for (int j = 0; j < panels; j++)
                    store_panel(out[r][j][i], kLanes, y + (row + r * kTileRows + i) * n, n,
                                first_output + j * spacing * kLanes);
    }
}

template <typename X>
void linear_bf16_tiles(const X* x, int64_t rows, int64_t k, const BFloat16* packed, int64_t n, X* y,
                       int num_threads) {
    std::vector<BFloat16>& scratch = kept_pair_rows();
    const int64_t pairs = bf16_pairs(k), panel_elements = pairs * 2 * kLanes;
    const Pair* xs = pair_rows(x, rows, k, scratch, whole_tiles(rows));
    over_row_blocks(rows, pairs, [&](int64_t row, int64_t block_rows) {
        over_panels(
            block_rows, bf16_panel_count(n), int(block_rows), 2, num_threads,
            [&](int, int panels, int64_t, int64_t panel, int64_t spacing) {
                tile_panels(xs + row * pairs, block_rows, pairs, packed + panel * panel_elements, panels,
                            spacing * panel_elements, y + row * n, n, panel * kLanes, spacing);
            },
            AmxTiles{rows >= kAdjacentPanelsFrom});
    });
}
#endif

template <typename X>
void linear_bf16_dot(const X* x, int64_t rows, int64_t k, const BFloat16* packed, int64_t n, X* y, int num_threads) {
#if defined(AMX_TILES)
    if (rows >= kBf16TileRowsFrom && tiles_permitted()) return linear_bf16_tiles(x, rows, k, packed, n, y, num_threads);
#endif
    std::vector<BFloat16>& scratch = kept_pair_rows();
    const Pair* xs = pair_rows(x, rows, k, scratch);
    const int64_t pairs = bf16_pairs(k);
    const int group = bf16_panels_for(rows < kBf16Rows ? int(rows) : kBf16Rows);
    over_panels(rows, bf16_panel_count(n), kBf16Rows, group, num_threads,
                [&](int tile_rows, int panels, int64_t row, int64_t panel, int64_t spacing) {
                    dispatch<Bf16DotTile>(tile_rows, panels, xs + row * pairs, pairs,
                                          packed + panel * pairs * 2 * kLanes, spacing, y + row * n, n,
                                          panel * kLanes);
                });
}

void pack_bf16_pairs(const BFloat16* w, int64_t n, int64_t k, BFloat16* packed) {
    const int64_t pairs = bf16_pairs(k);
    for (int64_t panel = 0; panel < bf16_panel_count(n); panel++)
        for (int64_t h = 0; h < pairs; h++)
            for (int lane = 0; lane < kLanes; lane++)
                for (int e = 0; e < 2; e++) {
                    const int64_t output = panel * kLanes + lane, column = 2 * h + e;
                    packed[((panel * pairs + h) * kLanes + lane) * 2 + e] =
                        output < n && column < k ? w[output * k + column] : BFloat16{0};
                }
}
#endif

// ---- int8 weights: panels of values [blocks * kSteps][kInt8Lanes][kPerLane], scales and mins [blocks][kInt8Lanes] --

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_VNNI 1
constexpr int kInt8Lanes = 16;
#elif defined(__AVX2__) && defined(__F16C__)
#define INT8_AVX2 1
constexpr int kInt8Lanes = 8;
#else
constexpr int kInt8Lanes = 8;
#endif
constexpr int kPerLane = 2;  // k of one output a lane holds in a panel row: a pair of int16 once widened
constexpr int kSteps = kBlock / kPerLane;  // panel rows a block takes
constexpr int kStepsPerLine = 64 / (kPerLane * kInt8Lanes);  // panel rows a cache line holds
#if defined(INT8_AVX2)
// 16 registers: a tile's int32 sums (4 x 2), its two panels' weights and a broadcast pair; the float
// sums, touched once a block, wait in memory. Measured on a Zen 3, the 120 layer matmuls of a decode
// step: 32 rows 89 -> 62 ms, 64 rows 173 -> 131 (tiles of 4 x 1 before; 6 x 2 and 5 x 2 no better).
constexpr int kInt8Rows = 4;
constexpr int kUnrolledRows = 2;  // measured: unrolled, a decode row's block runs 20% faster; 4 rows spill
#else
// 32 registers: a tile's sums in int32 and float, its panels' weights and a broadcast x.
constexpr int kInt8Rows = 6;
constexpr int kUnrolledRows = kInt8Rows;
#endif
// Two panels a tile whatever its rows, so one row's reads are fewer streams a thread, and the scales
// prefetched: on a Zen 5, the 120 layer matmuls of one row 3.44 -> 2.87 ms (4 panels before; best of
// 20, benchmarks/cpu_matmuls.py). bfloat16 tiles of 2 panels for one row gained 0-2%: left at 4.
constexpr int kInt8Panels = 2;
// The scales and minimums are streams of their own, each a sixteenth of the values' bytes: prefetched too.
constexpr int kScaleLineBlocks = 64 / (sizeof(uint16_t) * kInt8Lanes);  // blocks whose scales a cache line holds
constexpr int64_t kScalePrefetchAhead = 512;  // bytes ahead in the scales and the minimums

int64_t int8_panel_count(int64_t n) { return (n + kInt8Lanes - 1) / kInt8Lanes; }

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

// x quantized per call: per row, blocks of 32 as int16 in [-32639, 32639] (scale absmax / 32639),
// rounded to nearest, zeros past k; and each block's float sum, which the weights' minimum
// multiplies. (32639 leaves the int16 pair sums of 32 products by bytes far inside int32.)
constexpr float kInt16Range = 32639.0f;

struct QuantizedRows {
    std::vector<int16_t> values;  // [rows, blocks * 32]
    std::vector<float> scales;    // [rows, blocks]
    std::vector<float> sums;      // [rows, blocks]
    int64_t blocks;
};

// One block of `length` floats: its scale and sum, and its 32 values (zeros past length).
inline void quantize_block(const float* block, int64_t length, int16_t* values, float& scale, float& sum) {
#if defined(__AVX2__)
    if (length == kBlock) {  // the vector path: the same values and scale, the sum in another order
        constexpr int kVectors = kBlock / kLanes;
        Floats v[kVectors], amax{}, total{};
        for (int t = 0; t < kVectors; t++) {
            v[t] = load_vector(block + t * kLanes);
            const Floats magnitude = v[t] < 0 ? -v[t] : v[t];
            amax = magnitude > amax ? magnitude : amax;
            total += v[t];
        }
        float largest = 0.0f;
        for (int lane = 0; lane < kLanes; lane++) largest = std::max(largest, amax[lane]);
        scale = largest / kInt16Range;
        sum = lanes_sum(total);
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int t = 0; t < kVectors; t++) {  // cvtps2dq rounds to nearest even, as nearbyintf
#if defined(__AVX512F__)
            const __m512i rounded = _mm512_cvtps_epi32(__m512(v[t] * inverse));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + t * kLanes), _mm512_cvtepi32_epi16(rounded));
#else
            const __m256i rounded = _mm256_cvtps_epi32(__m256(v[t] * inverse));
            const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(values + t * kLanes), packed);
#endif
        }
        return;
    }
#endif
    float amax = 0.0f;
    sum = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        amax = std::max(amax, std::abs(block[t]));
        sum += block[t];
    }
    scale = amax / kInt16Range;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t t = 0; t < kBlock; t++) values[t] = t < length ? int16_t(__builtin_nearbyintf(block[t] * inverse)) : 0;
}

// Measured: a prompt's rows quantized on one thread, scalar, took a fifth of its int8 matmuls.
constexpr int64_t kQuantizeInParallel = 1 << 14;  // elements of x from which threads share the rows

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedRows& q, int num_threads) {
    q.blocks = (k + kBlock - 1) / kBlock;
    q.values.resize(rows * q.blocks * kBlock);  // every element written below
    q.scales.resize(rows * q.blocks);
    q.sums.resize(rows * q.blocks);
#pragma omp parallel for num_threads(num_threads) if (rows * k >= kQuantizeInParallel)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < q.blocks; b++)
            quantize_block(x + i * k + b * kBlock, std::min<int64_t>(k - b * kBlock, kBlock),
                           q.values.data() + (i * q.blocks + b) * kBlock, q.scales[i * q.blocks + b],
                           q.sums[i * q.blocks + b]);
}

inline int32_t pair_of(const int16_t* source) {  // two int16 as the bytes of one 32-bit lane
    int32_t value;
    std::memcpy(&value, source, sizeof value);
    return value;
}

#if defined(INT8_VNNI) || defined(INT8_AVX2)
// The few instructions the int8 tile needs, at the vector width of the ISA: a lane sums int32
// (dot products of int16 pairs) or floats.
#if defined(INT8_VNNI)
using Int8Sums = __m512i;
using Int8Floats = __m512;
// A panel row's bytes (two k of every lane) widened to int16: vpmovzxbw.
inline Int8Sums widened_weights(const uint8_t* source) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
}
// sums + each lane's two int16 products summed: vpdpwssd.
inline Int8Sums add_pair_products(Int8Sums sums, Int8Sums x, Int8Sums weights) {
    return _mm512_dpwssd_epi32(sums, x, weights);
}
inline Int8Sums broadcast_pair(int32_t pair) { return _mm512_set1_epi32(pair); }
inline Int8Floats half_floats(const uint16_t* source) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
}
inline Int8Floats splat_float(float v) { return _mm512_set1_ps(v); }
inline Int8Floats as_floats(Int8Sums v) { return _mm512_cvtepi32_ps(v); }
inline Int8Floats fused(Int8Floats a, Int8Floats b, Int8Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Int8Floats product(Int8Floats a, Int8Floats b) { return _mm512_mul_ps(a, b); }
inline void store_floats(float* target, Int8Floats v) { _mm512_storeu_ps(target, v); }
#else
using Int8Sums = __m256i;
using Int8Floats = __m256;
inline Int8Sums widened_weights(const uint8_t* source) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
}
inline Int8Sums add_pair_products(Int8Sums sums, Int8Sums x, Int8Sums weights) {  // vpmaddwd and an add
    return _mm256_add_epi32(sums, _mm256_madd_epi16(x, weights));
}
inline Int8Sums broadcast_pair(int32_t pair) { return _mm256_set1_epi32(pair); }
inline Int8Floats half_floats(const uint16_t* source) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
}
inline Int8Floats splat_float(float v) { return _mm256_set1_ps(v); }
inline Int8Floats as_floats(Int8Sums v) { return _mm256_cvtepi32_ps(v); }
inline Int8Floats fused(Int8Floats a, Int8Floats b, Int8Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Int8Floats product(Int8Floats a, Int8Floats b) { return _mm256_mul_ps(a, b); }
inline void store_floats(float* target, Int8Floats v) { _mm256_storeu_ps(target, v); }
#endif
#endif

template <int ROWS, int PANELS>
struct Int8Tile {
    static constexpr bool fits = ROWS <= kInt8Rows && PANELS <= kInt8Panels;

    // Rows row0.. of x against PANELS panels `spacing` apart from `values` / `scales` / `mins`,
    // into y (row0's row). A block's sum: scale_w * scale_x * (q . x_q) + min_w * sum(x), q . x_q in int32.
    template <typename Y>
    static void run(const QuantizedRows& x, int64_t row0, const uint8_t* values, const uint16_t* scales,
                    const uint16_t* mins, int64_t spacing, Y* y, int64_t n, int64_t first_output) {
        const int64_t blocks = x.blocks, panel_values = spacing * blocks * kBlock * kInt8Lanes;
        const int64_t panel_scales = spacing * blocks * kInt8Lanes;
        const int64_t first = row0 * blocks * kBlock;
        const float* x_scales = x.scales.data() + row0 * blocks;
        const float* x_sums = x.sums.data() + row0 * blocks;
        float sums[ROWS][PANELS][kInt8Lanes];
#if defined(INT8_VNNI) || defined(INT8_AVX2)
        // The weights' bytes widened to int16 once for all rows, by x's broadcast int16 pairs.
        Int8Floats acc[ROWS][PANELS];
        for (auto& row : acc)
            for (auto& a : row) a = splat_float(0.0f);
        for (int64_t b = 0; b < blocks; b++) {
            Int8Sums dots[ROWS][PANELS];
            for (auto& row : dots)
                for (auto& d : row) d = broadcast_pair(0);
            auto step_of_block = [&](int step) {
                Int8Sums weights[PANELS];
                for (int j = 0; j < PANELS; j++) {
                    const uint8_t* source = values + j * panel_values + (b * kSteps + step) * kPerLane * kInt8Lanes;
                    if (step % kStepsPerLine == 0) prefetch_line(source + kPrefetchAhead);
                    weights[j] = widened_weights(source);
                }
                for (int i = 0; i < ROWS; i++) {
                    const Int8Sums pair = broadcast_pair(pair_of(x.values.data() + first + (i * blocks + b) * kBlock +
                                                                 step * kPerLane));
                    for (int j = 0; j < PANELS; j++) dots[i][j] = add_pair_products(dots[i][j], pair, weights[j]);
                }
            };
            if constexpr (ROWS <= kUnrolledRows) {  // the whole block: no loop branches
#pragma GCC unroll 16
                for (int step = 0; step < kSteps; step++) step_of_block(step);
            } else {
                for (int step = 0; step < kSteps; step++) step_of_block(step);
            }
            for (int j = 0; j < PANELS; j++) {
                const uint16_t* block_scales = scales + j * panel_scales + b * kInt8Lanes;
                const uint16_t* block_mins = mins + j * panel_scales + b * kInt8Lanes;
                if (b % kScaleLineBlocks == 0) {
                    prefetch_line(reinterpret_cast<const char*>(block_scales) + kScalePrefetchAhead);
                    prefetch_line(reinterpret_cast<const char*>(block_mins) + kScalePrefetchAhead);
                }
                const Int8Floats w_scale = half_floats(block_scales);
                const Int8Floats w_min = half_floats(block_mins);
                for (int i = 0; i < ROWS; i++) {
                    acc[i][j] = fused(as_floats(dots[i][j]), product(w_scale, splat_float(x_scales[i * blocks + b])),
                                      acc[i][j]);
                    acc[i][j] = fused(w_min, splat_float(x_sums[i * blocks + b]), acc[i][j]);
                }
            }
        }
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < PANELS; j++) store_floats(sums[i][j], acc[i][j]);
#else
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < PANELS; j++)
                for (int lane = 0; lane < kInt8Lanes; lane++) {
                    float sum = 0.0f;
                    for (int64_t b = 0; b < blocks; b++) {
                        int32_t dot = 0;
                        for (int t = 0; t < kBlock; t++) {
                            const int64_t at = ((b * kSteps + t / kPerLane) * kInt8Lanes + lane) * kPerLane + t % kPerLane;
                            dot += int32_t(x.values[first + (i * blocks + b) * kBlock + t]) *
                                   int32_t(values[j * panel_values + at]);
                        }
                        const int64_t at = j * panel_scales + b * kInt8Lanes + lane;
                        sum += float(dot) * (half_to_float(scales[at]) * x_scales[i * blocks + b]);
                        sum += half_to_float(mins[at]) * x_sums[i * blocks + b];
                    }
                    sums[i][j][lane] = sum;
                }
#endif
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < PANELS; j++)
                store_panel(sums[i][j], kInt8Lanes, y + i * n, n, first_output + j * spacing * kInt8Lanes);
    }
};

#if defined(AMX_TILES)
// An int8 panel's block as the weight tile of bfloat16 pairs it stands for: each weight's
// scale * q + min in float32, rounded to bfloat16 (a rounding the vpdpwssd path has not, and x is
// rounded to bfloat16 here, not to int16: the quality meter measures both).
inline void widen_block(const uint8_t* values, const uint16_t* scales, const uint16_t* mins, BFloat16* tile) {
    static_assert(kInt8Lanes == kLanes && kSteps == kTilePairs && kPerLane == 2);
    // A panel row's 32 bytes: lanes 0-7's pairs, then lanes 8-15's; each lane's scale for both of its pair.
    const __m512i first_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second_lanes = _mm512_add_epi32(first_lanes, _mm512_set1_epi32(8));
    prefetch_lines(values + kPrefetchAhead, kSteps * kPerLane * kInt8Lanes);
    const __m512 scale = half_floats(scales), low = half_floats(mins);
    const __m512 scale_first = _mm512_permutexvar_ps(first_lanes, scale);
    const __m512 scale_second = _mm512_permutexvar_ps(second_lanes, scale);
    const __m512 min_first = _mm512_permutexvar_ps(first_lanes, low);
    const __m512 min_second = _mm512_permutexvar_ps(second_lanes, low);
    for (int step = 0; step < kSteps; step++) {
        const __m128i* row = reinterpret_cast<const __m128i*>(values + step * kPerLane * kInt8Lanes);
        const __m512 first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row))),
                                             scale_first, min_first);
        const __m512 second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row + 1))),
                                              scale_second, min_second);
        _mm512_storeu_si512(tile + step * 2 * kLanes, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
}

// Each thread widens its tile's panels, a block a step ahead of the products, into panels of pairs
// of its own, which every row tile reads.
template <typename X>
void linear_int8_tiles(const X* x, int64_t rows, int64_t k, const uint8_t* values, const uint16_t* scales,
                       const uint16_t* mins, int64_t n, X* y, int num_threads) {
    std::vector<BFloat16>& scratch = kept_pair_rows();
    const int64_t blocks = (k + kBlock - 1) / kBlock, pairs = bf16_pairs(k), panel_elements = pairs * 2 * kLanes;
    const Pair* xs = pair_rows(x, rows, k, scratch, whole_tiles(rows));
    over_row_blocks(rows, pairs, [&](int64_t row, int64_t block_rows) {
        over_panels(
            block_rows, int8_panel_count(n), int(block_rows), 2, num_threads,
            [&](int, int panels, int64_t, int64_t panel, int64_t spacing) {
                thread_local std::vector<BFloat16> widened;
                widened.resize(2 * panel_elements);
                BFloat16* const tiles = widened.data();  // named once: each use of a thread_local is a call
                const auto widen = [&](int64_t h) {
                    const int64_t b = h / kTilePairs;
                    for (int j = 0; j < panels; j++) {
                        const int64_t at = ((panel + j * spacing) * blocks + b) * kInt8Lanes;
                        if (b % kScaleLineBlocks == 0) {
                            prefetch_line(reinterpret_cast<const char*>(scales + at) + kScalePrefetchAhead);
                            prefetch_line(reinterpret_cast<const char*>(mins + at) + kScalePrefetchAhead);
                        }
                        widen_block(values + at * kBlock, scales + at, mins + at,
                                    tiles + j * panel_elements + h * 2 * kLanes);
                    }
                };
                tile_panels(xs + row * pairs, block_rows, pairs, tiles, panels, panel_elements, y + row * n, n,
                            panel * kLanes, spacing, widen);
            },
            AmxTiles{rows >= kAdjacentPanelsFrom});
    });
}
#endif

template <typename X>
void linear_int8(const X* x, int64_t rows, int64_t k, const uint8_t* values, const uint16_t* scales,
                 const uint16_t* mins, int64_t n, X* y, int num_threads) {
#if defined(AMX_TILES)
    if (rows >= kInt8TileRowsFrom && tiles_permitted())
        return linear_int8_tiles(x, rows, k, values, scales, mins, n, y, num_threads);
#endif
    // Kept between calls: no allocation a matmul. Named through references, which the lambda
    // below captures: by its own name each OpenMP thread would reach its own, empty, copy.
    thread_local std::vector<float> kept_scratch;
    thread_local QuantizedRows kept_rows;
    std::vector<float>& scratch = kept_scratch;
    QuantizedRows& quantized = kept_rows;
    quantize_rows(float_rows(x, rows, k, scratch), rows, k, quantized, num_threads);
    const int64_t blocks = quantized.blocks;
    over_panels(rows, int8_panel_count(n), kInt8Rows, kInt8Panels, num_threads,
                [&](int tile_rows, int panels, int64_t row, int64_t panel, int64_t spacing) {
                    const int64_t at = panel * blocks * kInt8Lanes;
                    dispatch<Int8Tile>(tile_rows, panels, quantized, row, values + at * kBlock, scales + at, mins + at,
                                       spacing, y + row * n, n, panel * kInt8Lanes);
                });
}

// int8 rows (values [n, blocks * 32], scales and mins [n, blocks]) into panels (see above).
void pack_int8(const uint8_t* values, const uint16_t* scales, const uint16_t* mins, int64_t n, int64_t blocks,
               uint8_t* packed_values, uint16_t* packed_scales, uint16_t* packed_mins) {
    const int64_t padded = blocks * kBlock;
    for (int64_t panel = 0; panel < int8_panel_count(n); panel++)
        for (int64_t b = 0; b < blocks; b++)
            for (int lane = 0; lane < kInt8Lanes; lane++) {
                const int64_t output = panel * kInt8Lanes + lane, at = (panel * blocks + b) * kInt8Lanes + lane;
                packed_scales[at] = output < n ? scales[output * blocks + b] : 0;
                packed_mins[at] = output < n ? mins[output * blocks + b] : 0;
                for (int t = 0; t < kBlock; t++) {
                    const int64_t step = (panel * blocks + b) * kSteps + t / kPerLane;
                    packed_values[(step * kInt8Lanes + lane) * kPerLane + t % kPerLane] =
                        output < n ? values[output * padded + b * kBlock + t] : 0;
                }
            }
}

}  // namespace

extern "C" {
// Whether this build has bfloat16 dot products. Their panels (pairs along K) are their own: a
// weight is packed for the products it will meet (`pairs`), bfloat16 rows always take them,
// float32 rows when asked (linear_bf16_dot_float32, which rounds the rows to bfloat16).
int bf16_dot_products() {
#if defined(BF16_DOT)
    return 1;
#else
    return 0;
#endif
}
int64_t bf16_packed_elements(int64_t n, int64_t k, int pairs) {
#if defined(BF16_DOT)
    if (pairs) return bf16_panel_count(n) * kLanes * 2 * bf16_pairs(k);
#endif
    return bf16_panel_count(n) * kLanes * k;
}
void bf16_pack(const BFloat16* w, int64_t n, int64_t k, BFloat16* packed, int pairs) {
#if defined(BF16_DOT)
    if (pairs) return pack_bf16_pairs(w, n, k, packed);
#endif
    pack_bf16(w, n, k, packed);
}
void linear_bf16_float32(const float* x, int64_t rows, int64_t k, const BFloat16* w, int64_t n, float* y, int threads) {
    linear_bf16(x, rows, k, w, n, y, threads);
}
void linear_bf16_bfloat16(const BFloat16* x, int64_t rows, int64_t k, const BFloat16* w, int64_t n, BFloat16* y,
                          int threads) {
#if defined(BF16_DOT)
    linear_bf16_dot(x, rows, k, w, n, y, threads);
#else
    linear_bf16(x, rows, k, w, n, y, threads);
#endif
}
#if defined(BF16_DOT)
void linear_bf16_dot_float32(const float* x, int64_t rows, int64_t k, const BFloat16* w, int64_t n, float* y,
                             int threads) {
    linear_bf16_dot(x, rows, k, w, n, y, threads);
}
#endif

// Packed int8 panels: values bytes, scales and mins for n outputs of `blocks` blocks each.
int64_t int8_packed_outputs(int64_t n) { return int8_panel_count(n) * kInt8Lanes; }
void int8_pack(const uint8_t* values, const uint16_t* scales, const uint16_t* mins, int64_t n, int64_t blocks,
               uint8_t* packed_values, uint16_t* packed_scales, uint16_t* packed_mins) {
    pack_int8(values, scales, mins, n, blocks, packed_values, packed_scales, packed_mins);
}
void linear_int8_float32(const float* x, int64_t rows, int64_t k, const uint8_t* values, const uint16_t* scales,
                         const uint16_t* mins, int64_t n, float* y, int threads) {
    linear_int8(x, rows, k, values, scales, mins, n, y, threads);
}
void linear_int8_bfloat16(const BFloat16* x, int64_t rows, int64_t k, const uint8_t* values, const uint16_t* scales,
                          const uint16_t* mins, int64_t n, BFloat16* y, int threads) {
    linear_int8(x, rows, k, values, scales, mins, n, y, threads);
}

// The rows from which this build multiplies bfloat16 (int8: 0) or int8 weights in AMX tiles, or
// 0 where it has none or Linux refuses it them.
int64_t tile_rows_from(int int8) {
#if defined(AMX_TILES)
    if (tiles_permitted()) return int8 ? kInt8TileRowsFrom : kBf16TileRowsFrom;
#endif
    (void)int8;
    return 0;
}

// The instructions this build uses for int8 dot products: what tests and logs report.
const char* int8_path() {
#if defined(INT8_VNNI)
    return "avx512-vnni";
#elif defined(INT8_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}
}
