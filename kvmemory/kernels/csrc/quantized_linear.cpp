// Linear layers computed straight from a GGUF file's quantized blocks, float32 math: every block type of
// the Q4_K_M / Q5_K_M / Q6_K / Q8_0 files people run (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K) and
// F32 / F16 / BF16 weights, each re-laid out once (models/gguf_blocks.py) into one of five formats below.
//
// A graft's step is 16 new tokens (1 while decoding): every linear weight is read once per step for
// few rows, so the step streams the weights. Read as float32 they are 4 bytes a weight; here they are
// read as nibbles or bytes plus a float32 scale (and minimum) per sub-block of 16 or 32 weights (a
// K-quant's as compact as in its file: an int8 scale per sub-block, a float32 per 256), and the
// panels of a tile (32 output features on AVX-512, 16 on AVX2) are expanded to float32 a slice of 256 k
// at a time into an L1-resident scratch, which every row tile then multiplies.
//
// Exact weights: a weight is expanded exactly as gguf-py's `dequantize` expands it (the float32
// weights transformers' loader holds): `d * q`, or `d * q` then `+ m` (a K-quant's `- dmin * min` is
// `+ m` with m = -(dmin * min), the same value). The build has -ffp-contract=off, so only the explicit
// FMAs below fuse, and those are exact where they stand (see Format).
//
// Fixed order of sums: output (m, n) is `fma(x[m][k], w[n][k], acc)` for k = 0, 1, ..., K-1 from
// acc = 0, one SIMD lane per n. The order depends on nothing else: not on the number of rows, the
// row's place among them, the thread count, nor the vector width. So the AVX-512 and AVX2 builds give
// the same bits, and a row gives the same bits computed alone or among thousands (batch-invariant).
//
// Layouts (N output features, K input features; N % 16 == 0, K % 32 == 0; 16 = one panel):
//   x     [M, K] float32, contiguous                 y [M, N] float32, contiguous (returned)
//   nibble formats  q [N/16, K/2, 16] uint8: byte (p, t, j) = q(16p+j, 2t) | q(16p+j, 2t+1) << 4
//   byte formats    q [N/16, K, 16] int8: q(16p+j, k)
//   F32             q [N/16, K, 16] float32: w(16p+j, k)
//   d, m  [N/16, K/sub, 16] float32: scale and minimum of row 16p+j, sub-block b (sub = 16 or 32)
//   K-quant scales (kind & 256): d [N/16, K/256, Kind::super_bytes()] bytes, per super-block of 256 k:
//         D [16] f32, (DMIN [16] f32), scale [256/sub][16] int8, (min [256/sub][16] int8); m unused
//
// Plain C entry points over raw pointers (no torch headers: the library does not depend on torch's
// C++ ABI); quantized_linear.py checks the tensors against these layouts, allocates the outputs and
// passes pointers, sizes and torch's thread count. Threads are OpenMP's, torch's own libgomp (parallel.h).

#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace kvm;  // vec, kLanes, vload ... (simd.h); parallel_for (parallel.h)

constexpr int kPanel = 16;    // output features per panel
constexpr int kBlock = 32;    // K is a multiple of this (the slices and sub-blocks of every format divide it)
constexpr int64_t kTilesPerItem = 16;  // row tiles per work item of a long prefill: their rows stay in L2
constexpr int64_t kSliceK = 256;      // k per slice: a slice of a tile's panels (<= 32 KB) stays in L1


#ifdef KVM_AVX2
// ---- AVX2 + FMA: 8 lanes, 16 registers; a panel is two vectors ----
constexpr int kMaxRows = 6;   // a tile: 6 rows x 2 vectors (one panel) = 12 accumulators + 2 weights + 1 broadcast
// 8 quantized values (bytes at p) widened to float: unsigned nibble pairs, or signed bytes
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vec low_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))); }
inline vec high_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
inline vec to_float(__m256i b) { return _mm256_cvtepi32_ps(b); }
#else
// ---- AVX-512: 16 lanes, 32 registers; a panel is one vector ----
constexpr int kMaxRows = 12;  // a tile: 12 rows x 2 vectors (two panels) = 24 accumulators + 2 weights + 1 broadcast
inline __m512i u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i i8x16(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vec low_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))); }
inline vec high_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
inline vec to_float(__m512i b) { return _mm512_cvtepi32_ps(b); }
#endif

