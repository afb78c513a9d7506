// A whole decode step of a Llama-family model in one call: every layer's kernels run back to back
// without coming back to Python between them (about 270 calls a token for the default model).
//
// The kernels are those the model calls one by one (linear.cpp, layer_ops.cpp,
// paged_attention.cpp, sgmv_kernels/lora_cpu.cpp), each built as its own library; the plan
// reaches them through function pointers. Python plans once (weights, caches, adapter tables:
// decode_step.py) and hands each step only its rows' integers: the step looks up their
// embeddings and rotary rows itself (in torch, those small ops and tensors took 70 us a step,
// more right after a step has pushed them out of cache). The order of operations is decoder.py's,
// so the result is the same to the last bit.
#include <algorithm>
#include <cstdint>

#include "cpu_vectors.h"

namespace {

// A base-model matmul as linear.cpp holds its weight.
struct Matmul {
    const void* weights;  // bfloat16 panels, or int8 values
    const void* scales;   // int8's block scales (float16); null: bfloat16 panels
    const void* mins;     // int8's block minimums (float16)
    const void* bias;     // [n] in the compute dtype, or null
    int64_t n, k;
};

// One group of projections sharing an input, as lora_cpu.cpp reads its tables (lora/slots.py).
struct LoraGroup {
    const int64_t* a_rows;
    const int64_t* b_rows;
    const int32_t* ranks;
    const float* scales;
    const int64_t* widths;
    int64_t num_projections;
};

struct Layer {
    const void* input_norm;
    const void* post_attention_norm;
    Matmul qkv, o, gate_up, down;
    LoraGroup lora_qkv, lora_o, lora_gate_up, lora_down;
    void* k_cache;  // [num_blocks, block_size, Hkv, D]
    void* v_cache;
    const void* q_norm;  // [D]: q and k RMS-normalized per head before the rotary (Qwen3); null: none
    const void* k_norm;
};

// The kernels' entry points, as void* so that Python fills them; cast where called.
struct Kernels {
    void* add_rms_norm;
    void* silu_mul;
    void* rotary_store_kv;
    void* attention;
    void* lora_add;
    void* linear_bfloat16;
    void* linear_int8;
};

struct Model {
    Kernels kernels;
    const Layer* layers;
    int64_t num_layers;
    const BFloat16* embed;  // [vocab, hidden]
    const void* rope_cos;   // [max_positions, head_dim] in the compute dtype
    const void* rope_sin;
    const void* final_norm;
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, block_stride;
    double eps, scale;
    const void* lora_pool;
    int64_t lora_num_slots, lora_max_rank;
};

// One step's rows (all one token each).
struct Step {
    int64_t rows;
    const int64_t* token_ids;  // [rows], each below the vocabulary's size (checked by the caller)
    const int64_t* positions;  // [rows], each below the rotary table's
    const int64_t* slot_blocks;  // [rows] where each row writes its K and V
    const int64_t* slot_offsets;
    const int64_t* block_tables;  // [rows, max_blocks]
    int64_t max_blocks;
    const int64_t* context_lens;  // [rows]
    const int64_t* lora_order;    // lora_cpu.cpp's row chunks; lora_num_chunks 0: no adapted row
    const int32_t* lora_chunks;
    int64_t lora_num_chunks;
    void* workspace;  // decode_step_workspace(model, rows) elements
    void* out;        // [rows, hidden] after the final norm
    int64_t threads;
};

template <typename T>
struct Buffers {
    T *residual, *cos, *sin, *normed, *qkv, *attended, *delta, *gate_up, *activated;
};

int64_t qkv_width(const Model& m) { return (m.num_heads + 2 * m.num_kv_heads) * m.head_dim; }

template <typename T>
Buffers<T> carve(const Model& m, int64_t rows, T* next) {
    auto take = [&](int64_t width) {
        T* taken = next;
        next += rows * width;
        return taken;
    };
    Buffers<T> b;
    b.residual = take(m.hidden);
    b.cos = take(m.head_dim);
    b.sin = take(m.head_dim);
    b.normed = take(m.hidden);
    b.qkv = take(qkv_width(m));
    b.attended = take(m.num_heads * m.head_dim);
    b.delta = take(m.hidden);
    b.gate_up = take(2 * m.intermediate);
    b.activated = take(m.intermediate);
    return b;
}

int64_t workspace_elements(const Model& m, int64_t rows) {
    return rows * (3 * m.hidden + 2 * m.head_dim + qkv_width(m) + m.num_heads * m.head_dim + 3 * m.intermediate);
}

template <typename T>
class StepRunner {
   public:
    StepRunner(const Model& m, const Step& s)
        : m_(m), s_(s), threads_(int(s.threads)), b_(carve(m, s.rows, static_cast<T*>(s.workspace))) {}

