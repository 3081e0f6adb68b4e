// Linear layers computed straight from a GGUF file's quantized blocks (Q4_1, Q8_0), float32 math.
//
// A graft's step is 16 new tokens (1 while decoding): every linear weight is read once per step for
// few rows, so the step streams the weights. Read as float32 they are 540 MB for SmolLM2-135M; read
// as the GGUF's own blocks (what llama.cpp computes from) they are ~110 MB in this layout. Here the
// panels of a tile (32 output features on AVX-512, 16 on AVX2) are expanded to float32 a slice of
// 256 k at a time into an L1-resident scratch, which every row tile then multiplies.
//
// Exact weights: a weight is expanded exactly as gguf-py expands it for transformers (the float32
// weights the model holds): Q4_1 `float32(d) * q` then `+ float32(m)`, Q8_0 `float32(d) * q`. d is a
// float16 value (11 significant bits; gguf_linear.py refuses other d) and q has at most 8 bits, so
// d * q is exact in float32: Q8_0's product has nothing to round, and Q4_1's two roundings are one,
// the add's, which is what one FMA `fma(q, d, m)` computes (one instruction instead of two; the build
// has -ffp-contract=off, so only these explicit FMAs fuse). `dequantize` returns the weights, and
// the loader checks they equal the model's weights byte for byte before using a layer.
//
// Fixed order of sums: output (m, n) is `fma(x[m][k], w[n][k], acc)` for k = 0, 1, ..., K-1 from
// acc = 0, one SIMD lane per n. The order depends on nothing else: not on the number of rows, the
// row's place among them, the thread count, nor the vector width. So the AVX-512 and AVX2 builds give
// the same bits, and a row gives the same bits computed alone or among thousands (batch-invariant).
//
// Layouts (N output features, K input features; N % 16 == 0, K % 32 == 0; 16 = one panel):
//   x     [M, K] float32, contiguous                 y [M, N] float32, contiguous (returned)
//   Q4_1  q [N/16, K/2, 16] uint8: byte (p, t, j) = q(16p+j, 2t) | q(16p+j, 2t+1) << 4
//         d, m [N/16, K/32, 16] float32: block scale and minimum of row 16p+j, k-block b
//   Q8_0  q [N/16, K, 16] int8: q(16p+j, k);  d [N/16, K/32, 16] float32;  m: an empty tensor
//
// Plain C entry points over raw pointers (no torch headers: the library does not depend on torch's
// C++ ABI); gguf_linear.py checks the tensors against these layouts, allocates the outputs and passes
// pointers, sizes and torch's thread count. Threads are OpenMP's, torch's own libgomp (parallel.h).

#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace kvm;  // vec, kLanes, vload ... (simd.h); parallel_for (parallel.h)

constexpr int kPanel = 16;    // output features per panel
constexpr int kBlock = 32;    // weights per GGUF block (Q4_1, Q8_0)
constexpr int64_t kTilesPerItem = 16;  // row tiles per work item of a long prefill: their rows stay in L2
constexpr int64_t kSliceBlocks = 8;    // k per slice / 32: a slice of a tile's panels (<= 32 KB) stays in L1

enum Kind { kQ4_1 = 0, kQ8_0 = 1 };

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

