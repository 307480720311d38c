#include "support/quant_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace epmoe::test {

namespace {

// |v| rounded to `mant_bits` fractional mantissa bits, nearest, ties to even; exponents below
// `min_exp` use the subnormal step 2^(min_exp - mant_bits). No overflow handling.
double round_nearest_even(double v, int mant_bits, int min_exp) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  const double mag = std::fabs(v);
  int p = 0;
  std::frexp(mag, &p);  // mag = f * 2^p with f in [0.5, 1): floor(log2(mag)) = p - 1
  const int e = std::max(p - 1, min_exp);
  const double step = std::ldexp(1.0, e - mant_bits);
  const double q = mag / step;  // exact: division by a power of two
  double n = std::floor(q);
  const double frac = q - n;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(n, 2.0) == 1.0)) n += 1.0;
  return std::copysign(n * step, v);
}

double decode_ieee(std::uint32_t bits, int exp_bits, int mant_bits) {
  const bool neg = (bits >> (exp_bits + mant_bits)) & 1u;
  const std::uint32_t e = (bits >> mant_bits) & ((1u << exp_bits) - 1u);
  const std::uint32_t m = bits & ((1u << mant_bits) - 1u);
  const int bias = (1 << (exp_bits - 1)) - 1;
  double v;
  if (e == (1u << exp_bits) - 1u)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), 1 - bias - mant_bits);
  else
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mant_bits), static_cast<int>(e) - bias);
  return neg ? -v : v;
}

double round_ieee(double v, int exp_bits, int mant_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const double r = round_nearest_even(v, mant_bits, 1 - bias);
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mant_bits), bias);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}

}  // namespace

double ref_fp8_decode(std::uint8_t code) {
  const bool neg = code & 0x80u;
  const int e = (code >> 3) & 0xf, m = code & 0x7;
  double v;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0)
    v = m / 8.0 * std::ldexp(1.0, -6);
  else
    v = (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return neg ? -v : v;
}

std::uint8_t ref_fp8_encode(double v) {
  if (std::isnan(v)) return 0x7f;
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double mag = std::fabs(v);
  if (mag >= 448.0) return static_cast<std::uint8_t>(sign | 0x7e);  // saturate (SATFINITE), incl. inf
  const double r = round_nearest_even(mag, 3, -6);
  if (r >= 448.0) return static_cast<std::uint8_t>(sign | 0x7e);
  for (int c = 0; c <= 0x7e; ++c)
    if (ref_fp8_decode(static_cast<std::uint8_t>(c)) == r) return static_cast<std::uint8_t>(sign | c);
  return 0xff;  // unreachable: every rounded value below 448 is an fp8 value
}

double ref_bf16_decode(std::uint16_t bits) { return decode_ieee(bits, 8, 7); }
double ref_bf16_round(double v) { return round_ieee(v, 8, 7); }
double ref_fp16_decode(std::uint16_t bits) { return decode_ieee(bits, 5, 10); }
double ref_fp16_round(double v) { return round_ieee(v, 5, 10); }

std::vector<std::uint32_t> fp8_sweep_bits() {
  std::vector<std::uint32_t> out;
  out.reserve(5u << 20);
  for (std::uint64_t b = 0; b < (1ull << 32); b += 4096) out.push_back(static_cast<std::uint32_t>(b));
  auto float_bits = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  // Each fp8 value and each midpoint between neighbours (the rounding boundaries), +-64 ulps.
  for (int c = 0; c <= 0x7e; ++c) {
    const double lo = ref_fp8_decode(static_cast<std::uint8_t>(c));
    const double hi = c < 0x7e ? ref_fp8_decode(static_cast<std::uint8_t>(c + 1)) : 480.0;
    for (double point : {lo, (lo + hi) / 2}) {
      const std::uint32_t center = float_bits(static_cast<float>(point));
      for (int d = -64; d <= 64; ++d) {
        const std::int64_t b = static_cast<std::int64_t>(center) + d;
        if (b < 0 || b > 0x7f800000) continue;
        out.push_back(static_cast<std::uint32_t>(b));
        out.push_back(static_cast<std::uint32_t>(b) | 0x80000000u);
      }
    }
  }
  // The saturation range: every float in [448, 480].
  for (std::uint32_t b = float_bits(448.0f); b <= float_bits(480.0f); ++b) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  // Float subnormals, zeros, infinities, NaNs.
  for (std::uint32_t b = 0; b < 0x00800000u; b += 997) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  for (std::uint32_t b : {0x00000001u, 0x007fffffu, 0x00000000u, 0x7f800000u, 0x7f7fffffu, 0x7f800001u, 0x7fc00000u,
                          0x7fffffffu, 0x7fa00000u}) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  return out;
}

RefFp8 ref_quantize_fp8(const std::vector<float>& x, std::int64_t T, std::int64_t H, bool round_scale, bool ue8m0) {
  RefFp8 r;
  r.T = T;
  r.H = H;
  r.G = (H + 127) / 128;
  r.W = (r.G + 3) / 4;
  r.q.assign(static_cast<std::size_t>(T * H), 0);
  r.group_scale.assign(static_cast<std::size_t>(T * r.G), 0.0);
  if (ue8m0)
    r.words.assign(static_cast<std::size_t>(T * r.W), 0u);
  else
    r.scales.assign(static_cast<std::size_t>(T * r.G), 0.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t g = 0; g < r.G; ++g) {
      const std::int64_t begin = g * 128, end = std::min(H, begin + 128);
      double amax = 0.0;
      for (std::int64_t i = begin; i < end; ++i) {
        const double v = std::fabs(static_cast<double>(x[static_cast<std::size_t>(t * H + i)]));
        if (v > amax) amax = v;
      }
      // semantics §6 computes a, 448 / a and a / 448 in float32.
      const float a = std::max(static_cast<float>(amax), static_cast<float>(1e-4));
      double scale;
      if (!round_scale) {
        const float mult = 448.0f / a;
        scale = static_cast<double>(a / 448.0f);
        for (std::int64_t i = begin; i < end; ++i) {
          const std::size_t k = static_cast<std::size_t>(t * H + i);
          const float y = x[k] * mult;
          r.q[k] = ref_fp8_encode(static_cast<double>(y));
        }
        r.scales[static_cast<std::size_t>(t * r.G + g)] = static_cast<float>(scale);
      } else {
        const float c = a / 448.0f;
        int p = 0;
        const double f = std::frexp(static_cast<double>(c), &p);  // c = f * 2^p, f in [0.5, 1)
        const int e = f == 0.5 ? p - 1 : p;  // ceil(log2(c))
        scale = std::ldexp(1.0, e);
        for (std::int64_t i = begin; i < end; ++i) {
          const std::size_t k = static_cast<std::size_t>(t * H + i);
          const float y = static_cast<float>(static_cast<double>(x[k]) / scale);
          r.q[k] = ref_fp8_encode(static_cast<double>(y));
        }
        if (ue8m0)
          r.words[static_cast<std::size_t>(t * r.W + g / 4)] |= static_cast<std::uint32_t>(e + 127) << (8 * (g % 4));
        else
          r.scales[static_cast<std::size_t>(t * r.G + g)] = static_cast<float>(scale);
      }
      r.group_scale[static_cast<std::size_t>(t * r.G + g)] = scale;
    }
  }
  return r;
}

}  // namespace epmoe::test