    void run() {
        embed_rows();
        T* residual = b_.residual;
        const T* delta = nullptr;  // the first layer's stream is the embedding alone
        for (int64_t i = 0; i < m_.num_layers; i++) {
            const Layer& layer = m_.layers[i];
            norm(delta, residual, layer.input_norm, b_.normed);
            project(layer.qkv, layer.lora_qkv, b_.normed, b_.qkv);
            attend(layer);
            project(layer.o, layer.lora_o, b_.attended, b_.delta);
            norm(b_.delta, residual, layer.post_attention_norm, b_.normed);
            project(layer.gate_up, layer.lora_gate_up, b_.normed, b_.gate_up);
            reinterpret_cast<void (*)(const T*, T*, int64_t, int64_t, int)>(m_.kernels.silu_mul)(
                b_.gate_up, b_.activated, s_.rows, m_.intermediate, threads_);
            project(layer.down, layer.lora_down, b_.activated, b_.delta);
            delta = b_.delta;
        }
        norm(delta, residual, m_.final_norm, static_cast<T*>(s_.out));
    }

   private:
    // Each row's token embedding (widened, as F.embedding(...).to(dtype)) and rotary rows.
    void embed_rows() {
        const int64_t hidden = m_.hidden, head_dim = m_.head_dim;
        const T* cos = static_cast<const T*>(m_.rope_cos);
        const T* sin = static_cast<const T*>(m_.rope_sin);
        for (int64_t r = 0; r < s_.rows; r++) {
            const BFloat16* row = m_.embed + s_.token_ids[r] * hidden;
            for (int64_t j = 0; j < hidden; j++) store(b_.residual + r * hidden + j, load(row[j]));
            std::copy_n(cos + s_.positions[r] * head_dim, head_dim, b_.cos + r * head_dim);
            std::copy_n(sin + s_.positions[r] * head_dim, head_dim, b_.sin + r * head_dim);
        }
    }

    // residual += delta (none: as it is), out = RMSNorm(residual) * weight.
    void norm(const T* delta, T* residual, const void* weight, T* out) {
        using Fn = void (*)(const T*, T*, const T*, T*, int64_t, int64_t, float, int);
        reinterpret_cast<Fn>(m_.kernels.add_rms_norm)(delta, residual, static_cast<const T*>(weight), out, s_.rows,
                                                      m_.hidden, float(m_.eps), threads_);
    }