// Expand blocks [b0, b1) of one panel (16 output features) into w[(b1 - b0) * 32][16] float32.
void expand_panel(int kind, const uint8_t* q, const float* d, const float* m, int64_t b0, int64_t b1, float* w) {
    w -= b0 * kBlock * kPanel;  // w[k] for k in the blocks' own range
    for (int64_t b = b0; b < b1; ++b) {
        // the block's scales (and minima) for the panel's 16 rows, then its 32 k: a k's 16 weights are
        // one 64-byte row of w, written whole
        vec dv[kVecs], mv[kVecs];
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) {
            dv[v] = vload(d + b * kPanel + v * kLanes);
            mv[v] = kind == kQ4_1 ? vload(m + b * kPanel + v * kLanes) : vzero();
        }
        if (kind == kQ4_1) {
#pragma GCC unroll 4
            for (int t = 0; t < kBlock / 2; ++t) {
                const int64_t k = b * kBlock + 2 * t;
#pragma GCC unroll 2
                for (int v = 0; v < kVecs; ++v) {
#ifdef KVM_AVX2
                    const auto bytes = u8x8(q + (b * (kBlock / 2) + t) * kPanel + v * kLanes);
#else
                    const auto bytes = u8x16(q + (b * (kBlock / 2) + t) * kPanel);
#endif
                    vstore(w + k * kPanel + v * kLanes, vfmadd(low_nibbles(bytes), dv[v], mv[v]));
                    vstore(w + (k + 1) * kPanel + v * kLanes, vfmadd(high_nibbles(bytes), dv[v], mv[v]));
                }
            }
        } else {
            const int8_t* qs = reinterpret_cast<const int8_t*>(q);
#pragma GCC unroll 4
            for (int t = 0; t < kBlock; ++t) {
                const int64_t k = b * kBlock + t;
#pragma GCC unroll 2
                for (int v = 0; v < kVecs; ++v) {
#ifdef KVM_AVX2
                    const auto vals = i8x8(qs + k * kPanel + v * kLanes);
#else
                    const auto vals = i8x16(qs + k * kPanel);
#endif
                    vstore(w + k * kPanel + v * kLanes, vmul(to_float(vals), dv[v]));
                }
            }
        }
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
bool dequantize(int kind, const uint8_t* qp, const float* dp, const float* mp, int64_t P, int64_t K, float* op,
                int threads) {
    const int64_t q_panel = (kind == kQ4_1 ? K / 2 : K) * kPanel, s_panel = (K / kBlock) * kPanel;
    return parallel_for(threads, 0, P, 1, [&](int64_t p0, int64_t p1) {
        std::vector<float> w(K * kPanel);
        for (int64_t p = p0; p < p1; ++p) {
            expand_panel(kind, qp + p * q_panel, dp + p * s_panel, mp ? mp + p * s_panel : nullptr, 0, K / kBlock,
                         w.data());
            for (int64_t j = 0; j < kPanel; ++j)
                for (int64_t k = 0; k < K; ++k) op[(p * kPanel + j) * K + k] = w[k * kPanel + j];
        }
    });
}

// One row (a decode step): y [N] = x [K] . W.T. The tiled path below expands a slice of weights into
// scratch and reads it back for one FMA each, and with one row its single chain per vector waits on
// the FMA latency; here each weight is expanded in registers and used at once, and G panels
// (G * kVecs independent accumulators) are in flight together. Every output is the same sum as the
// tiled path's (acc = 0, then fma(x[k], w[n][k], acc) for k ascending; w expanded by the same
// operations as expand_panel), so a row has the same bits whichever path computes it.
#ifdef KVM_AVX2
constexpr int kRowPanels = 4;  // panels per group: 8 accumulators of 16 registers
#else
constexpr int kRowPanels = 8;  // panels per group: 8 accumulators of 32 registers
#endif

template <int G>
void row_panels(int kind, const float* x, const uint8_t* q, const float* d, const float* m, int64_t K,
                int64_t q_panel, int64_t s_panel, float* y) {
    vec acc[G][kVecs];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) acc[g][v] = vzero();
    for (int64_t b = 0; b < K / kBlock; ++b) {
        if (kind == kQ4_1) {
            for (int t = 0; t < kBlock / 2; ++t) {
                const int64_t k = b * kBlock + 2 * t;
                const vec x0 = vset1(x[k]), x1 = vset1(x[k + 1]);
#pragma GCC unroll 16
                for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
                    for (int v = 0; v < kVecs; ++v) {
                        const vec dv = vload(d + g * s_panel + b * kPanel + v * kLanes);
                        const vec mv = vload(m + g * s_panel + b * kPanel + v * kLanes);
#ifdef KVM_AVX2
                        const auto bytes = u8x8(q + g * q_panel + (k / 2) * kPanel + v * kLanes);
#else
                        const auto bytes = u8x16(q + g * q_panel + (k / 2) * kPanel);
#endif
                        acc[g][v] = vfmadd(x0, vfmadd(low_nibbles(bytes), dv, mv), acc[g][v]);
                        acc[g][v] = vfmadd(x1, vfmadd(high_nibbles(bytes), dv, mv), acc[g][v]);
                    }
            }
        } else {
            const int8_t* qs = reinterpret_cast<const int8_t*>(q);
            for (int t = 0; t < kBlock; ++t) {
                const int64_t k = b * kBlock + t;
                const vec xk = vset1(x[k]);
#pragma GCC unroll 16
                for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
                    for (int v = 0; v < kVecs; ++v) {
                        const vec dv = vload(d + g * s_panel + b * kPanel + v * kLanes);
#ifdef KVM_AVX2
                        const auto vals = i8x8(qs + g * q_panel + k * kPanel + v * kLanes);
#else
                        const auto vals = i8x16(qs + g * q_panel + k * kPanel);
#endif
                        acc[g][v] = vfmadd(xk, vmul(to_float(vals), dv), acc[g][v]);
                    }
            }
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) vstore(y + g * kPanel + v * kLanes, acc[g][v]);
}

bool row_linear(int kind, const float* xp, const uint8_t* qp, const float* dp, const float* mp, int64_t P, int64_t K,
                float* yp, int threads) {
    const int64_t q_panel = (kind == kQ4_1 ? K / 2 : K) * kPanel, s_panel = (K / kBlock) * kPanel;
    // Threads take consecutive panels (torch's split); each runs its panels in groups of kRowPanels.
    return parallel_for(threads, 0, P, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1;) {
            const int64_t left = p1 - p;
            const int G = left >= kRowPanels ? kRowPanels : left >= 2 ? 2 : 1;
            const uint8_t* q = qp + p * q_panel;
            const float* d = dp + p * s_panel;
            const float* m = mp ? mp + p * s_panel : nullptr;
            float* y = yp + p * kPanel;
            if (G == kRowPanels) row_panels<kRowPanels>(kind, xp, q, d, m, K, q_panel, s_panel, y);
            else if (G == 2) row_panels<2>(kind, xp, q, d, m, K, q_panel, s_panel, y);
            else row_panels<1>(kind, xp, q, d, m, K, q_panel, s_panel, y);
            p += G;
        }
    });
}

