// Independent references for the fp8 / bf16 conversions and the fp8 per-token-group quantization
// (semantics §6). Written from docs/semantics.md and the OCP 8-bit float format, never calling epmoe's
// conversions: values are decoded arithmetically and encoded by a nearest-value search in double.
#pragma once

#include <cstdint>
#include <vector>

namespace epmoe::test {

/// Value of an fp8 e4m3 (OCP "fn") code: (1 + m/8) * 2^(e-7), subnormals m/8 * 2^-6, 0x7f/0xff NaN.
double ref_fp8_decode(std::uint8_t code);
/// Nearest fp8 e4m3 code to v, ties to the even code, |v| >= 448 (and +-inf) saturating to +-448,
/// NaN -> 0x7f, zero and underflow keep the sign (the rule of __nv_cvt_float_to_fp8 with SATFINITE).
std::uint8_t ref_fp8_encode(double v);

/// Value of a bfloat16 bit pattern.
double ref_bf16_decode(std::uint16_t bits);
/// v rounded to the nearest bfloat16 value (ties to even, overflow to +-inf), as a double.
double ref_bf16_round(double v);
/// Value of an IEEE half bit pattern.
double ref_fp16_decode(std::uint16_t bits);
/// v rounded to the nearest IEEE half value (ties to even, overflow to +-inf), as a double.
double ref_fp16_round(double v);

/// Dense set of float bit patterns for conversion sweeps: all 2^32 patterns with stride 4096, every
/// pattern within +-64 ulps of each fp8 value and each midpoint between neighbouring fp8 values
/// (both signs), every float in [448, 480] (both signs), strided float subnormals, +-0, +-inf and
/// NaNs of both signs.
std::vector<std::uint32_t> fp8_sweep_bits();

/// Quantized tensor as semantics §6 defines it, row-major: q [T, H], scales [T, G] or words [T, W].
struct RefFp8 {
  std::int64_t T = 0, H = 0, G = 0, W = 0;
  std::vector<std::uint8_t> q;
  std::vector<float> scales;  ///< float32 scales (empty when ue8m0)
  std::vector<std::uint32_t> words;  ///< UE8M0 words (empty unless ue8m0)
  std::vector<double> group_scale;  ///< [T, G] the scale of every group, for either format
};
/// Per-token-group fp8 quantization of x [T, H] (values as float): a = max(amax, 1e-4) in float32;
/// q = fp8(x * (448 / a)) with the product in float32, scale = a / 448; round_scale:
/// scale = 2^ceil(log2(a / 448)), q = fp8(x / scale). Groups of 128, the last one partial.
RefFp8 ref_quantize_fp8(const std::vector<float>& x, std::int64_t T, std::int64_t H, bool round_scale, bool ue8m0);

}  // namespace epmoe::test
