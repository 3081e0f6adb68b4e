// The small parts of a llama forward step, each giving the same bits as the torch ops transformers runs
// for it: RMS norm (with the residual add before it) and RoPE on q / k with the K/V write into the
// cache, for a few tokens (one while decoding, 16 after a graft). Those are ~6 torch ops per norm and
// ~15 per layer for RoPE and the cache, a few microseconds of dispatch each: a third of a decode step
// on a 2-core CPU (models/llama_step.py).
//
// Same bits, op by op (the build has -ffp-contract=off: no FMA fuses a product into a sum):
//   residual add   h = a + b                              torch: add (fmadd(b, 1, a): one rounding, as a + b)
//   RMS norm       s = sum(h * h) in torch's cascade order (below), var = s / n, r = 1 / sqrt(var + eps),
//                  out = w * (h * r)                      transformers' LlamaRMSNorm: pow(2), mean, add, rsqrt,
//                                                         mul, mul; torch's CPU mean is sum, then div_ by n
//   RoPE           x * cos + rotate_half(x) * sin          two products rounded, then their sum
//   K/V write      copy, rounded to bfloat16 where the cache keeps bfloat16 (bfloat16.h: torch's rounding)
//
// torch's sum over a contiguous float32 row of n >= W elements (aten/src/ATen/native/cpu/SumKernel.cpp,
// `vectorized_inner_sum`): the row is read as n / W vectors of W lanes (W = 16 where torch runs
// AVX-512, 8 for AVX2); `row_sum` adds them in four interleaved accumulators (vector i into i % 4) with
// a cascade of 4 levels, then accumulator 0 + 1 + 2 + 3; the n % W elements past the vectors are summed
// from 0, then the W lanes of that vector are added to them one by one. A row shorter than W is summed
// as scalars by the same `row_sum` (one lane). `lanes` is W, read from torch (decode_ops.py); the
// tests compare against torch's own ops under both.
//
// Plain C entry points over raw pointers (no torch headers); decode_ops.py checks the tensors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "bfloat16.h"
#include "parallel.h"

