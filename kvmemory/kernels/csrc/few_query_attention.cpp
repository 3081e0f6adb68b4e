// Attention for a few query rows over a long K/V cache on AVX-512 and AVX2 CPUs (float32 and bfloat16).
//
// The shape a graft's step has: T <= 16 new tokens (or 1 while decoding) against S = thousands of
// cached positions, grouped-query heads. torch's CPU flash attention splits such a call by query
// head only (9 items for SmolLM2 on 2 cores) and runs at a third to a half of the machine's float32
// FMA rate. Here the G = H_q / H_kv query heads that share a K/V head are folded into R = G * T rows,
// the keys are cut into near-equal units of at most kUnitKeys, and each (K/V head, unit) is one work
// item: scores for all R rows (rows in the SIMD lanes), a softmax over the unit, then P @ V. (A decode
// step under float32 queries, R <= 4, has keys in the lanes instead: `run_unit_few` below.) Units are merged per K/V
// head with their maxima and sums (log-sum-exp), in unit order. Within a unit, P @ V runs over
// kPvKeys keys at a time (their V rows and weights stay in L1; the partial sums go through the
// output unchanged), and the rows the unit reads later (its V, the next unit's K) are prefetched
// while the scores compute: neither changes a bit, both only the time (AVX2: 4-10 % at 8k keys over
// a bfloat16 cache, 20-30 % over a float32 one; AVX-512: 0-9 %; Zen 4).
//
// One source, two builds (kernels/native.py picks the one the CPU runs): AVX-512 (16 lanes, 32
// vector registers) by default, AVX2 + FMA (8 lanes, 16 registers) with -DKVM_AVX2. The few vector
// operations the kernel needs are written once per build (simd.h, and below: `vec` ...), the rest (exp, tiles,
// softmax) once on top of them; the tiles are sized to each build's register file. The two builds do not give the same bits (another exp, other tiles),
// and need not: the CPU's ISA is part of the execution profile.
//
// Determinism: the units are fixed by S and H_kv alone and each runs in one thread, so the bytes do not
// depend on the thread count or on scheduling. Accumulation is float32 for both dtypes: bfloat16
// scores by AVX512-BF16's VDPBF16PS on pairs of dimensions where the CPU has it (widened otherwise:
// the CPU model is in the profile), V widened and P kept float32; the output is rounded once.
//
// Layouts (elements; the last dimension contiguous):
//   q    [1, H_q, T, D]     D a multiple of 16 up to 128; any strides for heads and rows (transformers
//                           passes a transposed view); H_q / H_kv * T <= 128 rows per K/V head
//   k, v [1, H_kv, S, D]    views of the reserved cache buffers: any head / row strides; q's dtype,
//                           or bfloat16 under float32 queries (a bfloat16 KV cache: rows widened exactly)
//   mask [1, 1, T, S] bool or none: row t must be a prefix of trues (keys [0, n_t) visible);
//        anything else is refused (an undefined tensor is returned and the caller uses SDPA)
//   out  [1, T, H_q, D]     contiguous: what transformers' attention functions return
//
// A plain C entry point over raw pointers (no torch headers: the library does not depend on torch's
// C++ ABI); few_query_attention.py checks the tensors, allocates the output and passes pointers,
// sizes, strides and torch's thread count. Threads are OpenMP's, torch's own libgomp (parallel.h).

#include <immintrin.h>

#include "bfloat16.h"
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace kvm;  // vec, kLanes, vload ... (simd.h); bf16 (bfloat16.h); parallel_for (parallel.h)

constexpr int64_t kUnitKeys = 512;  // keys per work item: scores + widened K stay in L2
constexpr int64_t kPvKeys = 64;     // keys per P @ V pass: their V rows and weights stay in L1 (28 KB at D = 64)
constexpr int kMaxRows = 128;       // rows per K/V head the kernel takes (Qwen2.5-1.5B's 6 heads x 16 tokens: 96)

#ifdef KVM_AVX2
// ---- AVX2 + FMA: 8 lanes, 16 registers ----
using ivec = __m256i;
constexpr int kQkBlocks = 2;   // row blocks per score tile: 2 x 6 accumulators + 2 rows + 1 key
constexpr int kPvCols = 2;     // column blocks per P @ V tile ...
constexpr int kPvAcc = 12;     // ... and accumulators: 6 rows x 2 columns + 2 V + 1 weight
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline ivec ivload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec ivset1(int32_t x) { return _mm256_set1_epi32(x); }
inline ivec vadd_i(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
// x where key index j < the lane's visible count, else `hidden`
inline vec hide_past(vec x, ivec j, ivec nvis, vec hidden) {
    return _mm256_blendv_ps(hidden, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(nvis, j)));
}
// x, with lanes equal to `what` replaced by `by`
inline vec replace_eq(vec x, vec what, vec by) { return _mm256_blendv_ps(x, by, _mm256_cmp_ps(x, what, _CMP_EQ_OQ)); }

