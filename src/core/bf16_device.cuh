// bfloat16 packing on the device, bit-identical to dtype.hpp's float_to_bf16 (round to nearest even; a NaN keeps
// its sign and payload, quieted, as on the CPU). CUDA sources only.
#pragma once

#include <epmoe/dtype.hpp>

#include <cstdint>

namespace epmoe {

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
