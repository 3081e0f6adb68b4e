// The "q8" linears (quantized_linear.cpp's kind flag 512, `linears="q8"`): the weights' integer quants times
// activations quantized to 8 bits, summed as integers, as llama.cpp computes a GGUF file. Included by
// quantized_linear.cpp inside its namespace (it uses Kind, scales, kPanel ...), once per integer
// dot product: on AVX-512 once with VNNI's vpdpbusd (namespace q8_vnni, compiled for that extension and
// called only where the CPU has it) and once with AVX512BW's multiply-adds (q8_plain); on AVX2 once.
//
// The activations, per row and block of 32 k (quantize_rows):
//   amax = max |x|, dx = amax / 127, xq[k] = round_half_even(x[k] * (dx != 0 ? 1 / dx : 0)) in [-127, 127],
//   xs = the sum of xq over each sub-block of 16 k (a NaN or infinite amax gives dx = NaN: NaN outputs).
// Output (m, n), one float32 sum over the sub-blocks s of 16 or 32 k, ascending, from acc = 0:
//   isum = sum over k in s of q(n, k) * xq(m, k)          (exact: integers; the order cannot matter:
//          without VNNI a sub-block's 16-bit multiply-adds are summed in 16-bit lanes first, which their
//          bounds keep exact: <= 8 x 3810 for nibbles, 2 x 16002 for the six layout; bytes widen at once)
//   acc  = acc + (d(n, s) * dx(m, s)) * float(isum)         (three float32 roundings: *, *, +; no FMA)
//   acc  = acc + (m(n, s) * dx(m, s)) * float(xs(m, s))     (formats with a minimum: w = q * d + m)
// where q is the weight's signed integer (a NIB's nibble minus its bias, a BYTE's int8) and d, m are
// the scale and minimum of quantized_linear.cpp's formats (K-quants: D * scale, -(DMIN * min)). The
// integer part is exact whichever instructions compute it and the float part is one fixed sequence of
// IEEE operations per output, so a row's bits depend on nothing else: not the rows beside it, the
// thread count, the ISA build, nor VNNI (tests/test_q8_linear.py checks all of it against a torch
// computation of these formulas).
//
// Weight layout (re-laid once from the float path's, kernels/quantized_linear.py `to_q8`), per panel
// of 16 output rows, in groups of 4 bytes per row (one 32-bit lane of a vector):
//   nibble formats: [K/8, 16, 4] bytes: byte (g, j, b) = q(j, 8g + b) | q(j, 8g + 4 + b) << 4 (unsigned)
//   byte formats:   [K/4, 16, 4] bytes: byte (g, j, b) = q(j, 4g + b) + 128 (unsigned)
//   six (byte formats whose quants lie in [-32, 32): Q6_K, Q5_0 ...; u = q + 32, 6 bits): the low
//     nibbles of u as the nibble formats' [K/8, 16, 4], then the high 2 bits [K/16, 16, 4]: byte (g, j, b)
//     holds those of k = 16g + 4c + b at bits 2c, 2c + 1 (c = 0..3). 6 bits a weight, as in the file.