inline vec vfnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y * 2^n for integral n >= -126 (exp_ps clamps its input so): 2^n built in the exponent bits
inline vec scale_pow2(vec y, vec n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
// y where x >= lo, else 0
inline vec zero_below(vec y, vec x, vec lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }

// kLanes bfloat16 values (raw bits) widened to float32
inline vec widen_bf16(const uint16_t* s) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Keys per score tile for NR row blocks: NR x KB accumulators + NR rows + 1 key within 16 registers.
constexpr int keys_per_tile(int NR) { return NR == 1 ? 12 : (NR == 2 ? 6 : 4); }
#else
// ---- AVX-512: 16 lanes, 32 registers ----
using ivec = __m512i;
constexpr int kQkBlocks = 4;   // every row block in one score tile
constexpr int kPvCols = 8;     // every column block in one P @ V tile ...
constexpr int kPvAcc = 24;     // ... with 24 / (D / 16) rows
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline ivec ivload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline ivec ivset1(int32_t x) { return _mm512_set1_epi32(x); }
inline ivec vadd_i(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline vec hide_past(vec x, ivec j, ivec nvis, vec hidden) {
    return _mm512_mask_mov_ps(x, _mm512_cmpge_epi32_mask(j, nvis), hidden);
}
inline vec replace_eq(vec x, vec what, vec by) { return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, what, _CMP_EQ_OQ), by); }

inline vec vfnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec scale_pow2(vec y, vec n) { return _mm512_scalef_ps(y, n); }
inline vec zero_below(vec y, vec x, vec lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }

inline vec widen_bf16(const uint16_t* s) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Keys per score tile for NR row blocks: NR x KB accumulators stay within the 32 vector registers.
constexpr int keys_per_tile(int NR) { return NR == 1 ? 12 : (NR == 2 ? 8 : (NR == 3 ? 6 : 4)); }
#endif

constexpr int kMaxRowBlocks = kMaxRows / kLanes;

inline vec exp_ps(vec x) {
    // Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, then 2^n.
    // Below -87.3 (where float32 leaves the normal range) the result is 0.
    const vec lo = vset1(-87.3f);
    const vec xc = vmax(x, lo);
    const vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
    vec r = vfnmadd(n, vset1(0.693359375f), xc);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vec y = vset1(1.9875691500E-4f);
    y = vfmadd(y, r, vset1(1.3981999507E-3f));
    y = vfmadd(y, r, vset1(8.3334519073E-3f));
    y = vfmadd(y, r, vset1(4.1665795894E-2f));
    y = vfmadd(y, r, vset1(1.6666665459E-1f));
    y = vfmadd(y, r, vset1(5.0000001201E-1f));
    y = vfmadd(y, vmul(r, r), vadd(r, vset1(1.0f)));
    return zero_below(scale_pow2(y, n), x, lo);
}

// A query element's bfloat16 bits: its own, or a float32's rounded (round_q).
inline uint16_t bf16_bits(bf16 v) { return v.x; }
inline uint16_t bf16_bits(float v) { return from_f32<bf16>(v).x; }

// Rows of K or V as float32: float32 rows are read in place, bfloat16 rows widened into `scratch`.
inline const float* rows_f32(const float* src, int64_t stride, int64_t n, int D, float*, int64_t& ld) {
    ld = stride;
    return src;
}
inline const float* rows_f32(const bf16* src, int64_t stride, int64_t n, int D, float* scratch, int64_t& ld) {
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(src + j * stride);
        float* d = scratch + j * D;
        for (int c = 0; c < D; c += kLanes) vstore(d + c, widen_bf16(s + c));
    }
    ld = D;
    return scratch;
}

// Rows a unit reads later (its own V, then the next unit's K), prefetched into L2 a few rows per
// score tile: the cache streams from memory, and with the hardware prefetcher alone the widening
// loads wait on it (a tenth of the AVX2 kernel's time at 8k keys). Prefetches change no value.
struct RowPrefetch {
    const char* row[2];
    int64_t stride[2], left[2];  // bytes between rows, rows still to fetch
    int64_t row_bytes = 0, per_step = 0;
    void step() {
        for (int64_t i = 0; i < per_step; ++i) {
            const int r = left[0] > 0 ? 0 : 1;
            if (left[r] <= 0) return;
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row[r] + b, _MM_HINT_T1);
            row[r] += stride[r];
            --left[r];
        }
    }
};

// St[j][r] = sum_d Qt[d][r] * K[j][d] for KB keys and NR row blocks (kLanes rows each).
template <int NR, int KB>
inline void qk_tile(const float* Qt, int64_t ldq, const float* K, int64_t ldk, int D, float* St, int64_t lds) {
    vec acc[KB][NR];
    for (int kk = 0; kk < KB; ++kk)
        for (int i = 0; i < NR; ++i) acc[kk][i] = vzero();
    for (int d = 0; d < D; ++d) {
        vec q[NR];
        for (int i = 0; i < NR; ++i) q[i] = vload(Qt + d * ldq + kLanes * i);
        for (int kk = 0; kk < KB; ++kk) {
            vec b = vset1(K[kk * ldk + d]);
            for (int i = 0; i < NR; ++i) acc[kk][i] = vfmadd(q[i], b, acc[kk][i]);
        }
    }
    for (int kk = 0; kk < KB; ++kk)
        for (int i = 0; i < NR; ++i) vstore(St + kk * lds + kLanes * i, acc[kk][i]);
}

template <int NR>
void qk_unit(const float* Qt, int64_t ldq, const float* K, int64_t ldk, int D, int64_t n, float* St, int64_t lds,
             RowPrefetch& pf) {
    constexpr int KB = keys_per_tile(NR);
    int64_t j = 0;
    for (; j + KB <= n; j += KB) {
        pf.step();
        qk_tile<NR, KB>(Qt, ldq, K + j * ldk, ldk, D, St + j * lds, lds);
    }
    for (; j < n; ++j) qk_tile<NR, 1>(Qt, ldq, K + j * ldk, ldk, D, St + j * lds, lds);
}

