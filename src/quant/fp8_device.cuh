// Device-side fp8 e4m3 helpers of the CUDA quantizer (quant/cuda.cu), shared with kernels that quantize rows
// themselves (the cuda_ipc low-latency dispatch, transport/cuda_ipc_low_latency_kernels.cu), so every GPU path
// computes a group's scale and codes with the same operations as quant_impl.hpp's group_scale and quant/cpu.cpp:
// bit-identical to the CPU. CUDA sources only.
#pragma once

#include <epmoe/dtype.hpp>

#include <cstdint>

#include "quant/quant_impl.hpp"

namespace epmoe::quant_detail {

struct DeviceGroupScale {
  float scale, inv;
  int exponent;
};

// quant_impl.hpp's group_scale, on the device: same operations, same order.
__device__ __forceinline__ DeviceGroupScale device_group_scale(float amax, bool round_scale) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  if (!round_scale) return {a / kFp8E4m3Max, kFp8E4m3Max / a, 0};
  const std::uint32_t c = float_bits(a / kFp8E4m3Max);
  const int e = static_cast<int>((c >> 23) & 0xffu) - 127 + ((c & 0x7fffffu) != 0u ? 1 : 0);
  // 2^e for -22 <= e <= 128 (e = 128 gives +inf, as ldexp does); a >= 1e-4 keeps e well above -126.
  const float scale = bits_float(static_cast<std::uint32_t>(e + 127) << 23);
  return {scale, 1.0f / scale, e};
}

// Two floats to two e4m3 codes, lo in the low byte. With kFixNaN, NaN -> 0x7f whatever its sign, as
// the CPU does (only needed when the inputs hold an inf or a NaN: otherwise x * inv is never NaN).
template <bool kHardware, bool kFixNaN>
__device__ __forceinline__ std::uint32_t fp8x2(float lo, float hi) {
  std::uint32_t code;
  if constexpr (kHardware) {
    std::uint16_t packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    code = packed;
    if constexpr (kFixNaN) {
      if (lo != lo) code = (code & 0xff00u) | 0x7fu;
      if (hi != hi) code = (code & 0x00ffu) | 0x7f00u;
    }
  } else {
    code = static_cast<std::uint32_t>(float_to_fp8_e4m3(lo).bits) |
           (static_cast<std::uint32_t>(float_to_fp8_e4m3(hi).bits) << 8);
  }
  return code;
}

template <bool kHardware, bool kFixNaN>
__device__ __forceinline__ uint4 convert16(const float* v, float inv) {
  std::uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t lo = fp8x2<kHardware, kFixNaN>(v[4 * i] * inv, v[4 * i + 1] * inv);
    const std::uint32_t hi = fp8x2<kHardware, kFixNaN>(v[4 * i + 2] * inv, v[4 * i + 3] * inv);
    out[i] = lo | (hi << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace epmoe::quant_detail