namespace KVM_Q8_NS {

#ifdef KVM_AVX2
using iv = __m256i;
inline iv iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline iv ibcast(int32_t x) { return _mm256_set1_epi32(x); }
inline iv izero() { return _mm256_setzero_si256(); }
inline iv isub(iv a, iv b) { return _mm256_sub_epi32(a, b); }
inline iv iadd(iv a, iv b) { return _mm256_add_epi32(a, b); }
inline iv lo4(iv w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
inline iv hi4(iv w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
inline vec to_f(iv a) { return _mm256_cvtepi32_ps(a); }
// acc + per 16-bit lane the sum of 2 products of unsigned w <= 63 and signed x (<= 2 * 63 * 127 = 16002)
inline iv dot16(iv acc, iv w, iv x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
// the 16-bit lanes' sums per 32-bit lane
inline iv widen16(iv a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
// acc + per 32-bit lane the sum of 4 products of unsigned w <= 15 and signed x (no int16 saturation: <= 3810)
inline iv dot_nib(iv acc, iv w, iv x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
// w holds q + 128: acc + sum of q * x, through |q| and x with q's sign (pairs <= 2 * 128 * 127, no saturation)
constexpr int kByteOffset = 0;  // what the byte formats' isum still holds of the stored 128
inline iv dot_byte(iv acc, iv w, iv x) {
    const iv q = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)),
                                                   _mm256_set1_epi16(1)));
}
constexpr bool kSum16 = true;  // a sub-block's multiply-adds summed in 16-bit lanes, widened once (tile)
constexpr int kQ8Rows = 4;  // a tile's rows: 2 accumulators each + weights + broadcast within 16 registers
constexpr int kQ8Panels = 2;  // panels of a tile of 1 or 2 rows
#else
using iv = __m512i;
inline iv iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline iv ibcast(int32_t x) { return _mm512_set1_epi32(x); }
inline iv izero() { return _mm512_setzero_si512(); }
inline iv isub(iv a, iv b) { return _mm512_sub_epi32(a, b); }
inline iv iadd(iv a, iv b) { return _mm512_add_epi32(a, b); }
inline iv lo4(iv w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
inline iv hi4(iv w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
inline vec to_f(iv a) { return _mm512_cvtepi32_ps(a); }
inline iv dot16(iv acc, iv w, iv x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
inline iv widen16(iv a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
#ifdef KVM_Q8_VNNI
constexpr bool kSum16 = false;  // vpdpbusd sums into 32-bit lanes itself
inline iv dot_nib(iv acc, iv w, iv x) { return _mm512_dpbusd_epi32(acc, w, x); }
constexpr int kByteOffset = 128;  // vpdpbusd multiplies the stored q + 128: isum - 128 * xs is the sum
inline iv dot_byte(iv acc, iv w, iv x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
constexpr bool kSum16 = true;
inline iv dot_nib(iv acc, iv w, iv x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
constexpr int kByteOffset = 0;
inline iv dot_byte(iv acc, iv w, iv x) {
    const iv q = _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80)));
    const iv sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);  // x with q's sign
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), sx), _mm512_set1_epi16(1)));
}
#endif
constexpr int kQ8Rows = 8;
constexpr int kQ8Panels = 4;
#endif

// R rows x G consecutive panels (their lanes [v * kLanes, (v + 1) * kLanes)), over all of K: y[r] + g * 16
// (see the header for the sums). G panels give a row G independent chains of dot products (one row's
// chain alone waits on each instruction's latency). xq [R rows of K] int8, dx [rows][K/32], xs
// [rows][K/16]: each row's own; q, d, m: the first panel's, the others q_panel / s_panel bytes apart.
constexpr int kSix = 5;  // the "six" layout of a byte format (not one of quantized_linear.cpp's formats)