constexpr int kVecs = kPanel / kLanes;  // vectors per panel row
constexpr int kTileVecs = 2;              // vectors of output features per tile ...
constexpr int kTilePanels = kTileVecs * kLanes / kPanel;  // ... which is this many panels (AVX-512: 2, AVX2: 1)

// A kind (the C entry points' `kind`) packs a format, a sub-block size, a bias and the scale layout:
//   kind = format | (sub == 16 ? 8 : 0) | bias << 4 | (K-quant scales ? 256 : 0) | (q8 ? 512 : 0)
// q8 (not F32): the same d and m, q re-laid for integer dot products with 8-bit activations (q8_dot.h);
// | 1024 with q8 and BYTE: quants in [-32, 32) kept in 6 bits (q8_dot.h's "six" layout):
// a different sum from the float32 one below, as llama.cpp's is (`linears="q8"`).
// format  q holds                 a weight is            GGUF types it carries
//   0 NIB     nibble pairs (u4)   (q - bias) * d         Q4_0 (bias 8), Q3_K (bias 4)
//   1 NIBMIN  nibble pairs (u4)   fma(q, d, m)           Q4_1, Q4_K, Q2_K
//   2 BYTE    int8                q * d                  Q8_0, Q5_0, Q6_K
//   3 BYTEMIN int8                fma(q, d, m)           Q5_1, Q5_K
//   4 F32     float32 weights     w                      F32, F16, BF16 (expanded exactly)
// d (and m) is one float32 per sub-block of 16 or 32 weights and output row, except with K-quant scales
// (Q2_K ... Q6_K), which keep the file's own compactness: per super-block of 256 weights and row, the
// float32 D (and DMIN) and an int8 scale (and min) per sub-block, from which the kernel computes
// d = D * scale and m = -(DMIN * min) as gguf-py does (exact products: D is a float16 value). With a min,
// gguf-py rounds d * q and then the sum; one FMA rounds once, which is the same value because d * q is
// exact there (d has at most 17 significant bits, q at most 5: quantized_linear.py checks d before a call).
enum Format { kNib = 0, kNibMin = 1, kByte = 2, kByteMin = 3, kF32 = 4 };
constexpr bool has_min(int F) { return F == kNibMin || F == kByteMin; }
constexpr bool nibbles(int F) { return F == kNib || F == kNibMin; }
constexpr int64_t kSuper = 256;  // weights per K-quant super-block

struct Kind {
    int format, sub_shift, bias;
    bool kscales;
    bool q8;   // the weights laid out for integer dot products with 8-bit activations (q8_dot.h)
    bool six;  // q8 byte formats whose quants fit 6 bits (Q6_K): a nibble and 2 high bits a weight
    int64_t q_panel(int64_t K) const {  // bytes of q per panel
        return format == kF32 ? K * kPanel * 4 : nibbles(format) ? K / 2 * kPanel : six ? K / 4 * 3 * kPanel : K * kPanel;
    }
    int64_t subs_per_super() const { return kSuper >> sub_shift; }
    // bytes of one super-block's K-quant scales per panel: D[16] f32, (DMIN[16] f32), scale[nsub][16] int8, (min[nsub][16])
    int64_t super_bytes() const { return (has_min(format) ? 2 : 1) * (kPanel * 4 + subs_per_super() * kPanel); }
    // bytes of d (and of m, alike) per panel; K-quant scales: all of them (m unused)
    int64_t s_panel(int64_t K) const {
        if (format == kF32) return 0;
        return kscales ? K / kSuper * super_bytes() : (K >> sub_shift) * kPanel * 4;
    }
};

bool decode_kind(int code, int64_t K, Kind* out) {
    const int format = code & 7, sub_shift = (code & 8) ? 4 : 5, bias = (code >> 4) & 15;
    const bool kscales = (code >> 8) & 1, q8 = (code >> 9) & 1, six = (code >> 10) & 1;
    if (code < 0 || code >> 11 || format > kF32 || (bias && format != kNib) || K % kBlock || K < 0) return false;
    if (kscales && (format == kF32 || K % kSuper)) return false;
    if (q8 && format == kF32) return false;  // float weights have no integer quants
    if (six && (!q8 || format != kByte)) return false;
    *out = Kind{format, sub_shift, bias, kscales, q8, six};
    return true;
}

