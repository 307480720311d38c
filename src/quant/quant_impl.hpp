// Internal interface of the quantization stage: quant.cpp validates the arguments of the public
// functions and dispatches on device; cpu.cpp holds the CPU loops (a CUDA twin implements the same
// entry points). The group-scale rule lives here once, for every implementation on the host.
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/quant.hpp>

#include <cmath>
#include <cstdint>

namespace epmoe::quant_detail {

/// Lower clamp of a group's absolute maximum (SPEC 6), so an all-zero group gets a finite scale.
inline constexpr float kAmaxFloor = 1e-4f;

/// A group's scale as SPEC 6 defines it, with the factor the values are multiplied by.
struct GroupScale {
  float scale;  ///< a / 448, or 2^exponent with round_scale
  float inv;  ///< 448 / a, or 2^-exponent (x * inv equals x / scale exactly for a power of two)
  int exponent;  ///< ceil(log2(a / 448)) with round_scale, else 0
};

/// a = max(amax, 1e-4) in float32; scale = a / 448, or 2^ceil(log2(a / 448)) with round_scale.
inline GroupScale group_scale(float amax, bool round_scale) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  if (!round_scale) return {a / kFp8E4m3Max, kFp8E4m3Max / a, 0};
  // ceil(log2(c)) of a normal float c: its unbiased exponent, plus one unless c is a power of two.
  // c >= 1e-4 / 448 is always normal; c = inf gives 128 (scale inf, UE8M0 byte 255 = NaN).
  const std::uint32_t c = float_bits(a / kFp8E4m3Max);
  const int e = static_cast<int>((c >> 23) & 0xffu) - 127 + ((c & 0x7fffffu) != 0u ? 1 : 0);
  const float scale = std::ldexp(1.0f, e);
  return {scale, 1.0f / scale, e};
}

/// Validated quantization problem: x [T, H] bf16/fp32, q [T, H] fp8, scales float32 [T, G] or int32
/// [T, W] (UE8M0); each with unit stride in dimension 1 and any row stride >= its width.
struct QuantizeProblem {
  TensorView x, q, scales;
  std::int64_t num_tokens = 0, hidden = 0;
  Fp8Options options;
};

void quantize_fp8_cpu(const QuantizeProblem& p);

/// q [T, H] fp8, scales float32 [T, G] or int32 [T, W]; out [T, H] bf16/fp32, contiguous.
void dequantize_fp8_cpu(const TensorView& q, const TensorView& scales, const TensorView& out);

}  // namespace epmoe::quant_detail
