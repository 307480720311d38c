// bfloat16 on the device: unpacking (exact) and packing bit-identical to dtype.hpp's float_to_bf16 (round to
// nearest even; a NaN keeps its sign and payload, quieted, as on the CPU). CUDA sources only.
#pragma once

#include <epmoe/dtype.hpp>

#include <cstdint>

namespace epmoe {

/// The eight bf16 values of a 16-byte vector (element 0 in the low half of v.x), widened to float (exact).
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float* f) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

/// Two floats rounded to bf16 and packed: `lo` in bits 0..15, `hi` in bits 16..31. One cvt.rn.bf16x2.f32 (the
/// software rounding cost ~6 instructions a value, which made the reduce kernels partly compute-bound); a NaN,
/// which the instruction would make canonical, takes the software path.
__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  std::uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if (lo != lo || hi != hi)
    r = static_cast<std::uint32_t>(float_to_bf16(lo).bits) | static_cast<std::uint32_t>(float_to_bf16(hi).bits) << 16;
  return r;
}

}  // namespace epmoe