#ifdef KVM_AVX2
using ivec = __m256i;
inline ivec iset1(int x) { return _mm256_set1_epi32(x); }
inline vec nib_lo(ivec b, ivec bias) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)), bias)); }
inline vec nib_hi(ivec b, ivec bias) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), bias)); }
inline ivec load_u8(const uint8_t* p) { return u8x8(p); }
inline vec load_i8(const uint8_t* p) { return to_float(i8x8(reinterpret_cast<const int8_t*>(p))); }
inline vec vneg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
#else
using ivec = __m512i;
inline ivec iset1(int x) { return _mm512_set1_epi32(x); }
inline vec nib_lo(ivec b, ivec bias) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)), bias)); }
inline vec nib_hi(ivec b, ivec bias) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), bias)); }
inline ivec load_u8(const uint8_t* p) { return u8x16(p); }
inline vec load_i8(const uint8_t* p) { return to_float(i8x16(reinterpret_cast<const int8_t*>(p))); }
inline vec vneg(vec a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
#endif

// The scale (and minimum) of sub-block b of one panel, lanes [v * kLanes, (v + 1) * kLanes); d and m
// start at the panel's own (with K-quant scales d holds all of them and m is unused).
template <int F, bool KS>
__attribute__((always_inline)) inline void scales(const Kind& kd, const uint8_t* d, const uint8_t* m, int64_t b, int v,
                                                  vec& dv, vec& mv) {
    if constexpr (KS) {
        const int64_t nsub = kd.subs_per_super(), sb = b / nsub, j = b % nsub;
        const uint8_t* base = d + sb * kd.super_bytes();
        const int64_t ints = has_min(F) ? 2 * kPanel * 4 : kPanel * 4;  // the int8 scales follow D (and DMIN)
        dv = vmul(vload(reinterpret_cast<const float*>(base) + v * kLanes), load_i8(base + ints + j * kPanel + v * kLanes));
        if constexpr (has_min(F))
            mv = vneg(vmul(vload(reinterpret_cast<const float*>(base + kPanel * 4) + v * kLanes),
                           load_i8(base + ints + (nsub + j) * kPanel + v * kLanes)));
    } else {
        dv = vload(reinterpret_cast<const float*>(d) + b * kPanel + v * kLanes);
        if constexpr (has_min(F)) mv = vload(reinterpret_cast<const float*>(m) + b * kPanel + v * kLanes);
    }
}

// The weights of k and k + 1 (k even, in one sub-block whose scale is dv, minimum mv) for the lanes
// [v * kLanes, (v + 1) * kLanes) of one panel whose q starts at q. Every path (expand_panel,
// row_panels) expands a weight with this code.
template <int F>
__attribute__((always_inline)) inline void weights2(const uint8_t* q, int64_t k, int v, ivec bias, vec dv, vec mv,
                                                    vec& w0, vec& w1) {
    if constexpr (F == kF32) {
        const float* f = reinterpret_cast<const float*>(q);
        w0 = vload(f + k * kPanel + v * kLanes);
        w1 = vload(f + (k + 1) * kPanel + v * kLanes);
    } else {
        vec q0, q1;
        if constexpr (nibbles(F)) {
            const ivec b = load_u8(q + (k / 2) * kPanel + v * kLanes);
            if constexpr (F == kNib) {
                q0 = nib_lo(b, bias);
                q1 = nib_hi(b, bias);
            } else {  // no bias: one integer operation less per weight
                q0 = low_nibbles(b);
                q1 = high_nibbles(b);
            }
        } else {
            q0 = load_i8(q + k * kPanel + v * kLanes);
            q1 = load_i8(q + (k + 1) * kPanel + v * kLanes);
        }
        if constexpr (has_min(F)) {
            w0 = vfmadd(q0, dv, mv);
            w1 = vfmadd(q1, dv, mv);
        } else {
            w0 = vmul(q0, dv);
            w1 = vmul(q1, dv);
        }
    }
}

// Expand k in [k0, k1) of one panel (16 output features) into w[(k1 - k0)][16] float32; k0 and k1 are
// whole sub-blocks (slices start at multiples of 256).
template <int F, bool KS>
void expand_panel_t(const Kind& kd, const uint8_t* q, const uint8_t* d, const uint8_t* m, int64_t k0, int64_t k1,
                    float* w) {
    const ivec bias = iset1(kd.bias);
    w -= k0 * kPanel;  // w[k] for k in the slice's own range
    const int64_t sub = F == kF32 ? k1 - k0 : int64_t(1) << kd.sub_shift;
    for (int64_t kb = k0; kb < k1; kb += sub) {
        vec dv[kVecs], mv[kVecs];
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) {
            dv[v] = mv[v] = vzero();
            if constexpr (F != kF32) scales<F, KS>(kd, d, m, kb >> kd.sub_shift, v, dv[v], mv[v]);
        }
#pragma GCC unroll 4
        for (int64_t k = kb; k < kb + sub; k += 2) {
#pragma GCC unroll 2
            for (int v = 0; v < kVecs; ++v) {
                vec w0, w1;
                weights2<F>(q, k, v, bias, dv[v], mv[v], w0, w1);
                vstore(w + k * kPanel + v * kLanes, w0);
                vstore(w + (k + 1) * kPanel + v * kLanes, w1);
            }
        }
    }
}