// Scores for `nb` row blocks, kQkBlocks at a time (each pass reads the unit's keys again, from L2).
void qk_rows(const float* Qt, int64_t ldq, const float* K, int64_t ldk, int D, int64_t n, float* St, int64_t lds,
             int nb, RowPrefetch& pf) {
    for (int b = 0; b < nb; b += kQkBlocks) {
        const float* Qb = Qt + kLanes * b;
        float* Sb = St + kLanes * b;
        switch (std::min(kQkBlocks, nb - b)) {
            case 1: qk_unit<1>(Qb, ldq, K, ldk, D, n, Sb, lds, pf); break;
            case 2: qk_unit<2>(Qb, ldq, K, ldk, D, n, Sb, lds, pf); break;
            case 3: qk_unit<3>(Qb, ldq, K, ldk, D, n, Sb, lds, pf); break;
            default: qk_unit<4>(Qb, ldq, K, ldk, D, n, Sb, lds, pf); break;
        }
    }
}

#ifndef KVM_AVX2
// bfloat16 with AVX512-BF16: St[j][r] = sum over pairs d2 of QP[d2][r] . K[j][2 d2 : 2 d2 + 2], one
// VDPBF16PS per pair (exact bfloat16 products, float32 sums): half the instructions of widening.
// The same tiling as qk_tile / qk_unit, written out again because these two carry the avx512bf16
// target (the AVX-512 build runs on CPUs without BF16 too, where they are not called).
template <int NR, int KB>
__attribute__((target("avx512bf16"))) inline void qk_tile_bf16(const uint32_t* QP, int64_t ldq, const uint32_t* K,
                                                               int64_t ldk, int D2, float* St, int64_t lds) {
    __m512 acc[KB][NR];
    for (int kk = 0; kk < KB; ++kk)
        for (int i = 0; i < NR; ++i) acc[kk][i] = _mm512_setzero_ps();
    for (int d = 0; d < D2; ++d) {
        __m512bh q[NR];
        for (int i = 0; i < NR; ++i) q[i] = (__m512bh)_mm512_loadu_si512(QP + d * ldq + 16 * i);
        for (int kk = 0; kk < KB; ++kk) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(K[kk * ldk + d]));
            for (int i = 0; i < NR; ++i) acc[kk][i] = _mm512_dpbf16_ps(acc[kk][i], q[i], b);
        }
    }
    for (int kk = 0; kk < KB; ++kk)
        for (int i = 0; i < NR; ++i) _mm512_storeu_ps(St + kk * lds + 16 * i, acc[kk][i]);
}

template <int NR>
__attribute__((target("avx512bf16"), noinline)) void qk_unit_bf16(const uint32_t* QP, int64_t ldq, const uint32_t* K,
                                                                  int64_t ldk, int D2, int64_t n, float* St,
                                                                  int64_t lds, RowPrefetch& pf) {
    constexpr int KB = keys_per_tile(NR);
    int64_t j = 0;
    for (; j + KB <= n; j += KB) {
        pf.step();
        qk_tile_bf16<NR, KB>(QP, ldq, K + j * ldk, ldk, D2, St + j * lds, lds);
    }
    for (; j < n; ++j) qk_tile_bf16<NR, 1>(QP, ldq, K + j * ldk, ldk, D2, St + j * lds, lds);
}

// (__builtin_cpu_init first: this runs in the library's constructors, when it is loaded)
const bool kHasBf16Dot = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
#else
const bool kHasBf16Dot = false;  // VDPBF16PS is an AVX-512 instruction: bfloat16 K is widened
#endif

// O[r][:] = (first ? 0 : O[r][:]) + sum_j P[j][r] * V[j][:] for NW rows and DZ kLanes-wide column
// blocks. A unit's keys come in passes of kPvKeys; the float32 partial sums go through O unchanged,
// so each output is still one sum over the unit's keys in ascending order.
template <int DZ, int NW>
inline void pv_tile(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t n, float* O, int64_t ldo,
                    bool first) {
    vec acc[NW][DZ];
    for (int w = 0; w < NW; ++w)
        for (int c = 0; c < DZ; ++c) acc[w][c] = first ? vzero() : vload(O + w * ldo + kLanes * c);
    for (int64_t j = 0; j < n; ++j) {
        vec v[DZ];
        for (int c = 0; c < DZ; ++c) v[c] = vload(V + j * ldv + kLanes * c);
        for (int w = 0; w < NW; ++w) {
            vec p = vset1(P[j * ldp + w]);
            for (int c = 0; c < DZ; ++c) acc[w][c] = vfmadd(p, v[c], acc[w][c]);
        }
    }
    for (int w = 0; w < NW; ++w)
        for (int c = 0; c < DZ; ++c) vstore(O + w * ldo + kLanes * c, acc[w][c]);
}

template <int DZ>
void pv_unit(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t n, int R, float* O, int64_t ldo,
             bool first) {
    constexpr int NW = kPvAcc / DZ;
    int r = 0;
    for (; r + NW <= R; r += NW) pv_tile<DZ, NW>(P + r, ldp, V, ldv, n, O + r * ldo, ldo, first);
    for (; r < R; ++r) pv_tile<DZ, 1>(P + r, ldp, V, ldv, n, O + r * ldo, ldo, first);
}

// O (+)= P @ V over `cols` column blocks, kPvCols at a time.
void pv_rows(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t n, int R, float* O, int64_t ldo,
             int cols, bool first) {
    for (int c = 0; c < cols; c += kPvCols) {
        const float* Vc = V + kLanes * c;
        float* Oc = O + kLanes * c;
        switch (std::min(kPvCols, cols - c)) {
            case 1: pv_unit<1>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 2: pv_unit<2>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 3: pv_unit<3>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 4: pv_unit<4>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 5: pv_unit<5>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 6: pv_unit<6>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            case 7: pv_unit<7>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
            default: pv_unit<8>(P, ldp, Vc, ldv, n, R, Oc, ldo, first); break;
        }
    }
}