// The bits 4 and 5 of 6-bit weights: quarter c's 2 high bits from h (each byte's bits 2c, 2c + 1)
template <int C>
inline iv high2(iv h) {
#ifdef KVM_AVX2
    const iv m = _mm256_set1_epi8(0x30);
    if constexpr (C == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    if constexpr (C == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    if constexpr (C == 2) return _mm256_and_si256(h, m);
    return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
#else
    const iv m = _mm512_set1_epi8(0x30);
    if constexpr (C == 0) return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    if constexpr (C == 1) return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    if constexpr (C == 2) return _mm512_and_si512(h, m);
    return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
#endif
}
#ifdef KVM_AVX2
inline iv ior(iv a, iv b) { return _mm256_or_si256(a, b); }
#else
inline iv ior(iv a, iv b) { return _mm512_or_si512(a, b); }
#endif

template <int F, bool KS, int R, int G>
void tile(const Kind& kd, const int8_t* const* xq, const float* const* dx, const int32_t* const* xs,
          const uint8_t* q, const uint8_t* d, const uint8_t* m, int64_t q_panel, int64_t s_panel, int64_t K, int v,
          float* const* y) {
    constexpr bool kNibbles = nibbles(F);
    constexpr int64_t kGroupK = F == kSix ? 16 : kNibbles ? 8 : 4;  // k per 4-byte group of a row
    const int64_t sub = int64_t(1) << kd.sub_shift, nsub = K >> kd.sub_shift;
    const int corr_per_xs = F == kSix ? 32 : F == kNib ? kd.bias : (F == kByte || F == kByteMin) ? kByteOffset : 0;
    const uint8_t* hv = q + K / 2 * kPanel + v * kLanes * 4;  // six: the high bits, after the nibbles
    vec acc[R][G];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[r][g] = vzero();
    const uint8_t* qv = q + v * kLanes * 4;
    for (int64_t s = 0; s < nsub; ++s) {
        iv ia[R][G];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) ia[r][g] = izero();
#pragma GCC unroll 4
        for (int64_t k = s * sub; k < (s + 1) * sub; k += kGroupK) {
            int32_t x0[R], x1[R], x2[R], x3[R];
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                std::memcpy(&x0[r], xq[r] + k, 4);
                if constexpr (kNibbles || F == kSix) std::memcpy(&x1[r], xq[r] + k + 4, 4);
                if constexpr (F == kSix) {
                    std::memcpy(&x2[r], xq[r] + k + 8, 4);
                    std::memcpy(&x3[r], xq[r] + k + 12, 4);
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) {
                if constexpr (F == kSix) {  // 16 k: two nibble groups and their high bits
                    const iv lo0 = iload(qv + g * q_panel + (uint64_t(k) / 8) * kPanel * 4);
                    const iv lo1 = iload(qv + g * q_panel + (uint64_t(k) / 8 + 1) * kPanel * 4);
                    const iv h = iload(hv + g * q_panel + (uint64_t(k) / 16) * kPanel * 4);
                    const iv w0 = ior(lo4(lo0), high2<0>(h)), w1 = ior(hi4(lo0), high2<1>(h));
                    const iv w2 = ior(lo4(lo1), high2<2>(h)), w3 = ior(hi4(lo1), high2<3>(h));
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) {
                        if constexpr (kSum16) {  // two products' sums <= 2 * 16002 per 16-bit lane
                            const iv a = dot16(dot16(izero(), w0, ibcast(x0[r])), w1, ibcast(x1[r]));
                            const iv b = dot16(dot16(izero(), w2, ibcast(x2[r])), w3, ibcast(x3[r]));
                            ia[r][g] = iadd(ia[r][g], iadd(widen16(a), widen16(b)));
                        } else {
                            ia[r][g] = dot_nib(dot_nib(dot_nib(dot_nib(ia[r][g], w0, ibcast(x0[r])), w1, ibcast(x1[r])),
                                                       w2, ibcast(x2[r])), w3, ibcast(x3[r]));
                        }
                    }
                    continue;
                }
                const iv w = iload(qv + g * q_panel + (uint64_t(k) / kGroupK) * kPanel * 4);
                if constexpr (kNibbles) {
                    const iv wl = lo4(w), wh = hi4(w);
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) {
                        if constexpr (kSum16)  // 16-bit lanes: widened after the sub-block (below)
                            ia[r][g] = dot16(dot16(ia[r][g], wl, ibcast(x0[r])), wh, ibcast(x1[r]));
                        else
                            ia[r][g] = dot_nib(dot_nib(ia[r][g], wl, ibcast(x0[r])), wh, ibcast(x1[r]));
                    }
                } else {
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) ia[r][g] = dot_byte(ia[r][g], w, ibcast(x0[r]));
                }
            }
        }
        if constexpr (kSum16 && kNibbles && F != kSix) {
            // the sub-block's sub / 4 <= 8 multiply-adds of nibbles, each <= 2 * 15 * 127 = 3810, summed
            // in 16-bit lanes: <= 30480, so exact; now in 32-bit lanes
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
                for (int g = 0; g < G; ++g) ia[r][g] = widen16(ia[r][g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
            vec dv, mv;
            scales<F, KS>(kd, d ? d + g * s_panel : nullptr, m ? m + g * s_panel : nullptr, s, v, dv, mv);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                // xs of a sub-block of 32 is its two halves' sum; dx is the 32-block's
                const int32_t sum = sub == 16 ? xs[r][s] : xs[r][2 * s] + xs[r][2 * s + 1];
                const vec dxv = vset1(dx[r][(s * sub) >> 5]);
                const iv i = corr_per_xs ? isub(ia[r][g], ibcast(corr_per_xs * sum)) : ia[r][g];
                acc[r][g] = vadd(acc[r][g], vmul(vmul(dv, dxv), to_f(i)));
                if constexpr (has_min(F)) acc[r][g] = vadd(acc[r][g], vmul(vmul(mv, dxv), vset1(float(sum))));
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) vstore(y[r] + g * kPanel + v * kLanes, acc[r][g]);
}

// R rows x `panels` consecutive panels (at most kQ8Panels). Few rows take several panels at once
// (independent chains), many rows one (their accumulators fill the registers); the sums are the same.
template <int F, bool KS>
void rows_panels(const Kind& kd, int64_t R, const int8_t* const* xq, const float* const* dx, const int32_t* const* xs,
                 const uint8_t* q, const uint8_t* d, const uint8_t* m, int64_t q_panel, int64_t s_panel, int64_t K,
                 int64_t panels, float* const* y) {
    for (int v = 0; v < kVecs; ++v) {
        std::array<float*, kQ8Rows> yg;
        int64_t r = 0;
        for (; r + kQ8Rows <= R; r += kQ8Rows)
            for (int64_t g = 0; g < panels; ++g) {
                for (int i = 0; i < kQ8Rows; ++i) yg[i] = y[r + i] + g * kPanel;
                tile<F, KS, kQ8Rows, 1>(kd, xq + r, dx + r, xs + r, q + g * q_panel, d ? d + g * s_panel : nullptr,
                                        m ? m + g * s_panel : nullptr, q_panel, s_panel, K, v, yg.data());
            }
        const int64_t left = R - r;
        if (left == 0) continue;
        for (int64_t g = 0; g < panels;) {
            const int64_t G = panels - g >= kQ8Panels && left <= 2 ? kQ8Panels : 1;
            for (int64_t i = 0; i < left; ++i) yg[i] = y[r + i] + g * kPanel;
            const uint8_t* qg = q + g * q_panel;
            const uint8_t* dg = d ? d + g * s_panel : nullptr;
            const uint8_t* mg = m ? m + g * s_panel : nullptr;
            switch (left * 8 + G) {
#define KVM_Q8_CASE(RR, GG) \
    case RR * 8 + GG: tile<F, KS, RR, GG>(kd, xq + r, dx + r, xs + r, qg, dg, mg, q_panel, s_panel, K, v, yg.data()); break;
                KVM_Q8_CASE(1, kQ8Panels) KVM_Q8_CASE(2, kQ8Panels) KVM_Q8_CASE(1, 1) KVM_Q8_CASE(2, 1) KVM_Q8_CASE(3, 1)
#ifndef KVM_AVX2
                KVM_Q8_CASE(4, 1) KVM_Q8_CASE(5, 1) KVM_Q8_CASE(6, 1) KVM_Q8_CASE(7, 1)
#endif
#undef KVM_Q8_CASE
                default: break;
            }
            g += G;
        }
    }
}

using RowsPanelsFn = void (*)(const Kind&, int64_t, const int8_t* const*, const float* const*, const int32_t* const*,
                              const uint8_t*, const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                              float* const*);

inline RowsPanelsFn rows_panels_fn(const Kind& kd) {
    if (kd.six) return kd.kscales ? &rows_panels<kSix, true> : &rows_panels<kSix, false>;
    if (kd.kscales) {
        switch (kd.format) {
            case kNib: return &rows_panels<kNib, true>;
            case kNibMin: return &rows_panels<kNibMin, true>;
            case kByte: return &rows_panels<kByte, true>;
            default: return &rows_panels<kByteMin, true>;
        }
    }
    switch (kd.format) {
        case kNib: return &rows_panels<kNib, false>;
        case kNibMin: return &rows_panels<kNibMin, false>;
        case kByte: return &rows_panels<kByte, false>;
        default: return &rows_panels<kByteMin, false>;
    }
}

}  // namespace KVM_Q8_NS