void expand_panel(const Kind& kd, const uint8_t* q, const uint8_t* d, const uint8_t* m, int64_t k0, int64_t k1, float* w) {
    if (kd.kscales) {
        switch (kd.format) {
            case kNib: return expand_panel_t<kNib, true>(kd, q, d, m, k0, k1, w);
            case kNibMin: return expand_panel_t<kNibMin, true>(kd, q, d, m, k0, k1, w);
            case kByte: return expand_panel_t<kByte, true>(kd, q, d, m, k0, k1, w);
            default: return expand_panel_t<kByteMin, true>(kd, q, d, m, k0, k1, w);
        }
    }
    switch (kd.format) {
        case kNib: return expand_panel_t<kNib, false>(kd, q, d, m, k0, k1, w);
        case kNibMin: return expand_panel_t<kNibMin, false>(kd, q, d, m, k0, k1, w);
        case kByte: return expand_panel_t<kByte, false>(kd, q, d, m, k0, k1, w);
        case kByteMin: return expand_panel_t<kByteMin, false>(kd, q, d, m, k0, k1, w);
        default: return expand_panel_t<kF32, false>(kd, q, d, m, k0, k1, w);
    }
}

// R input rows x the panels of one tile, over kc consecutive k: y[r][0 .. kTileVecs * kLanes) =
// (accumulate ? y[r] : 0) + x[r] . w, one FMA per k and lane in k order (a float32 sum parked in y
// between k-slices and picked up again is the same sum). xt holds the R rows transposed ([kc][R])
// so the broadcasts stream; w holds the tile's panels expanded ([kTilePanels][kc][16]).
template <int R>
void tile(const float* xt, int64_t kc, const float* w, float* y, int64_t N, bool accumulate) {
    const float* wp[kTileVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) wp[v] = w + (v * kLanes / kPanel) * kc * kPanel + (v * kLanes) % kPanel;
    // Every loop over r and v is unrolled, so the accumulators live in registers.
    vec acc[R][kTileVecs];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kTileVecs; ++v) acc[r][v] = accumulate ? vload(y + r * N + v * kLanes) : vzero();
    for (int64_t k = 0; k < kc; ++k) {
        vec wv[kTileVecs];
#pragma GCC unroll 4
        for (int v = 0; v < kTileVecs; ++v) wv[v] = vload(wp[v] + k * kPanel);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const vec xb = vset1(xt[k * R + r]);
#pragma GCC unroll 4
            for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vfmadd(xb, wv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kTileVecs; ++v) vstore(y + r * N + v * kLanes, acc[r][v]);
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, bool);