struct Shape {
    int64_t Hq, Hkv, T, S, D, G, R, Rpad, units;
    bool bf16_dot;  // bfloat16 scores by VDPBF16PS (Q as pairs, K read in place as pairs)
};

// One work item: K/V head h, keys [j0, j0 + n). Writes the unit's row maxima, sums and unnormalised
// outputs to part = [R][D + 2] (D outputs, then max, then sum). `next_k` / `next_n`: the K rows of
// the unit this thread most likely runs next (prefetched; none when next_n is 0).
template <typename scalar_t>
void run_unit(const Shape& s, const float* Qt, const scalar_t* kh, int64_t k_ss, const scalar_t* vh, int64_t v_ss,
              const int32_t* nvis_row, int64_t j0, int64_t n, float scale, float* part, const scalar_t* next_k,
              int64_t next_n) {
    thread_local std::vector<float> buf;
    const int64_t need = n * s.Rpad + n * s.D + kPvKeys * s.D;
    if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
    float* St = buf.data();
    float* kbuf = St + n * s.Rpad;
    float* vbuf = kbuf + n * s.D;  // kPvKeys rows of V at a time
    int64_t ldk, ldv;
    const int nb = s.Rpad / kLanes;
    // this unit's V, then the next unit's K, spread over the first pass of score tiles
    RowPrefetch pf;
    pf.row[0] = reinterpret_cast<const char*>(vh + j0 * v_ss);
    pf.row[1] = reinterpret_cast<const char*>(next_k);
    pf.stride[0] = v_ss * sizeof(scalar_t);
    pf.stride[1] = k_ss * sizeof(scalar_t);
    pf.left[0] = n;
    pf.left[1] = next_n;
    pf.row_bytes = s.D * sizeof(scalar_t);
    const int64_t first_pass_tiles = std::max<int64_t>(1, n / keys_per_tile(std::min(kQkBlocks, nb)));
    pf.per_step = (n + next_n + first_pass_tiles - 1) / first_pass_tiles;
#ifndef KVM_AVX2
    if (s.bf16_dot) {
        // Qt holds the rows' query pairs here (see `run`); K is read in place as pairs.
        const uint32_t* QP = reinterpret_cast<const uint32_t*>(Qt);
        const uint32_t* K = reinterpret_cast<const uint32_t*>(kh + j0 * k_ss);
        const int64_t ldk2 = k_ss / 2;
        const int D2 = static_cast<int>(s.D / 2);
        // kQkBlocks row blocks per pass, as qk_rows (each pass reads the unit's keys again, from L2)
        for (int b = 0; b < nb; b += kQkBlocks) {
            const uint32_t* Qb = QP + kLanes * b;
            float* Sb = St + kLanes * b;
            switch (std::min(kQkBlocks, nb - b)) {
                case 1: qk_unit_bf16<1>(Qb, s.Rpad, K, ldk2, D2, n, Sb, s.Rpad, pf); break;
                case 2: qk_unit_bf16<2>(Qb, s.Rpad, K, ldk2, D2, n, Sb, s.Rpad, pf); break;
                case 3: qk_unit_bf16<3>(Qb, s.Rpad, K, ldk2, D2, n, Sb, s.Rpad, pf); break;
                default: qk_unit_bf16<4>(Qb, s.Rpad, K, ldk2, D2, n, Sb, s.Rpad, pf); break;
            }
        }
    } else
#endif
    {
        const float* K = rows_f32(kh + j0 * k_ss, k_ss, n, s.D, kbuf, ldk);
        qk_rows(Qt, s.Rpad, K, ldk, s.D, n, St, s.Rpad, nb, pf);
    }
    // Scale, mask (keys at or past a row's visible count), softmax over the unit, rows in lanes.
    const vec vscale = vset1(scale);
    const vec ninf = vset1(-std::numeric_limits<float>::infinity());
    ivec nv[kMaxRowBlocks];
    int32_t min_vis = std::numeric_limits<int32_t>::max();
    for (int i = 0; i < nb; ++i) nv[i] = ivload(nvis_row + kLanes * i);
    for (int r = 0; r < s.R; ++r) min_vis = std::min(min_vis, nvis_row[r]);
    vec mx[kMaxRowBlocks];
    for (int i = 0; i < nb; ++i) mx[i] = ninf;
    for (int64_t j = 0; j < n; ++j) {
        const bool masked = j0 + j >= min_vis;
        const ivec jj = ivset1(static_cast<int32_t>(j0 + j));
        for (int i = 0; i < nb; ++i) {
            vec x = vmul(vload(St + j * s.Rpad + kLanes * i), vscale);
            if (masked) x = hide_past(x, jj, nv[i], ninf);
            vstore(St + j * s.Rpad + kLanes * i, x);
            mx[i] = vmax(mx[i], x);
        }
    }
    vec sum[kMaxRowBlocks];
    for (int i = 0; i < nb; ++i) {
        // a row with no visible key in this unit: max -inf, every weight 0, sum 0
        mx[i] = replace_eq(mx[i], ninf, vzero());
        sum[i] = vzero();
    }
    for (int64_t j = 0; j < n; ++j)
        for (int i = 0; i < nb; ++i) {
            vec p = exp_ps(vsub(vload(St + j * s.Rpad + kLanes * i), mx[i]));
            vstore(St + j * s.Rpad + kLanes * i, p);
            sum[i] = vadd(sum[i], p);
        }
    alignas(64) float mrow[kMaxRows], lrow[kMaxRows];
    for (int i = 0; i < nb; ++i) {
        vstore(mrow + kLanes * i, mx[i]);
        vstore(lrow + kLanes * i, sum[i]);
    }
    // P @ V, kPvKeys keys at a time: the passes' V rows (widened from bfloat16 here) and weights stay in L1
    // while every row tile reads them.
    const int64_t ldo = s.D + 2;
    for (int64_t c0 = 0; c0 < n; c0 += kPvKeys) {
        const int64_t nc = std::min(kPvKeys, n - c0);
        const float* V = rows_f32(vh + (j0 + c0) * v_ss, v_ss, nc, s.D, vbuf, ldv);
        pv_rows(St + c0 * s.Rpad, s.Rpad, V, ldv, nc, s.R, part, ldo, static_cast<int>(s.D / kLanes), c0 == 0);
    }
    for (int r = 0; r < s.R; ++r) {
        // a row that saw no key keeps max -inf so the merge skips it
        part[r * ldo + s.D] = lrow[r] > 0.f ? mrow[r] : -std::numeric_limits<float>::infinity();
        part[r * ldo + s.D + 1] = lrow[r];
    }
}

