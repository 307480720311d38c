// Independent NVFP4 reference: see nvfp4_reference.hpp.
#include "support/nvfp4_reference.hpp"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "support/quant_reference.hpp"

namespace epmoe::test {

namespace {

constexpr double kGrid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

float f32(double v) { return static_cast<float>(v); }  // one rounding to float32

}  // namespace

double ref_e2m1_decode(std::uint8_t code) {
  const double v = kGrid[code & 0x7u];
  return (code & 0x8u) ? -v : v;
}

std::uint8_t ref_e2m1_encode(double v) {
  if (std::isnan(v)) return 0x7;
  const std::uint8_t sign = std::signbit(v) ? 0x8 : 0x0;
  const double mag = std::fabs(v);
  if (mag > 6.0) return static_cast<std::uint8_t>(sign | 0x7);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(mag - kGrid[c]), db = std::fabs(mag - kGrid[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

std::int64_t ref_swizzled_offset(std::int64_t row, std::int64_t col, std::int64_t col_tiles) {
  // Physical dims (tile row a, tile column b, c = row % 32, d = (row % 128) / 32, e = col % 4), row-major.
  const std::int64_t a = row / 128, b = col / 4, c = row % 32, d = (row % 128) / 32, e = col % 4;
  return (((a * col_tiles + b) * 32 + c) * 4 + d) * 4 + e;
}

RefNvfp4 ref_quantize_nvfp4(const std::vector<float>& x, std::int64_t T, std::int64_t H, float gs) {
  RefNvfp4 r;
  r.T = T;
  r.H = H;
  const std::int64_t B = H / 16;
  r.q.assign(static_cast<std::size_t>(T * H / 2), 0);
  r.scales.assign(static_cast<std::size_t>(T * B), 0);
  r.step.assign(static_cast<std::size_t>(T * B), 0.0);
  r.amax.assign(static_cast<std::size_t>(T * B), 0.0);
  r.dequantized.assign(static_cast<std::size_t>(T * H), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t b = 0; b < B; ++b) {
      double amax = 0.0;
      for (int i = 0; i < 16; ++i) {
        const double v = x[static_cast<std::size_t>(t * H + b * 16 + i)];
        if (!std::isnan(v)) amax = std::fmax(amax, std::fabs(v));
      }
      const float s = f32(static_cast<double>(f32(amax / 6.0)) * gs);
      const std::uint8_t sf = ref_fp8_encode(s);
      const double sfv = ref_fp8_decode(sf);
      const double m = sfv > 0.0 ? std::fmin(static_cast<double>(f32(gs / sfv)), static_cast<double>(FLT_MAX)) : 0.0;
      const double step = f32(sfv / gs);
      const std::size_t k = static_cast<std::size_t>(t * B + b);
      r.scales[k] = sf;
      r.step[k] = step;
      r.amax[k] = amax;
      for (int i = 0; i < 16; ++i) {
        const std::size_t at = static_cast<std::size_t>(t * H + b * 16 + i);
        const std::uint8_t code = ref_e2m1_encode(f32(x[at] * m));
        r.q[at / 2] = static_cast<std::uint8_t>(r.q[at / 2] | (i % 2 == 0 ? code : code << 4));
        r.dequantized[at] = f32(ref_e2m1_decode(code) * step);
      }
    }
  return r;
}

std::vector<std::uint8_t> ref_swizzle(const std::vector<std::uint8_t>& linear, std::int64_t T, std::int64_t H) {
  const std::int64_t B = H / 16, col_tiles = (B + 3) / 4, row_tiles = (T + 127) / 128;
  std::vector<std::uint8_t> out(static_cast<std::size_t>(row_tiles * col_tiles * 512), 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t b = 0; b < B; ++b)
      out[static_cast<std::size_t>(ref_swizzled_offset(t, b, col_tiles))] = linear[static_cast<std::size_t>(t * B + b)];
  return out;
}

std::vector<std::uint32_t> e2m1_sweep_bits() {
  auto bits = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  std::vector<std::uint32_t> out;
  for (std::uint64_t b = 0; b < (1ull << 32); b += 65536) out.push_back(static_cast<std::uint32_t>(b));
  for (int c = 0; c < 8; ++c) {
    const double lo = kGrid[c], hi = c < 7 ? kGrid[c + 1] : 7.0;
    for (double point : {lo, (lo + hi) / 2})
      for (int d = -4096; d <= 4096; ++d) {
        const std::int64_t b = static_cast<std::int64_t>(bits(static_cast<float>(point))) + d;
        if (b < 0 || b > 0x7f800000) continue;
        out.push_back(static_cast<std::uint32_t>(b));
        out.push_back(static_cast<std::uint32_t>(b) | 0x80000000u);
      }
  }
  for (std::uint32_t b = 0; b < 0x00800000u; b += 4099) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  for (std::uint32_t b : {0x00000000u, 0x00000001u, 0x7f800000u, 0x7f7fffffu, 0x7f800001u, 0x7fc00000u, 0x7fffffffu})
    for (std::uint32_t s : {0u, 0x80000000u}) out.push_back(b | s);
  return out;
}

}  // namespace epmoe::test