template <std::size_t... I>
constexpr std::array<TileFn, sizeof...(I)> make_tiles(std::index_sequence<I...>) {
    return {&tile<static_cast<int>(I) + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_index_sequence<kMaxRows>{});  // kTiles[r - 1] = tile<r>

// The float32 weight [N, K] (N = P * 16) the blocks hold, expanded by the same code as `linear` uses.
bool dequantize(const Kind& kd, const uint8_t* qp, const uint8_t* dp, const uint8_t* mp, int64_t P, int64_t K, float* op,
                int threads) {
    const int64_t q_panel = kd.q_panel(K), s_panel = kd.s_panel(K);
    return parallel_for(threads, 0, P, 1, [&](int64_t p0, int64_t p1) {
        std::vector<float> w(K * kPanel);
        for (int64_t p = p0; p < p1; ++p) {
            expand_panel(kd, qp + p * q_panel, dp ? dp + p * s_panel : nullptr, mp ? mp + p * s_panel : nullptr, 0, K,
                         w.data());
            for (int64_t j = 0; j < kPanel; ++j)
                for (int64_t k = 0; k < K; ++k) op[(p * kPanel + j) * K + k] = w[k * kPanel + j];
        }
    });
}

// One row (a decode step): y [N] = x [K] . W.T. The tiled path below expands a slice of weights into
// scratch and reads it back for one FMA each, and with one row its single chain per vector waits on
// the FMA latency; here each weight is expanded in registers (weights2, the code the tiled path
// expands with) and used at once, and G panels (G * kVecs independent accumulators) are in flight
// together, a sub-block at a time (its scales taken once). Every output is the same sum as the tiled
// path's (acc = 0, then fma(x[k], w[n][k], acc) for k ascending), so a row has the same bits whichever
// path computes it.
#ifdef KVM_AVX2
constexpr int kRowPanels = 4;  // panels per group: 8 accumulators of 16 registers
#else
constexpr int kRowPanels = 8;  // panels per group: 8 accumulators of 32 registers
#endif

template <int F, bool KS, int G>
void row_panels(const Kind& kd, const float* x, const uint8_t* q, const uint8_t* d, const uint8_t* m, int64_t K,
                int64_t q_panel, int64_t s_panel, float* y) {
    const ivec bias = iset1(kd.bias);
    const int64_t sub = F == kF32 ? K : int64_t(1) << kd.sub_shift;
    vec acc[G][kVecs];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) acc[g][v] = vzero();
    for (int64_t kb = 0; kb < K; kb += sub) {
        vec dv[G][kVecs], mv[G][kVecs];
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
            for (int v = 0; v < kVecs; ++v) {
                dv[g][v] = mv[g][v] = vzero();
                // (d and m are null where the format has none: never offset then)
                if constexpr (F != kF32)
                    scales<F, KS>(kd, d + g * s_panel, has_min(F) && !KS ? m + g * s_panel : m, kb >> kd.sub_shift, v,
                                  dv[g][v], mv[g][v]);
            }
        for (int64_t k = kb; k < kb + sub; k += 2) {
            const vec x0 = vset1(x[k]), x1 = vset1(x[k + 1]);
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
                for (int v = 0; v < kVecs; ++v) {
                    vec w0, w1;
                    weights2<F>(q + g * q_panel, k, v, bias, dv[g][v], mv[g][v], w0, w1);
                    acc[g][v] = vfmadd(x0, w0, acc[g][v]);
                    acc[g][v] = vfmadd(x1, w1, acc[g][v]);
                }
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) vstore(y + g * kPanel + v * kLanes, acc[g][v]);
}

template <int F, bool KS>
bool row_linear_t(const Kind& kd, const float* xp, const uint8_t* qp, const uint8_t* dp, const uint8_t* mp, int64_t P,
                  int64_t K, float* yp, int threads) {
    const int64_t q_panel = kd.q_panel(K), s_panel = kd.s_panel(K);
    // Threads take consecutive panels (torch's split); each runs its panels in groups of kRowPanels.
    return parallel_for(threads, 0, P, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1;) {
            const int64_t left = p1 - p;
            const int G = left >= kRowPanels ? kRowPanels : left >= 2 ? 2 : 1;
            const uint8_t* q = qp + p * q_panel;
            const uint8_t* d = dp ? dp + p * s_panel : nullptr;
            const uint8_t* m = mp ? mp + p * s_panel : nullptr;
            float* y = yp + p * kPanel;
            if (G == kRowPanels) row_panels<F, KS, kRowPanels>(kd, xp, q, d, m, K, q_panel, s_panel, y);
            else if (G == 2) row_panels<F, KS, 2>(kd, xp, q, d, m, K, q_panel, s_panel, y);
            else row_panels<F, KS, 1>(kd, xp, q, d, m, K, q_panel, s_panel, y);
            p += G;
        }
    });
}