namespace {

constexpr int kMaxLanes = 16;
constexpr int64_t kMaxParallelRows = 256;  // sequences of a step whose rows kvm_decode_rows may spread over threads
constexpr int kIlp = 4;     // torch's row_sum: ilp_factor
constexpr int kLevels = 4;  // torch's multi_row_sum: num_levels

int64_t ceil_log2(int64_t x) {  // torch's utils::CeilLog2
    if (x <= 2) return 1;
    return 64 - __builtin_clzll(static_cast<uint64_t>(x) - 1);
}

// torch's row_sum over `count` elements of `L` lanes each (element i, lane l at x[i * L + l]): the
// lanes of the result in `out` (torch: one Vectorized<float>, or one float where L == 1).
template <int L>
void row_sum(const float* x, int64_t count, float out[L]) {
    const int64_t size = count / kIlp;  // multi_row_sum over `size` rows of kIlp elements
    const int64_t level_power = ceil_log2(size) / kLevels > 4 ? ceil_log2(size) / kLevels : 4;
    const int64_t level_step = int64_t(1) << level_power;
    const int64_t level_mask = level_step - 1;
    float acc[kLevels][kIlp][L] = {};
    auto add_row = [&](float dst[kIlp][L], int64_t i) {
        for (int k = 0; k < kIlp; ++k)
            for (int l = 0; l < L; ++l) dst[k][l] += x[(i * kIlp + k) * L + l];
    };
    int64_t i = 0;
    for (; i + level_step <= size;) {
        for (int64_t j = 0; j < level_step; ++j, ++i) add_row(acc[0], i);
        for (int j = 1; j < kLevels; ++j) {
            for (int k = 0; k < kIlp; ++k)
                for (int l = 0; l < L; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i) add_row(acc[0], i);
    for (int j = 1; j < kLevels; ++j)
        for (int k = 0; k < kIlp; ++k)
            for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
    float partial[kIlp][L];
    std::memcpy(partial, acc[0], sizeof partial);
    for (int64_t e = size * kIlp; e < count; ++e)
        for (int l = 0; l < L; ++l) partial[0][l] += x[e * L + l];
    for (int k = 1; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) partial[0][l] += partial[k][l];
    std::memcpy(out, partial[0], sizeof(float) * L);
}

template <int W>
float torch_sum(const float* x, int64_t n) {
    if (n < W) {  // torch's scalar_inner_sum: row_sum of single floats
        float s[1];
        row_sum<1>(x, n, s);
        return 0.0f + s[0];
    }
    const int64_t vecs = n / W;
    float lanes[W];
    row_sum<W>(x, vecs, lanes);
    float acc = 0.0f;
    for (int64_t k = vecs * W; k < n; ++k) acc += x[k];
    for (int l = 0; l < W; ++l) acc += lanes[l];
    return 0.0f + acc;  // torch fills the output with 0 and accumulates into it
}

template <typename KV>
void write_rows(const float* src, KV* dst, int64_t heads, int64_t D, int64_t head_stride) {
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < D; ++d) dst[h * head_stride + d] = kvm::from_f32<KV>(src[h * D + d]);
}

// ---- One decoder layer in one call (the lean step's decode path) ----
//
// A decode step is ~10 calls per layer from Python (norms, linears, RoPE + cache write, attention),
// each a few microseconds of Python and ctypes around a few microseconds of work: ~3 ms of a 12 ms
// step on a 2-core CPU. `kvm_decode_layer` makes those calls itself, in the order llama_step.py makes
// them and with the arguments it passes, to the same functions: this library's norm and RoPE, and the
// GGUF-block linear and few-query attention kernels, whose C entry points Python hands over (the
// builds native.py chose). So every value is computed by the same code from the same inputs: the same
// bits by construction (tests/test_llama_step.py compares the two paths with torch.equal). Only SiLU
// and its product stay torch's (llama_step.py), between the calls: torch's exp is not this code's.

using LinearFn = int (*)(int kind, const float* x, int64_t M, const void* q, const float* d, const float* m,
                         int64_t P, int64_t K, float* y, int threads);
using AttendFn = int (*)(int q_dtype, int kv_dtype, const void* q, const void* k, const void* v, const bool* mask,
                         void* out, int64_t Hq, int64_t T, int64_t D, int64_t Hkv, int64_t S, int64_t q_sh,
                         int64_t q_st, int64_t k_sh, int64_t k_ss, int64_t v_sh, int64_t v_ss, int64_t mask_st,
                         float scale, int causal, int threads);

// A GGUF-block linear's panels (kernels/quantized_linear.py's layout): the kernel's own arguments.
struct KvmLinear {
    int64_t kind;
    const void* q;
    const float* d;  // null for F32 panels
    const float* m;  // null for formats without a minimum
    int64_t panels;
    int64_t in_features;
    const float* bias;  // [panels * 16] added to each output after its sum (Qwen2's q/k/v), or null
};

// What does not change between steps: a layer's norms and linears.
struct KvmLayer {
    const float* norm1;  // input_layernorm.weight
    const float* norm2;  // post_attention_layernorm.weight
    double eps1, eps2;   // their variance_epsilon (passed on as float, as ctypes passes it to the norm)
    KvmLinear qkv, o, gate_up, down;
    // Where q/k/v (or gate/up) are not one fused linear (their block types differ: a Q4_K_M file's v is
    // Q6_K in some layers), qkv is q alone and k, v the others (gate_up is gate, up the other); each
    // output is the same sum whether fused or not. Unfused: k.q (up.q) is set; fused: null.
    KvmLinear k, v, up;
};

// One step's shapes, positions and scratch, the same for every layer of the step.
struct KvmStep {
    LinearFn linear;
    AttendFn attend;
    int64_t T, hq, hkv, D, hidden, ffn;
    int64_t lanes;        // the norms' sum width (decode_ops.sum_lanes)
    int64_t threads;      // torch's thread count, passed to the linears and attention
    int64_t position;     // where this step's K/V go: the tokens cached before it
    int64_t head_stride;  // elements between K (and V) heads in a layer's buffers: capacity * D
    int64_t kv_bf16;      // the cache keeps bfloat16 (else float32); 2: bfloat16, scored as the q8 profile
                          // scores (the attention kernel's kBf16Scores)
    int64_t causal;       // the attention call's causal flag (without a mask)
    int64_t keys;         // keys attended: S
    const bool* mask;     // [T, S] bool rows, mask_st apart (rows that are prefixes of trues), or null
    int64_t mask_st;
    double scale;
    const float* cos;     // [T, D]
    const float* sin;
    float* h;             // [T, hidden] the residual stream, updated in place
    float* scratch;       // layer_scratch_floats() floats
    float* gate_up;       // [T, 2 ffn] out: this layer's gate/up projections (Python applies SiLU * up)
};

int64_t layer_scratch_floats(const KvmStep& s) {
    const int64_t T = s.T, qkv = (s.hq + 2 * s.hkv) * s.D;
    return T * s.hidden * 2 + T * qkv + T * s.hq * s.D * 2 + s.hidden + s.hkv * s.D + T * std::max(qkv, 2 * s.ffn);
}

int run_linear(const KvmStep& s, const KvmLinear& l, const float* x, float* y) {
    const int rc = s.linear(static_cast<int>(l.kind), x, s.T, l.q, l.d, l.m, l.panels, l.in_features, y,
                            static_cast<int>(s.threads));
    if (rc == 0 && l.bias != nullptr) {  // torch's y.add_(bias): one rounded add per output (gguf_linear.py)
        const int64_t N = l.panels * 16;
        for (int64_t t = 0; t < s.T; ++t)
            for (int64_t n = 0; n < N; ++n) y[t * N + n] = y[t * N + n] + l.bias[n];
    }
    return rc;
}

// Linears side by side as one (`parts`, the null ones left out) into y [T, width]: each writes its own
// columns, computing into `tmp` [T, its outputs] first where rows are more than one.
int run_side_by_side(const KvmStep& s, std::initializer_list<const KvmLinear*> parts, const float* x, float* y,
                     int64_t width, float* tmp) {
    int64_t col = 0;
    for (const KvmLinear* l : parts) {
        if (l->q == nullptr) continue;
        const int64_t N = l->panels * 16;
        if (s.T == 1) {
            if (const int rc = run_linear(s, *l, x, y + col)) return rc;
        } else {
            if (const int rc = run_linear(s, *l, x, tmp)) return rc;
            for (int64_t t = 0; t < s.T; ++t) std::memcpy(y + t * width + col, tmp + t * N, sizeof(float) * N);
        }
        col += N;
    }
    return col == width ? 0 : -2;
}

// Where one layer's intermediates lie in a step's scratch (layer_scratch_floats() floats).
struct LayerScratch {
    float* delta;         // [T, hidden]: the down / o projection added to h
    float* x;             // [T, hidden]: the normed h a layer's linears read
    float* qkv;           // [T, qkv width]
    float* q;             // [T, hq, D]: RoPE'd q
    float* att;           // [T, hq * D]: attention's output
    float* sq;            // [hidden]: the norm's squares
    float* rope_scratch;  // [hkv * D]
    float* parts;         // [T, max(qkv width, 2 ffn)]: unfused linears' rows
};

LayerScratch layer_scratch(const KvmStep& s) {
    const int64_t T = s.T, qkv_width = (s.hq + 2 * s.hkv) * s.D;
    LayerScratch w;
    w.delta = s.scratch;
    w.x = w.delta + T * s.hidden;
    w.qkv = w.x + T * s.hidden;
    w.q = w.qkv + T * qkv_width;
    w.att = w.q + T * s.hq * s.D;
    w.sq = w.att + T * s.hq * s.D;
    w.rope_scratch = w.sq + s.hidden;
    w.parts = w.rope_scratch + s.hkv * s.D;
    return w;
}

int add_rms_norm_rows(float* h, const float* delta, const float* w, int64_t rows, int64_t n, float eps, int lanes,
                       float* sq, float* out) {
    if ((lanes != 8 && lanes != 16) || n < 1 || rows < 0) return -2;
    for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * n;
        float* o = out + r * n;
        if (delta != nullptr)
            for (int64_t i = 0; i < n; ++i) hr[i] = hr[i] + delta[r * n + i];
        for (int64_t i = 0; i < n; ++i) sq[i] = hr[i] * hr[i];
        const float s = lanes == 16 ? torch_sum<16>(sq, n) : torch_sum<8>(sq, n);
        const float var = s / static_cast<float>(n);
        const float inv = 1.0f / std::sqrt(var + eps);
        for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (hr[i] * inv);
    }
    return 0;
}

// h += delta (where not null) and the RMS norm of h with `weight` into w.x, over the step's T rows.
int add_rms_norm(const KvmStep& s, const float* delta, const float* weight, double eps, const LayerScratch& w) {
    return add_rms_norm_rows(s.h, delta, weight, s.T, s.hidden, static_cast<float>(eps), static_cast<int>(s.lanes),
                             w.sq, w.x);
}

// A layer's first third: `prev`'s down projection of `act` (none for the first layer), h += it and the
// input norm, then q/k/v into w.qkv.
int layer_in(const KvmStep& s, const KvmLayer* prev, const float* act, const KvmLayer& cur, const LayerScratch& w) {
    int rc;
    if (prev != nullptr && (rc = run_linear(s, prev->down, act, w.delta))) return rc;
    if ((rc = add_rms_norm(s, prev != nullptr ? w.delta : nullptr, cur.norm1, cur.eps1, w))) return rc;
    return run_side_by_side(s, {&cur.qkv, &cur.k, &cur.v}, w.x, w.qkv, (s.hq + 2 * s.hkv) * s.D, w.parts);
}

// A layer's last third: o of w.att, h += it and the post-attention norm, gate/up into s.gate_up.
int layer_out(const KvmStep& s, const KvmLayer& cur, const LayerScratch& w) {
    int rc;
    if ((rc = run_linear(s, cur.o, w.att, w.delta))) return rc;
    if ((rc = add_rms_norm(s, w.delta, cur.norm2, cur.eps2, w))) return rc;
    return run_side_by_side(s, {&cur.gate_up, &cur.up}, w.x, s.gate_up, 2 * s.ffn, w.parts);
}

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

// The version of the calling convention below; decode_ops.py refuses a library of another.
// 9: KvmRows' threads; 8: KvmRow's T and causal; 7: kvm_decode_rows_layer; 6: kv_bf16 2 (the q8 profile's scores)
int kvm_decode_abi_version() { return 9; }

// For each of `rows` rows of n floats: h += delta where delta is not null (the residual add, in place),
// then out = the RMS norm of h with weight w. `sq` is n floats of scratch (h * h). Returns 0, or -2 for
// lanes other than 8 / 16, n < 1 or rows < 0.
int kvm_decode_add_rms_norm(float* h, const float* delta, const float* w, int64_t rows, int64_t n, float eps,
                            int lanes, float* sq, float* out) {
    return add_rms_norm_rows(h, delta, w, rows, n, eps, lanes, sq, out);
}


// qkv: `rows` tokens' [hq + 2 * hkv heads, D] float32 (q heads, then k, then v), row t at t * (hq + 2 hkv) * D;
// cos / sin: each row's D values. q_out [rows, hq, D] = RoPE(q) (the memory order of transformers'
// `view(...).transpose(1, 2)` q). The k heads' RoPE and the v heads are written at k_dst / v_dst: head h,
// row t at h * head_stride + t * D elements (consecutive positions of a cache's buffers), as float32
// (kv_bf16 == 0) or rounded to bfloat16 (1). `scratch` is hkv * D floats. Returns 0, or -2 for an odd
// D, a head stride shorter than rows * D, or negative sizes.
int kvm_decode_rope_write(const float* qkv, const float* cos, const float* sin, int64_t rows, int64_t hq,
                          int64_t hkv, int64_t D, float* q_out, void* k_dst, void* v_dst, int64_t head_stride,
                          int kv_bf16, float* scratch) {
    if (D % 2 || D < 2 || rows < 0 || hq < 0 || hkv < 0 || (hkv > 1 && head_stride < rows * D)) return -2;
    const int64_t half = D / 2;
    const int64_t width = (hq + 2 * hkv) * D;
    for (int64_t t = 0; t < rows; ++t) {
        const float* x = qkv + t * width;
        const float* c = cos + t * D;
        const float* s = sin + t * D;
        auto rope = [&](const float* in, float* y) {
            for (int64_t d = 0; d < D; ++d) {
                const float rotated = d < half ? -in[d + half] : in[d - half];
                const float a = in[d] * c[d];
                const float b = rotated * s[d];
                y[d] = a + b;
            }
        };
        for (int64_t h = 0; h < hq; ++h) rope(x + h * D, q_out + (t * hq + h) * D);
        for (int64_t h = 0; h < hkv; ++h) rope(x + (hq + h) * D, scratch + h * D);
        const float* v = x + (hq + hkv) * D;
        const int64_t at = t * D;
        if (kv_bf16) {
            write_rows(scratch, static_cast<kvm::bf16*>(k_dst) + at, hkv, D, head_stride);
            write_rows(v, static_cast<kvm::bf16*>(v_dst) + at, hkv, D, head_stride);
        } else {
            write_rows(scratch, static_cast<float*>(k_dst) + at, hkv, D, head_stride);
            write_rows(v, static_cast<float*>(v_dst) + at, hkv, D, head_stride);
        }
    }
    return 0;
}

// Finishes the layer before (`prev`: its down projection of `act`, the SiLU(gate) * up Python computed
// from its gate_up; both null for the first layer) and runs layer `cur` up to its gate/up projections,
// as llama_step.py's loop does: h += delta and the input norm, q/k/v, RoPE with the K/V write at
// `position` into k_buf / v_buf ([hkv, capacity, D] of this layer), attention over the `keys` first
// positions (under the mask where there is one), o, h += o and the post-attention norm, gate/up into
// s.gate_up. Returns 0, -2 for bad sizes, or what a kernel returned (the linear's -1: out of memory;
// attention's 1: a call it does not take, which llama_step.py checks it never makes).
int kvm_decode_layer(const KvmStep* sp, const KvmLayer* prev, const float* act, const KvmLayer* cur, void* k_buf,
                     void* v_buf) {
    const KvmStep& s = *sp;
    if (s.T < 1 || s.lanes < 0 || s.keys < s.T || s.position < 0 || (prev == nullptr) != (act == nullptr)) return -2;
    const LayerScratch w = layer_scratch(s);
    int rc;
    if ((rc = layer_in(s, prev, act, *cur, w))) return rc;
    const int64_t elem = s.kv_bf16 ? 2 : 4, at = s.position * s.D * elem;
    if ((rc = kvm_decode_rope_write(w.qkv, s.cos, s.sin, s.T, s.hq, s.hkv, s.D, w.q, static_cast<char*>(k_buf) + at,
                                    static_cast<char*>(v_buf) + at, s.head_stride, static_cast<int>(s.kv_bf16),
                                    w.rope_scratch)))
        return rc;
    // q as transformers holds it: [1, hq, T, D] over [T, hq, D] memory (heads D apart, tokens hq * D)
    if ((rc = s.attend(s.kv_bf16 == 2 ? 2 : 0, s.kv_bf16 ? 1 : 0, w.q, k_buf, v_buf, s.mask, w.att, s.hq, s.T, s.D,
                       s.hkv, s.keys, s.D, s.hq * s.D, s.head_stride, s.D, s.head_stride, s.D, s.mask_st,
                       static_cast<float>(s.scale), static_cast<int>(s.causal), static_cast<int>(s.threads))))
        return rc;
    return layer_out(s, *cur, w);
}

// ---- The rows of a batched step (engine/batched_step.py), one layer's RoPE + attention in one call ----
// A step of many sequences makes, per layer and sequence, the RoPE + K/V write call and the attention call
// of that sequence's own step (csrc: kvm_decode_rope_write, then the few-query attention), ~5 us of Python
// and ctypes each: 16 sequences x 30 layers x 2 is ~5 ms a step. Here one call per layer makes them all,
// with the arguments kvm_decode_layer passes for that sequence's own step (so the same bits:
// tests/test_batched_step.py), the one-thread rows of sequences whose K/V are apart spread over the threads
// (a 4 / 16-row decode step of the embedded model 10-25 % faster on 2 Zen 3 cores than row after row). A
// sequence's part is a decode row (T = 1) or a short chunk (T > 1: a prefill chunk, an answer choice's tokens).
struct KvmRows {  // what every row of the step shares
    AttendFn attend;
    int64_t hq, hkv, D, kv_bf16;
    double scale;
    int64_t threads;  // torch's thread count: the team over which rows of one thread each are spread
};
struct KvmRow {  // one sequence's rows
    int64_t at;                   // its first row among the step's rows: qkv row `at`, attention output row `at`
    int64_t T;                    // its rows (tokens), at consecutive positions
    int64_t causal;               // the attention call's causal flag (without a mask: an empty cache, T > 1)
    const float* cos;             // [T, D], its positions'
    const float* sin;
    float* q;                     // [T, hq, D] scratch: its RoPE'd q
    float* rope_scratch;          // [hkv * D]
    void* const* k_write;         // per layer: where its first K goes (the buffer at its position)
    void* const* v_write;
    const void* const* k_read;    // per layer: the buffer's start (keys 0 .. `keys` - 1 attended)
    const void* const* v_read;
    const bool* mask;             // [T, keys] rows mask_st apart, or null
    int64_t keys, mask_st, threads;
    int64_t head_stride;          // elements between its cache's K (and V) heads: its capacity * D
};

// One row's RoPE + K/V write and attention of layer `layer` (kvm_decode_layer's calls for its own step).
static int decode_row(const KvmRows* c, const KvmRow& r, int64_t layer, const float* qkv, int64_t qkv_width,
                      float* att) {
    if (r.T < 1 || r.keys < r.T) return -2;
    int rc = kvm_decode_rope_write(qkv + r.at * qkv_width, r.cos, r.sin, r.T, c->hq, c->hkv, c->D, r.q,
                                   r.k_write[layer], r.v_write[layer], r.head_stride,
                                   static_cast<int>(c->kv_bf16), r.rope_scratch);
    if (rc) return rc;
    // q as transformers holds it: [1, hq, T, D] over [T, hq, D] memory (kvm_decode_layer's call)
    return c->attend(c->kv_bf16 == 2 ? 2 : 0, c->kv_bf16 ? 1 : 0, r.q, r.k_read[layer], r.v_read[layer], r.mask,
                     att + r.at * c->hq * c->D, c->hq, r.T, c->D, c->hkv, r.keys, c->D, c->hq * c->D, r.head_stride,
                     c->D, r.head_stride, c->D, r.mask_st, static_cast<float>(c->scale), static_cast<int>(r.causal),
                     static_cast<int>(r.threads));
}

// Whether the rows' sequences keep their K/V apart (no two read or write the same buffer), so their calls
// may run in any order. Answer choices stepped over their prompt's own cache share it, and each must
// write and attend before the next overwrites the same positions: those keep the rows' order.
static bool apart(const KvmRow* rows, int64_t n, int64_t layer) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = i + 1; j < n; ++j)
            if (rows[i].k_read[layer] == rows[j].k_read[layer] || rows[i].v_read[layer] == rows[j].v_read[layer])
                return false;
    return true;
}

