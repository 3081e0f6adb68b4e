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

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bfloat16.h"

namespace {

constexpr int kMaxLanes = 16;
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

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

// The version of the calling convention below; decode_ops.py refuses a library of another.
int kvm_decode_abi_version() { return 1; }

// For each of `rows` rows of n floats: h += delta where delta is not null (the residual add, in place),
// then out = the RMS norm of h with weight w. `sq` is n floats of scratch (h * h). Returns 0, or -2 for
// lanes other than 8 / 16, n < 1 or rows < 0.
int kvm_decode_add_rms_norm(float* h, const float* delta, const float* w, int64_t rows, int64_t n, float eps,
                            int lanes, float* sq, float* out) {
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

}  // extern "C"
#pragma GCC visibility pop