// y [M, N] = x [M, K] . W.T, W held as the blocks (N = P * 16).
bool linear(int kind, const float* xp, int64_t M, const uint8_t* qp, const float* dp, const float* mp, int64_t P,
            int64_t K, float* yp, int threads) {
    const int64_t N = P * kPanel;
    if (M == 0) return true;
    if (M == 1) return row_linear(kind, xp, qp, dp, mp, P, K, yp, threads);
    const int64_t q_panel = (kind == kQ4_1 ? K / 2 : K) * kPanel, s_panel = (K / kBlock) * kPanel;
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
        std::vector<float> w(kTilePanels * kSliceBlocks * kBlock * kPanel, 0.0f);
        std::vector<float> part(kTilesPerItem * kMaxRows * kTileVecs * kLanes);  // an odd last panel's tiles
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t tg = i / groups, g = i % groups, p0 = g * kTilePanels;
            const int64_t panels = std::min<int64_t>(kTilePanels, P - p0);
            const int64_t t0 = tg * kTilesPerItem, t1 = std::min(n_tiles, (tg + 1) * kTilesPerItem);
            // k in slices: a slice of the panels is expanded into L1 and used by every tile of the group
            for (int64_t b0 = 0; b0 < K / kBlock; b0 += kSliceBlocks) {
                const int64_t b1 = std::min(K / kBlock, b0 + kSliceBlocks), k0 = b0 * kBlock, kc = (b1 - b0) * kBlock;
                for (int64_t j = 0; j < panels; ++j)
                    expand_panel(kind, qp + (p0 + j) * q_panel, dp + (p0 + j) * s_panel,
                                 mp ? mp + (p0 + j) * s_panel : nullptr, b0, b1, w.data() + j * kc * kPanel);
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

// The version of the calling convention below; gguf_linear.py refuses a library of another.
int kvm_qlinear_abi_version() { return 1; }

// Returns 0 when done, -2 for sizes that are not whole panels and blocks or a kind that is neither
// Q4_1 (0) nor Q8_0 (1), -1 when a thread failed (out of memory). Python checks the tensors: q
// [P, K/2 (Q4_1) or K (Q8_0), 16] uint8 / int8, d and m [P, K/32, 16] float32 (m null for Q8_0),
// x [M, K] and the outputs float32, all contiguous.
int kvm_qlinear_dequantize(int kind, const void* q, const float* d, const float* m, int64_t P, int64_t K, float* out,
                           int threads) {
    if ((kind != kQ4_1 && kind != kQ8_0) || K % kBlock || P < 0 || (kind == kQ4_1 && m == nullptr)) return -2;
    try {
        return dequantize(kind, static_cast<const uint8_t*>(q), d, kind == kQ4_1 ? m : nullptr, P, K, out, threads)
                   ? 0 : -1;
    } catch (...) {
        return -1;
    }
}

int kvm_qlinear_linear(int kind, const float* x, int64_t M, const void* q, const float* d, const float* m, int64_t P,
                       int64_t K, float* y, int threads) {
    if ((kind != kQ4_1 && kind != kQ8_0) || K % kBlock || P < 0 || M < 0 || (kind == kQ4_1 && m == nullptr))
        return -2;
    try {
        return linear(kind, x, M, static_cast<const uint8_t*>(q), d, kind == kQ4_1 ? m : nullptr, P, K, y, threads)
                   ? 0 : -1;
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
#pragma GCC visibility pop