bool row_linear(const Kind& kd, const float* xp, const uint8_t* qp, const uint8_t* dp, const uint8_t* mp, int64_t P,
                int64_t K, float* yp, int threads) {
    if (kd.kscales) {
        switch (kd.format) {
            case kNib: return row_linear_t<kNib, true>(kd, xp, qp, dp, mp, P, K, yp, threads);
            case kNibMin: return row_linear_t<kNibMin, true>(kd, xp, qp, dp, mp, P, K, yp, threads);
            case kByte: return row_linear_t<kByte, true>(kd, xp, qp, dp, mp, P, K, yp, threads);
            default: return row_linear_t<kByteMin, true>(kd, xp, qp, dp, mp, P, K, yp, threads);
        }
    }
    switch (kd.format) {
        case kNib: return row_linear_t<kNib, false>(kd, xp, qp, dp, mp, P, K, yp, threads);
        case kNibMin: return row_linear_t<kNibMin, false>(kd, xp, qp, dp, mp, P, K, yp, threads);
        case kByte: return row_linear_t<kByte, false>(kd, xp, qp, dp, mp, P, K, yp, threads);
        case kByteMin: return row_linear_t<kByteMin, false>(kd, xp, qp, dp, mp, P, K, yp, threads);
        default: return row_linear_t<kF32, false>(kd, xp, qp, dp, mp, P, K, yp, threads);
    }
}

// ---- q8: integer dot products with 8-bit activations (q8_dot.h says what is computed) ----
#define KVM_Q8_NS q8_plain
#include "q8_dot.h"
#undef KVM_Q8_NS
#ifndef KVM_AVX2
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#define KVM_Q8_VNNI
#define KVM_Q8_NS q8_vnni
#include "q8_dot.h"
#undef KVM_Q8_NS
#undef KVM_Q8_VNNI
#pragma GCC pop_options
// vpdpbusd where the CPU has it (chosen once; kvm_qlinear_q8_vnni can turn it off to test the other path:
// both give the same integers, so the same bits)
bool cpu_has_vnni() {
    __builtin_cpu_init();  // a static initializer may run before libgcc's own
    return __builtin_cpu_supports("avx512vnni");
}
int g_q8_vnni = cpu_has_vnni() ? 1 : 0;
#else
int g_q8_vnni = 0;
#endif

constexpr int64_t kQ8RowGroup = 64;  // rows per work item: their quantized activations stay in L1 / L2
constexpr int64_t kQ8PanelGroup = 4;  // panels per work item

// Each row's activations quantized per block of 32 (q8_dot.h): xq [M, K] int8, dx [M, K/32], xs [M, K/16].
struct Q8Rows {
    std::vector<int8_t> xq;
    std::vector<float> dx;
    std::vector<int32_t> xs;
};

// One block of 32 activations: xq, its dx and its two halves' sums. Eight lanes at a time (AVX2, also in
// the AVX-512 build), the very IEEE operations of the formulas in q8_dot.h: a max is exact in any order,
// x * id is one rounded product, the rounding is to nearest even, and the clamps take a NaN product (an
// infinite x with id = 0) to -127 as std::max(-127.f, v) then std::min(127.f, .) would.
inline void quantize_block(const float* xb, int8_t* qb, float* dx, int32_t* xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, v[i]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for NaN and infinities
        amax = _mm256_max_ps(amax, a);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const bool ok = finite == 0xFF;
    const float d = ok ? _mm_cvtss_f32(m4) / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const __m256 id = _mm256_set1_ps(ok && d != 0.0f ? 1.0f / d : 0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        n[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  // max(NaN, lo) is lo
    }
    for (int h = 0; h < 2; ++h) {
        const __m256i s8 = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        xs[h] = _mm_cvtsi128_si32(s4);
    }
    // int32 -> int8 in order: the packs work per 128-bit lane, the permute puts the lanes back in order
    const __m256i p16 = _mm256_packs_epi32(n[0], n[1]), q16 = _mm256_packs_epi32(n[2], n[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, q16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p8);
    *dx = d;
}

bool quantize_rows(const float* x, int64_t M, int64_t K, Q8Rows& out, int threads) {
    out.xq.resize(M * K);
    out.dx.resize(M * K / 32);
    out.xs.resize(M * K / 16);
    return parallel_for(threads, 0, M, 1, [&](int64_t m0, int64_t m1) {
        for (int64_t r = m0; r < m1; ++r)
            for (int64_t b = 0; b < K / 32; ++b)
                quantize_block(x + r * K + b * 32, out.xq.data() + r * K + b * 32, out.dx.data() + r * K / 32 + b,
                               out.xs.data() + r * K / 16 + b * 2);
    });
}

bool q8_linear(const Kind& kd, const float* xp, int64_t M, const uint8_t* qp, const uint8_t* dp, const uint8_t* mp,
               int64_t P, int64_t K, float* yp, int threads) {
    if (M == 0) return true;
    Q8Rows rows;
    if (!quantize_rows(xp, M, K, rows, threads)) return false;
    std::vector<const int8_t*> xq(M);
    std::vector<const float*> dx(M);
    std::vector<const int32_t*> xs(M);
    for (int64_t r = 0; r < M; ++r) {
        xq[r] = rows.xq.data() + r * K;
        dx[r] = rows.dx.data() + r * K / 32;
        xs[r] = rows.xs.data() + r * K / 16;
    }
#ifndef KVM_AVX2
    const auto fn = g_q8_vnni ? q8_vnni::rows_panels_fn(kd) : q8_plain::rows_panels_fn(kd);
#else
    const auto fn = q8_plain::rows_panels_fn(kd);
#endif
    const int64_t N = P * kPanel, q_panel = kd.q_panel(K), s_panel = kd.s_panel(K);
    const int64_t groups = (M + kQ8RowGroup - 1) / kQ8RowGroup;
    const int64_t pgroups = (P + kQ8PanelGroup - 1) / kQ8PanelGroup;
    // Work items (row group, group of panels), panels consecutive per thread; which thread computes one
    // moves no bit.
    return parallel_for(threads, 0, groups * pgroups, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float*> y(kQ8RowGroup);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t g = i / pgroups, p = (i % pgroups) * kQ8PanelGroup, r0 = g * kQ8RowGroup;
            const int64_t R = std::min(kQ8RowGroup, M - r0), panels = std::min(kQ8PanelGroup, P - p);
            for (int64_t r = 0; r < R; ++r) y[r] = yp + (r0 + r) * N + p * kPanel;
            fn(kd, R, xq.data() + r0, dx.data() + r0, xs.data() + r0, qp + p * q_panel, dp ? dp + p * s_panel : nullptr,
               mp ? mp + p * s_panel : nullptr, q_panel, s_panel, K, panels, y.data());
        }
    });
}