// ---- Few rows (a decode step: R = G * T <= kFewRows) with float32 queries: keys in the lanes ----
//
// With rows in the lanes, a decode step of SmolLM2 (G = 3 query heads per K/V head, T = 1) fills 3
// of 16 lanes: five sixths of the score FMAs and of the softmax are padding. Here a key's score is a
// vector of D / kLanes FMAs per row (the row's dimensions in the lanes, the key's row read in place)
// and kLanes keys' vectors are reduced together into one vector of kLanes scores (`reduce_keys`), so
// the softmax has keys in its lanes too. Sums in a fixed order: a key's score is lane-wise FMAs over
// the dimension vectors in order, then the lanes summed by one fixed tree; a row's max and sum are
// lane-wise over its blocks of keys in order, then one tree; P @ V is one FMA per key in key order.
// Nothing depends on the thread count, and the units are fixed by S and H_kv (see `run`).
constexpr int kFewRows = 4;
constexpr int64_t kFewUnitKeys = 256;  // keys per work item at most: SmolLM2's 512 cached tokens are 6 items

// One row of D values as D / kLanes float32 vectors (a bfloat16 row widened exactly, as rows_f32 does:
// the same values in the same order, so a bfloat16 cache gives the bytes of its rows widened first).
template <int DZ>
inline void load_row(const float* src, vec* out) {
#pragma GCC unroll 16
    for (int c = 0; c < DZ; ++c) out[c] = vload(src + c * kLanes);
}
template <int DZ>
inline void load_row(const bf16* src, vec* out) {
#pragma GCC unroll 16
    for (int c = 0; c < DZ; ++c) out[c] = widen_bf16(reinterpret_cast<const uint16_t*>(src) + c * kLanes);
}

// v[0 .. kLanes): one vector per key; returns the vector whose lane j is the sum of v[j]'s lanes, by
// the same tree for every key: lanes (i, i + kLanes/2) first, then halves of what is left, ...
#ifdef KVM_AVX2
inline vec reduce_keys(vec* v) {
    vec w[4], u[2];
    for (int i = 0; i < 4; ++i)  // lanes (i, i + 4): [a 4 | b 4]
        w[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // then (i, i + 2): [a 2, c 2 | b 2, d 2]
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    // then (0, 1): keys [0, 2, 4, 6 | 1, 3, 5, 7], put in order
    const vec t = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else
// Level with runs of L lanes per key -> runs of L / 2 (a's keys, then b's): the lanes each takes.
struct ReduceIdx {
    __m512i lo[4], hi[4];
    ReduceIdx() {
        for (int level = 0, L = 16; L > 1; ++level, L /= 2) {
            alignas(64) int32_t lo_i[16], hi_i[16];
            const int nk = 16 / L, half = L / 2;
            for (int p = 0; p < 16; ++p) {
                const int k = p / half, o = p % half;
                const int src = k < nk ? 0 : 16, key = k < nk ? k : k - nk;
                lo_i[p] = src + key * L + o;
                hi_i[p] = src + key * L + half + o;
            }
            lo[level] = _mm512_load_si512(lo_i);
            hi[level] = _mm512_load_si512(hi_i);
        }
    }
};
const ReduceIdx kReduce;

inline vec reduce_keys(vec* v) {
    for (int level = 0, n = 16; n > 1; ++level, n /= 2)
        for (int i = 0; i < n / 2; ++i)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], kReduce.lo[level], v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], kReduce.hi[level], v[2 * i + 1]));
    return v[0];
}
#endif

// The sum of x's lanes by the same tree as reduce_keys (a row's softmax sum).
inline float hsum(vec x) {
    alignas(64) float t[kLanes];
    vstore(t, x);
    for (int n = kLanes / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; ++i) t[i] = t[i] + t[i + n];
    return t[0];
}
inline float hmax(vec x) {
    alignas(64) float t[kLanes];
    vstore(t, x);
    float m = t[0];
    for (int i = 1; i < kLanes; ++i) m = std::max(m, t[i]);
    return m;
}