// Layer `layer`'s RoPE + K/V write and attention for `n` sequences' rows: qkv [rows, qkv_width], att [rows,
// hq * D] (rows `at` .. `at` + T - 1 of each). Returns 0, or the first refusal in the rows' order (-2 rope or
// bad sizes, or the attention kernel's code). Rows whose attention runs on one thread (a decode row over few
// keys: batched_step.py's ONE_THREAD_KEYS) are spread over `c->threads` OpenMP threads, one row
// per thread at a time, where the sequences' K/V are apart: each row's calls are the same whichever thread
// makes them, so its bits are too; the others follow, each with its own threads.
int kvm_decode_rows(const KvmRows* c, const KvmRow* rows, int64_t n, int64_t layer, const float* qkv,
                    int64_t qkv_width, float* att) {
    int64_t single = 0;  // rows of one thread, in the rows' order
    int64_t idx[kMaxParallelRows];
    if (n > 1 && n <= kMaxParallelRows && apart(rows, n, layer)) {
        for (int64_t i = 0; i < n; ++i)
            if (rows[i].threads == 1) idx[single++] = i;
    }
    if (single < 2) {
        for (int64_t i = 0; i < n; ++i)
            if (int rc = decode_row(c, rows[i], layer, qkv, qkv_width, att)) return rc;
        return 0;
    }
    int rcs[kMaxParallelRows] = {0};
    const bool ok = kvm::parallel_for(static_cast<int>(c->threads), 0, single, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) rcs[idx[k]] = decode_row(c, rows[idx[k]], layer, qkv, qkv_width, att);
    });
    if (!ok) return -3;
    for (int64_t i = 0; i < n; ++i) {
        if (rows[i].threads != 1) rcs[i] = decode_row(c, rows[i], layer, qkv, qkv_width, att);
        if (rcs[i]) return rcs[i];
    }
    return 0;
}