// y [M, N] = x [M, K] . W.T, W held as the blocks (N = P * 16).
bool linear(const Kind& kd, const float* xp, int64_t M, const uint8_t* qp, const uint8_t* dp, const uint8_t* mp, int64_t P,
            int64_t K, float* yp, int threads) {
    const int64_t N = P * kPanel;
    if (kd.q8) return q8_linear(kd, xp, M, qp, dp, mp, P, K, yp, threads);
    if (M == 0) return true;
    if (M == 1) return row_linear(kd, xp, qp, dp, mp, P, K, yp, threads);
    const int64_t q_panel = kd.q_panel(K), s_panel = kd.s_panel(K);
    // Rows in tiles of at most kMaxRows, as even as possible (16 rows: 8 + 8 on AVX-512), each tile
    // transposed once so that its broadcasts stream. Tiling moves no bit: each output's sum is fixed.
    const int64_t n_tiles = (M + kMaxRows - 1) / kMaxRows;
    std::vector<int64_t> start(n_tiles + 1);
    for (int64_t t = 0; t <= n_tiles; ++t) start[t] = t * M / n_tiles;
    std::vector<float> xt(M * K);
    const bool transposed = parallel_for(threads, 0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t r0 = start[t], R = start[t + 1] - r0;
            for (int64_t r = 0; r < R; ++r)
                for (int64_t k = 0; k < K; ++k) xt[r0 * K + k * R + r] = xp[(r0 + r) * K + k];
        }
    });
    if (!transposed) return false;
    // Work items: (group of tiles, group of panels). A group's panels are expanded once per tile
    // group, whose rows stay in L2 while the panels stream by. Which thread computes an item
    // changes no bit.
    const int64_t groups = (P + kTilePanels - 1) / kTilePanels;
    const int64_t tile_groups = (n_tiles + kTilesPerItem - 1) / kTilesPerItem;
    return parallel_for(threads, 0, tile_groups * groups, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w(kTilePanels * kSliceK * kPanel, 0.0f);
        std::vector<float> part(kTilesPerItem * kMaxRows * kTileVecs * kLanes);  // an odd last panel's tiles
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t tg = i / groups, g = i % groups, p0 = g * kTilePanels;
            const int64_t panels = std::min<int64_t>(kTilePanels, P - p0);
            const int64_t t0 = tg * kTilesPerItem, t1 = std::min(n_tiles, (tg + 1) * kTilesPerItem);
            // k in slices: a slice of the panels is expanded into L1 and used by every tile of the group
            for (int64_t k0 = 0; k0 < K; k0 += kSliceK) {
                const int64_t k1 = std::min(K, k0 + kSliceK), kc = k1 - k0;
                for (int64_t j = 0; j < panels; ++j)
                    expand_panel(kd, qp + (p0 + j) * q_panel, dp ? dp + (p0 + j) * s_panel : nullptr,
                                 mp ? mp + (p0 + j) * s_panel : nullptr, k0, k1, w.data() + j * kc * kPanel);
                for (int64_t t = t0; t < t1; ++t) {
                    const int64_t r0 = start[t], R = start[t + 1] - r0;
                    const float* xs = xt.data() + r0 * K + k0 * R;
                    if (panels == kTilePanels)
                        kTiles[R - 1](xs, kc, w.data(), yp + r0 * N + p0 * kPanel, N, k0 > 0);
                    else  // an odd last panel (AVX-512): its tiles run into scratch, their own columns kept below
                        kTiles[R - 1](xs, kc, w.data(), part.data() + (t - t0) * kMaxRows * kTileVecs * kLanes,
                                      kTileVecs * kLanes, k0 > 0);
                }
            }
            if (panels < kTilePanels)
                for (int64_t t = t0; t < t1; ++t)
                    for (int64_t r = 0; r < start[t + 1] - start[t]; ++r)
                        std::memcpy(yp + (start[t] + r) * N + p0 * kPanel,
                                    part.data() + ((t - t0) * kMaxRows + r) * kTileVecs * kLanes, sizeof(float) * kPanel);
        }
    });
}

}  // namespace