// One work item of the few-rows path: K/V head (kh, vh), keys [j0, j0 + n); qa: the R rows' queries
// ([R][D] float32); writes part = [R][D + 2] as run_unit does (outputs in dimension order, max, sum).
template <int R, int DZ, typename kv_t>
void run_unit_few(const float* qa, const kv_t* kh, int64_t k_ss, const kv_t* vh, int64_t v_ss,
                  const int32_t* nvis_row, int64_t j0, int64_t n, float scale, float* part) {
    constexpr int D = DZ * kLanes;
    const int64_t nblocks = (n + kLanes - 1) / kLanes;
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < R * nblocks * kLanes) buf.resize(R * nblocks * kLanes);
    float* P = buf.data();  // [R][nblocks * kLanes]: scores, then weights
    const int64_t ldp = nblocks * kLanes;
    vec q[R][DZ];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < DZ; ++c) q[r][c] = vload(qa + r * D + c * kLanes);
    const vec vscale = vset1(scale);
    const vec ninf = vset1(-std::numeric_limits<float>::infinity());
    vec mx[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) mx[r] = ninf;
    alignas(64) int32_t lane_iota[kLanes];
    for (int l = 0; l < kLanes; ++l) lane_iota[l] = l;
    const ivec iota = ivload(lane_iota);
    // Scores, kLanes keys at a time (missing keys of the last block: zero rows, hidden below).
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t k0 = b * kLanes, nk = std::min<int64_t>(kLanes, n - k0);
        vec acc[R][kLanes];
        for (int jj = 0; jj < kLanes; ++jj) {
            vec kr[DZ];
            if (jj < nk) {
                load_row<DZ>(kh + (j0 + k0 + jj) * k_ss, kr);
            } else {
#pragma GCC unroll 16
                for (int c = 0; c < DZ; ++c) kr[c] = vzero();
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                vec a = vzero();
#pragma GCC unroll 16
                for (int c = 0; c < DZ; ++c) a = vfmadd(q[r][c], kr[c], a);
                acc[r][jj] = a;
            }
        }
        const ivec jj = vadd_i(iota, ivset1(static_cast<int32_t>(j0 + k0)));
        const ivec present = ivset1(static_cast<int32_t>(j0 + k0 + nk));  // keys past the unit's end
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            vec x = vmul(reduce_keys(acc[r]), vscale);
            x = hide_past(hide_past(x, jj, ivset1(nvis_row[r]), ninf), jj, present, ninf);
            vstore(P + r * ldp + k0, x);
            mx[r] = vmax(mx[r], x);
        }
    }
    // Softmax over the unit, keys in the lanes.
    float mrow[R], lrow[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        float m = hmax(mx[r]);
        const bool none = m == -std::numeric_limits<float>::infinity();  // no visible key in this unit
        const vec vm = vset1(none ? 0.f : m);
        vec sum = vzero();
        for (int64_t b = 0; b < nblocks; ++b) {
            const vec p = exp_ps(vsub(vload(P + r * ldp + b * kLanes), vm));
            vstore(P + r * ldp + b * kLanes, p);
            sum = vadd(sum, p);
        }
        lrow[r] = hsum(sum);
        mrow[r] = m;
    }
    // P @ V, keys in order.
    vec o[R][DZ];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < DZ; ++c) o[r][c] = vzero();
    for (int64_t j = 0; j < n; ++j) {
        vec vr[DZ];
        load_row<DZ>(vh + (j0 + j) * v_ss, vr);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const vec p = vset1(P[r * ldp + j]);
#pragma GCC unroll 16
            for (int c = 0; c < DZ; ++c) o[r][c] = vfmadd(p, vr[c], o[r][c]);
        }
    }
    const int64_t ldo = D + 2;
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < DZ; ++c) vstore(part + r * ldo + c * kLanes, o[r][c]);
        part[r * ldo + D] = lrow[r] > 0.f ? mrow[r] : -std::numeric_limits<float>::infinity();
        part[r * ldo + D + 1] = lrow[r];
    }
}

// run_unit_few for each (rows R, vectors per row DZ): kFew<kv_t>[R - 1][DZ - 1] (D = DZ * kLanes <= 128)
template <typename kv_t>
using FewFn = void (*)(const float*, const kv_t*, int64_t, const kv_t*, int64_t, const int32_t*, int64_t, int64_t,
                       float, float*);
constexpr int kMaxDz = 128 / kLanes;

template <typename kv_t, int R, std::size_t... I>
constexpr std::array<FewFn<kv_t>, sizeof...(I)> few_row(std::index_sequence<I...>) {
    return {&run_unit_few<R, static_cast<int>(I) + 1, kv_t>...};
}
template <typename kv_t, std::size_t... R>
constexpr std::array<std::array<FewFn<kv_t>, kMaxDz>, sizeof...(R)> few_table(std::index_sequence<R...>) {
    return {few_row<kv_t, static_cast<int>(R) + 1>(std::make_index_sequence<kMaxDz>{})...};
}
template <typename kv_t>
constexpr auto kFew = few_table<kv_t>(std::make_index_sequence<kFewRows>{});

// Sizes and element strides of one call (see the layouts above).
struct Args {
    int64_t Hq, T, D, Hkv, S;
    int64_t q_sh, q_st, k_sh, k_ss, v_sh, v_ss;
    int threads;
};

