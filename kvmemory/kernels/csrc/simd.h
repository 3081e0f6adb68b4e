// The float32 vector operations kvmemory's CPU kernels share, written once per build: AVX-512 (16
// lanes, 32 registers) by default, AVX2 + FMA (8 lanes, 16 registers) with -DKVM_AVX2. Each kernel
// adds the few ISA-specific operations only it needs next to its own tiles.
#pragma once

#include <immintrin.h>

namespace kvm {

#ifdef KVM_AVX2
using vec = __m256;
constexpr int kLanes = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
#else
using vec = __m512;
constexpr int kLanes = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
#endif

}  // namespace kvm
