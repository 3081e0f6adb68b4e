// bfloat16 as raw bits, converted exactly as torch's c10::BFloat16 converts (torch/headeronly/util/
// BFloat16.h): to float32 by shifting the bits up; from float32 by rounding to nearest even, every
// NaN to 0x7FC0. The kernels are plain C++ (no torch headers), so this is their one copy of it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvm {

struct bf16 {
    uint16_t x;
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes, as torch stores bfloat16");

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) {
    const uint32_t u = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

template <typename T>
T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline bf16 from_f32<bf16>(float v) {
    if (std::isnan(v)) return bf16{0x7FC0};
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const uint32_t rounding_bias = ((u >> 16) & 1) + UINT32_C(0x7FFF);
    return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

}  // namespace kvm
