// exp for router scores, with the same bits on the host and in CUDA kernels.
//
// Why not std::exp / expf: glibc's expf and CUDA's expf are different approximations (glibc is
// within 0.502 ulp, CUDA within 2 ulp), and they disagree on about 1 input in 10^4, so a softmax
// computed with them differs between devices. This one uses only IEEE double operations that round
// the same way everywhere (add, multiply, conversion; on the device through the _rn intrinsics, which
// the compiler never fuses into an FMA), so the CPU and CUDA routers agree bit for bit.
//
// Method (the classic one, e.g. Muller, "Elementary Functions", ch. 11): x = k ln2 + r with
// k = rint(x / ln2), |r| <= ln2 / 2; exp(r) by its Taylor series to degree 12 in double (truncation
// error below 2e-16 relative); exp(x) = 2^k exp(r), rounded once to float. The double result is within
// about 1e-15 relative of e^x, so the float result is the correctly rounded one except when e^x lies
// within that distance of a rounding boundary.
#pragma once

#include <epmoe/dtype.hpp>

#include <cstdint>

namespace epmoe::router_detail {

EPMOE_HD double exact_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
EPMOE_HD double exact_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
EPMOE_HD double round_to_int(double v) {
#if defined(__CUDA_ARCH__)
  return rint(v);
#else
  return std::nearbyint(v);  // the default rounding mode: to nearest, ties to even
#endif
}

/// e^x in float32, identical on host and device. NaN -> the same NaN, quieted; overflow -> +inf;
/// underflow -> +0 or a float subnormal, rounded once.
EPMOE_HD float score_exp(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bits_float(u | 0x00400000u);
  if (x > 89.0f) return bits_float(0x7f800000u);  // e^89 > FLT_MAX (e^88.73)
  if (x < -104.0f) return 0.0f;                   // e^-104 < 2^-150: below half the least subnormal
  constexpr double kLog2e = 1.4426950408889634;   // 1 / ln 2
  constexpr double kLn2 = 0.6931471805599453;
  const double xd = static_cast<double>(x);
  const double k = round_to_int(exact_mul(xd, kLog2e));
  // |k| <= 150: k * ln2 has a rounding error below 2^-45, far under a float ulp of the result.
  const double r = exact_add(xd, -exact_mul(k, kLn2));
  // Taylor series, Horner form: 1 + r (1 + r/2 (1 + r/3 (... (1 + r/12)))).
  double p = 1.0;
  for (int n = 12; n >= 1; --n) p = exact_add(1.0, exact_mul(exact_mul(r, p), 1.0 / n));
  // 2^k as a double: -151 <= k <= 129 is inside the normal double range.
  const auto ki = static_cast<std::int64_t>(k);
  double two_k;
  const std::uint64_t bits = static_cast<std::uint64_t>(ki + 1023) << 52;
  static_assert(sizeof(double) == sizeof(std::uint64_t));
  std::memcpy(&two_k, &bits, sizeof two_k);
  return static_cast<float>(exact_mul(p, two_k));
}

/// 1 / (1 + e^-x) in float32, identical on host and device.
EPMOE_HD float score_sigmoid(float x) { return 1.0f / (1.0f + score_exp(-x)); }

}  // namespace epmoe::router_detail
