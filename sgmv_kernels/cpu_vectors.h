// Shared by the CPU kernels (sgmv_kernels/lora_cpu.cpp, loraserve/models/cpu/*.cpp): bfloat16
// and float32 loads and stores, one element or one vector at a time, a vector's lane sum, e^x
// for x <= 0, prefetching, and each OpenMP thread's share of the work.
// Each kernel is one translation unit: these live in an anonymous namespace, as its own code does.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#ifdef __AVX512BF16__
#include <immintrin.h>  // the CPU's bfloat16 instructions (only x86 has this header)
#endif

namespace {

// Floats per vector and vector registers of the machine -march=native builds for: kernels size
// their register blocks by these (16-float vectors on AVX2 would take two registers each and spill).
#ifdef __AVX512F__
constexpr int kLanes = 16, kRegisters = 32;
#else
constexpr int kLanes = 8, kRegisters = 16;  // AVX2
#endif

// The vectors a register block takes: `wanted`, halved until its registers (`per_vector` for
// each vector: the sums it feeds and the vector itself) fit, with two to spare.
constexpr int vectors_that_fit(int wanted, int per_vector) {
    while (wanted > 1 && per_vector * wanted > kRegisters - 2) wanted /= 2;
    return wanted;
}

struct BFloat16 {
    uint16_t bits;
};

// GCC/Clang vector extensions: the compiler maps them onto the ISA -march=native gives.
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline float load(float value) { return value; }
inline void store(float* target, float value) { *target = value; }

inline float load(BFloat16 value) {
    uint32_t bits = uint32_t(value.bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Round to nearest even, NaN to the canonical quiet NaN: what c10::BFloat16 does.
inline void store(BFloat16* target, float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        target->bits = 0x7fc0;
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    target->bits = uint16_t(bits >> 16);
}

inline Floats load_vector(const float* source) {
    Floats v;
    std::memcpy(&v, source, sizeof v);
    return v;
}

inline Floats load_vector(const BFloat16* source) {
    Halves halves;
    std::memcpy(&halves, source, sizeof halves);
    Words words = __builtin_convertvector(halves, Words) << 16;
    Floats v;
    std::memcpy(&v, &words, sizeof v);
    return v;
}

inline void store_vector(float* target, Floats v) { std::memcpy(target, &v, sizeof v); }

#ifdef __AVX512BF16__
// v rounded to bfloat16 by the CPU's own conversion (vcvtneps2bf16): one instruction instead
// of eight, nearest even as store() rounds. It differs from store() only off what a model
// computes: a NaN keeps its sign (-NaN stays 0xffc0) and denormals become zero.
inline __m256bh bfloat16_vector(Floats v) { return _mm512_cvtneps_pbh(__m512(v)); }

// The same as float32 bits: the bfloat16 in the upper halves, zeros below.
inline Words bfloat16_bits(Floats v) {
    return Words(_mm512_slli_epi32(_mm512_cvtepu16_epi32(__m256i(bfloat16_vector(v))), 16));
}

inline void store_vector(BFloat16* target, Floats v) {
    const __m256bh halves = bfloat16_vector(v);
    std::memcpy(target, &halves, sizeof halves);
}
#else
// v rounded to bfloat16 as store() rounds it (nearest even, NaN to the canonical quiet NaN),
// as float32 bits: the bfloat16 in the upper halves, zeros below. In registers: a round trip
// through memory stalls on store forwarding.
inline Words bfloat16_bits(Floats v) {
    Words bits;
    std::memcpy(&bits, &v, sizeof bits);
    const Words rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const Words is_nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
    return (rounded & ~is_nan) | (0x7fc00000u & is_nan);
}

inline void store_vector(BFloat16* target, Floats v) {
    const Halves halves = __builtin_convertvector(bfloat16_bits(v) >> 16, Halves);
    std::memcpy(target, &halves, sizeof halves);
}
#endif

typedef float Floats16 __attribute__((vector_size(16 * sizeof(float))));
typedef float Floats8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Floats4 __attribute__((vector_size(4 * sizeof(float))));

// A vector's lanes summed by adding its halves in registers (a loop over lanes through memory
// stalls on store forwarding); Floats is one of these, by kLanes.
inline float lanes_sum(Floats4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float lanes_sum(Floats8 v) {
    Floats4 halves[2];
    std::memcpy(halves, &v, sizeof v);
    return lanes_sum(halves[0] + halves[1]);
}
inline float lanes_sum(Floats16 v) {
    Floats8 halves[2];
    std::memcpy(halves, &v, sizeof v);
    return lanes_sum(halves[0] + halves[1]);
}

typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x for x <= 0 (softmax scores minus their maximum, -|x| in SiLU), 16 at a time: x = n ln2 + r with n the nearest
// integer to x / ln2 (so |r| <= ln2 / 2), e^r by its degree-7 Taylor polynomial (relative
// error below 1e-8, under float32's own rounding), 2^n put straight into the exponent bits.
// Below -87 the result is 0 (expf would give a denormal there; neither user can tell).
inline Floats exp_nonpositive(Floats x) {
    const Ints below = x < -87.0f;
    const Floats clamped = below ? Floats{} - 87.0f : x;
    const Ints n = __builtin_convertvector(clamped * 1.44269504f - 0.5f, Ints);  // truncates: rounds x <= 0
    const Floats whole = __builtin_convertvector(n, Floats);
    const Floats r = clamped - whole * 0.693359375f + whole * 2.12194440e-4f;  // ln2 in two parts
    Floats p = Floats{} + 1.0f / 5040.0f;
    for (const float coefficient : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
        p = p * r + coefficient;
    const Ints exponent = (n + 127) << 23;
    Floats scale;
    std::memcpy(&scale, &exponent, sizeof scale);
    return below ? Floats{} : p * scale;
}

// Ask for a cache line ahead of its use, into L2 only (prefetcht1; PLDL2KEEP on Arm). What the
// kernels prefetch (adapter weights, KV blocks) is read from memory once a step; a prefetch into
// L1 holds one of L1's few miss buffers until the line arrives, so fewer lines are on their way
// at once. On a Zen 4 VM, L2 hints made the LoRA and decode attention kernels ~15% faster.
inline void prefetch_line(const void* address) { __builtin_prefetch(address, 0, 2); }

// Every cache line of [start, start + bytes).
inline void prefetch_lines(const void* start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) prefetch_line(static_cast<const char*>(start) + offset);
}

// Items [begin, end) of `count` for thread `thread` of `threads`: contiguous shares, so each
// thread knows which item it takes next (and can ask for that item's data early).
struct Share {
    int64_t begin, end;
};
inline Share thread_share(int64_t count, int64_t thread, int64_t threads) {
    return {count * thread / threads, count * (thread + 1) / threads};
}

}  // namespace