    // out = x W^T (+ bias), then each adapted row's LoRA added, as decoder.py's project().
    void project(const Matmul& w, const LoraGroup& lora, const T* x, T* out) {
        if (w.scales != nullptr) {
            using Fn = void (*)(const T*, int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, int64_t,
                                T*, int);
            reinterpret_cast<Fn>(m_.kernels.linear_int8)(x, s_.rows, w.k, static_cast<const uint8_t*>(w.weights),
                                                         static_cast<const uint16_t*>(w.scales),
                                                         static_cast<const uint16_t*>(w.mins), w.n, out, threads_);
        } else {
            using Fn = void (*)(const T*, int64_t, int64_t, const BFloat16*, int64_t, T*, int);
            reinterpret_cast<Fn>(m_.kernels.linear_bfloat16)(x, s_.rows, w.k, static_cast<const BFloat16*>(w.weights),
                                                             w.n, out, threads_);
        }
        if (w.bias != nullptr) {
            const T* bias = static_cast<const T*>(w.bias);
            for (int64_t r = 0; r < s_.rows; r++)
                for (int64_t j = 0; j < w.n; j++) store(out + r * w.n + j, load(out[r * w.n + j]) + load(bias[j]));
        }
        if (s_.lora_num_chunks == 0) return;
        using Fn = void (*)(const T*, int64_t, int64_t, const T*, const int64_t*, const int64_t*, const int32_t*,
                            const float*, int64_t, int64_t, const int64_t*, int64_t, const int64_t*, const int32_t*,
                            int64_t, T*, int64_t, int);
        reinterpret_cast<Fn>(m_.kernels.lora_add)(x, w.k, w.k, static_cast<const T*>(m_.lora_pool), lora.a_rows,
                                                  lora.b_rows, lora.ranks, lora.scales, m_.lora_num_slots,
                                                  m_.lora_max_rank, lora.widths, lora.num_projections, s_.lora_order,
                                                  s_.lora_chunks, s_.lora_num_chunks, out, w.n, threads_);
    }

    // Rotate q and k, write k and v to the cache, attend: `attended` [rows, Hq * D].
    void attend(const Layer& layer) {
        T* k_cache = static_cast<T*>(layer.k_cache);
        T* v_cache = static_cast<T*>(layer.v_cache);
        const int64_t width = qkv_width(m_);
        norm_heads(layer.q_norm, 0, m_.num_heads);
        norm_heads(layer.k_norm, m_.num_heads, m_.num_kv_heads);
        using Rotary = void (*)(T*, int64_t, const T*, const T*, int64_t, int64_t, int64_t, int64_t, T*, T*, int64_t,
                                const int64_t*, const int64_t*, int);
        reinterpret_cast<Rotary>(m_.kernels.rotary_store_kv)(
            b_.qkv, width, b_.cos, b_.sin, s_.rows, m_.num_heads,
            m_.num_kv_heads, m_.head_dim, k_cache, v_cache, m_.block_stride, s_.slot_blocks, s_.slot_offsets, threads_);
        using Attention = void (*)(const T*, int64_t, const T*, const T*, int64_t, const int64_t*, int64_t,
                                   const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, T*, int);
        reinterpret_cast<Attention>(m_.kernels.attention)(
            b_.qkv, width, k_cache, v_cache, m_.block_stride, s_.block_tables, s_.max_blocks, s_.context_lens, s_.rows,
            m_.num_heads, m_.num_kv_heads, m_.head_dim, m_.block_size, float(m_.scale), b_.attended, threads_);
    }

    // Heads [first, first + count) of every row RMS-normalized in place (decoder.py's _norm_q_and_k), through
    // `attended` (free until attention writes it).
    void norm_heads(const void* weight, int64_t first, int64_t count) {
        if (weight == nullptr) return;
        const int64_t width = qkv_width(m_), head_dim = m_.head_dim;
        using Fn = void (*)(const T*, T*, const T*, T*, int64_t, int64_t, float, int);
        for (int64_t r = 0; r < s_.rows; r++) {
            T* heads = b_.qkv + r * width + first * head_dim;
            reinterpret_cast<Fn>(m_.kernels.add_rms_norm)(nullptr, heads, static_cast<const T*>(weight), b_.attended,
                                                          count, head_dim, float(m_.eps), threads_);
            std::copy_n(b_.attended, count * head_dim, heads);
        }
    }

    const Model& m_;
    const Step& s_;
    const int threads_;
    const Buffers<T> b_;
};

}  // namespace

extern "C" {
int64_t decode_step_workspace(const Model* model, int64_t rows) { return workspace_elements(*model, rows); }
void decode_step_float32(const Model* model, const Step* step) { StepRunner<float>(*model, *step).run(); }
void decode_step_bfloat16(const Model* model, const Step* step) { StepRunner<BFloat16>(*model, *step).run(); }
}
