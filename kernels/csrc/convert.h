// Element conversions the kernels compute through: every value is widened to float, and rounded back to its
// dtype the way c10 rounds (to nearest, ties to even).
//
// Why not c10's own operators: for BFloat16 they are opaque enough that loops mixing them with expf stay
// scalar, and a bf16 SiLU-and-mul ran 8x slower than in float32. These are a shift (widen) and an add and a
// shift (round), which the compiler vectorizes. NaN is not special-cased: the kernels build with
// -ffast-math, which assumes there is none.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvmesh {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float f) {
  return static_cast<T>(f);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += UINT32_C(0x7FFF) + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// ``f`` rounded to ``T`` and widened again: where Hugging Face rounds an intermediate to the model's dtype.
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace kvmesh