// The library is built with -fvisibility=hidden: only these entry points are exported.
#pragma GCC visibility push(default)
extern "C" {

// The version of the calling convention below; quantized_linear.py refuses a library of another.
int kvm_qlinear_abi_version() { return 4; }

// Whether the q8 kind uses AVX-512 VNNI's vpdpbusd: `want` 0 turns it off, 1 on where the CPU has it, -1
// asks. Both paths give the same integers (tests/test_q8_linear.py compares them).
int kvm_qlinear_q8_vnni(int want) {
#ifndef KVM_AVX2
    if (want == 0) g_q8_vnni = 0;
    if (want == 1) g_q8_vnni = cpu_has_vnni() ? 1 : 0;
#else
    (void)want;
#endif
    return g_q8_vnni;
}

// Returns 0 when done, -2 for sizes that are not whole panels and blocks, a kind that is not one of
// the formats above or misses its d or m, -1 when a thread failed (out of memory). Python checks the
// tensors against the layouts (quantized_linear.py): q [P, K/2 | K | K * 4 bytes, 16], d and m
// [P, K/sub, 16] float32 (m null without a minimum, d null for F32), or with K-quant scales d
// [P, K/256, super-block bytes] uint8 and m null; x [M, K] and the outputs float32, all contiguous.
static bool args_ok(int kind, const void* q, const void* d, const void* m, int64_t P, int64_t K, Kind* kd) {
    if (!decode_kind(kind, K, kd) || P < 0 || q == nullptr) return false;
    if (kd->format != kF32 && d == nullptr) return false;
    return !(has_min(kd->format) && !kd->kscales && m == nullptr);
}

static const uint8_t* d_of(const Kind& kd, const void* d) {
    return kd.format == kF32 ? nullptr : static_cast<const uint8_t*>(d);
}
static const uint8_t* m_of(const Kind& kd, const void* m) {
    return has_min(kd.format) && !kd.kscales ? static_cast<const uint8_t*>(m) : nullptr;
}

int kvm_qlinear_dequantize(int kind, const void* q, const void* d, const void* m, int64_t P, int64_t K, float* out,
                           int threads) {
    Kind kd;
    if (!args_ok(kind, q, d, m, P, K, &kd) || kd.q8) return -2;  // q8 panels hold no float weights to expand
    try {
        return dequantize(kd, static_cast<const uint8_t*>(q), d_of(kd, d), m_of(kd, m), P, K, out, threads) ? 0 : -1;
    } catch (...) {
        return -1;
    }
}

int kvm_qlinear_linear(int kind, const float* x, int64_t M, const void* q, const void* d, const void* m, int64_t P,
                       int64_t K, float* y, int threads) {
    Kind kd;
    if (!args_ok(kind, q, d, m, P, K, &kd) || M < 0) return -2;
    try {
        return linear(kd, x, M, static_cast<const uint8_t*>(q), d_of(kd, d), m_of(kd, m), P, K, y, threads) ? 0 : -1;
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
#pragma GCC visibility pop