// Where every sequence of a batched step takes kvm_decode_rows (engine/batched_step.py's `all_fast`), its
// Python layer loop is ~8 calls a layer (two norms, the linears, kvm_decode_rows), ~0.4 ms of Python a
// layer beside ~0.6 ms of work for 4 rows on a 2-core CPU. This makes them in one call, in the loop's
// order, with its arguments: `prev`'s down projection of `act` (the SiLU(gate) * up Python computed from
// the layer before's gate_up; both null for the first layer), h += delta and the input norm over the s.T
// rows, q/k/v, each sequence's RoPE + K/V write and attention (kvm_decode_rows: `rows`, `n` of them,
// their T summing to s.T), o, h += o and the post-attention norm, gate/up into s.gate_up. Of `s` it reads
// linear, T, hq, hkv, D, hidden, ffn, lanes, threads, h, scratch (kvm_decode_layer_scratch's floats) and
// gate_up. Returns 0, -2 for bad sizes, or what a kernel returned.
int kvm_decode_rows_layer(const KvmStep* sp, const KvmLayer* prev, const float* act, const KvmLayer* cur,
                          const KvmRows* c, const KvmRow* rows, int64_t n, int64_t layer) {
    const KvmStep& s = *sp;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (rows[i].at != total) return -2;  // the sequences' rows in order, none left out
        total += rows[i].T;
    }
    if (s.T < 1 || total != s.T || s.lanes < 0 || (prev == nullptr) != (act == nullptr)) return -2;
    const LayerScratch w = layer_scratch(s);
    int rc;
    if ((rc = layer_in(s, prev, act, *cur, w))) return rc;
    if ((rc = kvm_decode_rows(c, rows, n, layer, w.qkv, (s.hq + 2 * s.hkv) * s.D, w.att))) return rc;
    return layer_out(s, *cur, w);
}

// The floats of scratch kvm_decode_layer needs for a step of these sizes (KvmStep's).
int64_t kvm_decode_layer_scratch(const KvmStep* sp) { return layer_scratch_floats(*sp); }

}  // extern "C"
#pragma GCC visibility pop