// q_t: the query's and the output's type; kv_t: the cache's (float32 queries may read a bfloat16 cache).
// False when a thread failed (out of memory): the output is then not written in full.
// `round_q` (float32 queries over a bfloat16 cache, kBf16Scores): where the rows-in-lanes path runs and
// the CPU has VDPBF16PS, the scores are those of the queries rounded to bfloat16 (round to nearest even,
// bfloat16.h), by the bfloat16 dot products; elsewhere the float32 queries as without it.
template <typename q_t, typename kv_t>
bool run(const Args& a, const q_t* qp, const kv_t* kp, const kv_t* vp, const std::vector<int32_t>& nvis,
         float scale, q_t* op, bool round_q = false) {
    Shape s;
    s.Hq = a.Hq; s.T = a.T; s.D = a.D;
    s.Hkv = a.Hkv; s.S = a.S;
    s.G = s.Hq / s.Hkv; s.R = s.G * s.T; s.Rpad = (s.R + kLanes - 1) / kLanes * kLanes;
    // Few rows under float32 queries: keys in the lanes (run_unit_few), in units of at most kFewUnitKeys
    const bool few = std::is_same<q_t, float>::value && s.R <= kFewRows;
    const bool q_pairs = std::is_same<q_t, bf16>::value || (round_q && !few);  // queries as bfloat16 pairs
    s.bf16_dot = q_pairs && std::is_same<kv_t, bf16>::value && kHasBf16Dot && a.k_ss % 2 == 0 && a.k_sh % 2 == 0;
    // Units fixed by S, H_kv and the path alone (never the thread count): S cut into n near-equal units
    // of at most the path's size (boundaries at multiples of 16 keys), n made even where H_kv * n would
    // be odd. Items of equal size split evenly over 2 (or any even number of) threads: units of the full
    // size and a short tail gave a 2-core machine a 2:1 split at a graft's 512 + 16 keys (items of 512
    // and 16 keys per K/V head) and 5:4 items while decoding past 512.
    const int64_t max_keys = few ? kFewUnitKeys : kUnitKeys;
    int64_t nsplit = (s.S + max_keys - 1) / max_keys;
    if ((s.Hkv * nsplit) % 2 && s.S >= 32) ++nsplit;
    // unit i's first key (S / nsplit >= 16 keys apart, so no unit is empty); unit_start(nsplit) = S
    const auto unit_start = [&](int64_t i) { return i >= nsplit ? s.S : (i * s.S / nsplit) / 16 * 16; };
    s.units = s.Hkv * nsplit;
    const int64_t q_sh = a.q_sh, q_st = a.q_st, k_sh = a.k_sh, k_ss = a.k_ss;
    const int64_t v_sh = a.v_sh, v_ss = a.v_ss;
    // Per K/V head: Qt[d][r] (r = g * T + t, query head h * G + g), and each row's visible count.
    std::vector<float> Qt(s.Hkv * s.D * s.Rpad, 0.f);
    std::vector<int32_t> nvis_row(s.Rpad, 0);
    for (int64_t r = 0; r < s.R; ++r) nvis_row[r] = nvis[r % s.T];
    if (few) {
        // Per K/V head: the rows' queries [R][D] (row r = g * T + t: query head h * G + g, token t)
        for (int64_t h = 0; h < s.Hkv; ++h)
            for (int64_t r = 0; r < s.R; ++r) {
                const q_t* src = qp + (h * s.G + r / s.T) * q_sh + (r % s.T) * q_st;
                for (int64_t d = 0; d < s.D; ++d) Qt[(h * s.R + r) * s.D + d] = to_f32(src[d]);
            }
    }
    for (int64_t h = 0; h < (few ? 0 : s.Hkv); ++h)
        for (int64_t g = 0; g < s.G; ++g)
            for (int64_t t = 0; t < s.T; ++t) {
                const q_t* src = qp + (h * s.G + g) * q_sh + t * q_st;
                float* dst = Qt.data() + h * s.D * s.Rpad + g * s.T + t;
                if (s.bf16_dot) {
                    // QP[d / 2][r] = (q[d], q[d + 1]) as one 32-bit pair of bfloat16 bits (float32 queries
                    // rounded to them: round_q), in the head's Qt room
                    uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
                    for (int64_t d = 0; d < s.D; d += 2)
                        pairs[(d / 2) * s.Rpad] =
                            bf16_bits(src[d]) | (static_cast<uint32_t>(bf16_bits(src[d + 1])) << 16);
                } else {
                    for (int64_t d = 0; d < s.D; ++d) dst[d * s.Rpad] = to_f32(src[d]);
                }
            }
    const int64_t ldp = s.R * (s.D + 2);
    std::vector<float> parts(s.units * ldp);
    const bool units_ok = parallel_for(a.threads, 0, s.units, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
            const int64_t h = u / nsplit, j0 = unit_start(u % nsplit), n = unit_start(u % nsplit + 1) - j0;
            if (few) {
                if constexpr (std::is_same<q_t, float>::value)
                    kFew<kv_t>[s.R - 1][s.D / kLanes - 1](Qt.data() + h * s.R * s.D, kp + h * k_sh, k_ss,
                                                          vp + h * v_sh, v_ss, nvis_row.data(), j0,
                                                          n, scale, parts.data() + u * ldp);
                continue;
            }
            // the unit after this one (the thread's next, unless its range ends here)
            const int64_t hn = (u + 1) / nsplit, jn = unit_start((u + 1) % nsplit);
            const int64_t next_n = u + 1 < s.units ? unit_start((u + 1) % nsplit + 1) - jn : 0;
            run_unit<kv_t>(s, Qt.data() + h * s.D * s.Rpad, kp + h * k_sh, k_ss, vp + h * v_sh, v_ss,
                           nvis_row.data(), j0, n, scale, parts.data() + u * ldp,
                           next_n ? kp + hn * k_sh + jn * k_ss : nullptr, next_n);
        }
    });
    if (!units_ok) return false;
    // Merge the units of each K/V head in unit order.
    return parallel_for(a.threads, 0, s.Hkv * s.R, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(s.D);
        for (int64_t hr = begin; hr < end; ++hr) {
            const int64_t h = hr / s.R, r = hr % s.R, g = r / s.T, t = r % s.T;
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t u = 0; u < nsplit; ++u) m = std::max(m, parts[(h * nsplit + u) * ldp + r * (s.D + 2) + s.D]);
            std::fill(acc.begin(), acc.end(), 0.f);
            float l = 0.f;
            for (int64_t u = 0; u < nsplit; ++u) {
                const float* p = parts.data() + (h * nsplit + u) * ldp + r * (s.D + 2);
                if (p[s.D] == -std::numeric_limits<float>::infinity()) continue;
                const float w = std::exp(p[s.D] - m);
                l += w * p[s.D + 1];
                for (int64_t d = 0; d < s.D; ++d) acc[d] += w * p[d];
            }
            q_t* dst = op + (t * s.Hq + h * s.G + g) * s.D;
            const float inv = 1.f / l;
            for (int64_t d = 0; d < s.D; ++d) dst[d] = from_f32<q_t>(acc[d] * inv);
        }
    });
}

// Keys each query row sees, from a bool mask [1, 1, T, S] whose rows are prefixes of trues;
// empty when a row is not (or sees no key at all): the caller falls back to SDPA.
std::vector<int32_t> visible_counts(const bool* mask, int64_t row_stride, int64_t T, int64_t S) {
    std::vector<int32_t> n(T);
    const char* base = reinterpret_cast<const char*>(mask);
    for (int64_t t = 0; t < T; ++t) {
        const char* row = base + t * row_stride;
        const void* first_false = std::memchr(row, 0, S);
        const int64_t j = first_false ? static_cast<const char*>(first_false) - row : S;
        if (j == 0 || (j < S && std::memchr(row + j, 1, S - j))) return {};
        n[t] = static_cast<int32_t>(j);
    }
    return n;
}

}  // namespace

// The entry point's dtypes: 0 float32, 1 bfloat16 (few_query_attention.py passes them); for q also 2,
// float32 queries scored as their bfloat16 rounding where the CPU has VDPBF16PS (`run`'s round_q; the q8
// profile's attention, as llama.cpp rounds Q to its cache's type for the scores).
enum Dtype { kF32 = 0, kBF16 = 1, kBf16Scores = 2 };

// The library is built with -fvisibility=hidden: only these entry points are exported.
#pragma GCC visibility push(default)
extern "C" {

// The version of the calling convention below; few_query_attention.py refuses a library of another.
int kvm_fewq_abi_version() { return 2; }

// 1 where this build scores bfloat16 pairs by VDPBF16PS on this CPU (bfloat16 queries, and kBf16Scores),
// else 0: the execution profile records it where those scores run (their bits differ from the widened path's).
int kvm_fewq_bf16_dot() { return kHasBf16Dot ? 1 : 0; }

// out [1, T, H_q, D] (contiguous, q's dtype) = attention of q over k, v. Returns 0 when done; 1 when
// this call is not one the kernel takes (the caller runs SDPA; out is untouched); -1 when a thread
// failed (out of memory). Python checks the tensors' dtypes, dims, batch of 1, device and contiguous
// last dimensions; the sizes' limits are checked here. Strides in elements: q_sh / q_st between query
// heads / tokens, k_sh / k_ss (v_sh / v_ss) between K (V) heads / positions; mask: null (no mask:
// `causal` says bottom-right-aligned causal, else every key), or bool rows of S, mask_st apart.
int kvm_fewq_attention(int q_dtype, int kv_dtype, const void* q, const void* k, const void* v, const bool* mask,
                       void* out, int64_t Hq, int64_t T, int64_t D, int64_t Hkv, int64_t S, int64_t q_sh,
                       int64_t q_st, int64_t k_sh, int64_t k_ss, int64_t v_sh, int64_t v_ss, int64_t mask_st,
                       float scale, int causal, int threads) {
    // q and the cache alike (float32 or bfloat16), or float32 queries over a bfloat16 cache (kBf16Scores:
    // float32 queries whose scores come from their bfloat16 rounding, over a bfloat16 cache only)
    const bool ok_dtype = ((q_dtype == kF32 || q_dtype == kBF16) && (kv_dtype == q_dtype || kv_dtype == kBF16)) ||
                          (q_dtype == kBf16Scores && kv_dtype == kBF16);
    if (!ok_dtype || D % 16 || D == 0 || D > 128 || Hkv <= 0 || Hq % Hkv || (Hq / Hkv) * T > kMaxRows || T > S)
        return 1;
    try {
        std::vector<int32_t> nvis;
        if (mask != nullptr) {
            nvis = visible_counts(mask, mask_st, T, S);
            if (nvis.empty()) return 1;
        } else {
            nvis.resize(T);
            for (int64_t t = 0; t < T; ++t) nvis[t] = static_cast<int32_t>(causal ? S - T + t + 1 : S);
        }
        const Args a{Hq, T, D, Hkv, S, q_sh, q_st, k_sh, k_ss, v_sh, v_ss, threads};
        bool ok;
        if (q_dtype == kBF16)
            ok = run<bf16, bf16>(a, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                                 static_cast<const bf16*>(v), nvis, scale, static_cast<bf16*>(out));
        else if (kv_dtype == kBF16)
            ok = run<float, bf16>(a, static_cast<const float*>(q), static_cast<const bf16*>(k),
                                  static_cast<const bf16*>(v), nvis, scale, static_cast<float*>(out),
                                  q_dtype == kBf16Scores);
        else
            ok = run<float, float>(a, static_cast<const float*>(q), static_cast<const float*>(k),
                                   static_cast<const float*>(v), nvis, scale, static_cast<float*>(out));
        return ok ? 0 : -1;
    } catch (...) {  // a failed allocation: nothing may throw through a C entry point
        return -1;
    }
}

}  // extern "C"
#pragma GCC visibility pop
