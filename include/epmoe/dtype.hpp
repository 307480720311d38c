// Element types and their scalar conversions.
//
// The conversions are the project's single definition of rounding: bf16 and fp8 e4m3 both round to
// nearest, ties to even, and fp8 saturates to +-448 (semantics §6). They are host/device inline so CUDA
// kernels and CPU code produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <string_view>

#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ __forceinline__
#else
#define EPMOE_HD inline
#endif

namespace epmoe {

/// Element type of a tensor. Names follow PyTorch's (`bfloat16` is `bf16`, `float8_e4m3fn` is `fp8_e4m3`).
/// `uint8` holds packed sub-byte codes (NVFP4's two e2m1 values per byte, nvfp4.hpp); `uint32` the completion
/// counters of an overlapped combine's per-expert form (buffer.hpp, LowLatencyCombineArgs::src_signals).
enum class DType : std::uint8_t { bf16, fp16, fp32, fp8_e4m3, int8, int16, int32, int64, boolean, uint8, uint32 };

/// Size of one element in bytes.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::bf16: case DType::fp16: case DType::int16: return 2;
    case DType::fp32: case DType::int32: case DType::uint32: return 4;
    case DType::int64: return 8;
    case DType::fp8_e4m3: case DType::int8: case DType::boolean: case DType::uint8: return 1;
  }
  return 0;
}

/// Lower-case name as PyTorch spells it ("bfloat16", "float8_e4m3fn", ...), for error messages and JSON.
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bfloat16";
    case DType::fp16: return "float16";
    case DType::fp32: return "float32";
    case DType::fp8_e4m3: return "float8_e4m3fn";
    case DType::int8: return "int8";
    case DType::int16: return "int16";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::boolean: return "bool";
    case DType::uint8: return "uint8";
    case DType::uint32: return "uint32";
  }
  return "?";
}

/// Storage types for the 16- and 8-bit floats; arithmetic happens in float after conversion.
struct bf16_t { std::uint16_t bits; };
struct fp16_t { std::uint16_t bits; };
struct fp8_e4m3_t { std::uint8_t bits; };

template <class T> struct dtype_of;
template <> struct dtype_of<bf16_t> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<fp16_t> { static constexpr DType value = DType::fp16; };
template <> struct dtype_of<float> { static constexpr DType value = DType::fp32; };
template <> struct dtype_of<fp8_e4m3_t> { static constexpr DType value = DType::fp8_e4m3; };
template <> struct dtype_of<std::int8_t> { static constexpr DType value = DType::int8; };
template <> struct dtype_of<std::int16_t> { static constexpr DType value = DType::int16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::int32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::int64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::boolean; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::uint8; };
template <> struct dtype_of<std::uint32_t> { static constexpr DType value = DType::uint32; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

EPMOE_HD std::uint32_t float_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
EPMOE_HD float bits_float(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

/// float -> bf16, round to nearest even; NaN stays a (quiet) NaN with its sign.
EPMOE_HD bf16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<std::uint16_t>(u >> 16)};
}
EPMOE_HD float bf16_to_float(bf16_t b) { return bits_float(static_cast<std::uint32_t>(b.bits) << 16); }

/// Largest finite fp8 e4m3 value (OCP "fn" variant: no infinities, 0x7f/0xff are NaN).
inline constexpr float kFp8E4m3Max = 448.0f;

/// float -> fp8 e4m3, round to nearest even, saturating to +-448; NaN -> 0x7f.
/// Bit-exact with CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) (tested over a dense sweep).
EPMOE_HD fp8_e4m3_t float_to_fp8_e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp8_e4m3_t{0x7f};
  // 464 = halfway between 448 and the (NaN) next step 480: ties-to-even keeps 448, so only > 464
  // would round up, and saturation maps everything >= 448 to 448 anyway.
  if (a >= 0x43e00000u) return fp8_e4m3_t{static_cast<std::uint8_t>(sign | 0x7e)};
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // Subnormal range (step 2^-9): scale so one step is 1.0 and round; 8 steps spill into the
    // smallest normal, whose encoding is the same integer 8.
    const float q = ::nearbyintf(bits_float(a) * 512.0f);
    return fp8_e4m3_t{static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(q))};
  }
  // Normal: keep 3 mantissa bits with round-to-nearest-even on the 20 dropped bits.
  std::uint32_t m = a & 0x7fffffu;
  std::uint32_t e = static_cast<std::uint32_t>(exp + 7);
  const std::uint32_t drop = m & 0xfffffu, keep = m >> 20;
  std::uint32_t r = keep + ((drop > 0x80000u || (drop == 0x80000u && (keep & 1u))) ? 1u : 0u);
  if (r == 8u) { r = 0; ++e; }
  std::uint32_t bits = (e << 3) | r;
  if (bits > 0x7eu) bits = 0x7eu;
  return fp8_e4m3_t{static_cast<std::uint8_t>(sign | bits)};
}

/// fp8 e4m3 -> float (exact).
EPMOE_HD float fp8_e4m3_to_float(fp8_e4m3_t v) {
  const std::uint32_t sign = (v.bits & 0x80u) ? 0x80000000u : 0u;
  const std::uint32_t e = (v.bits >> 3) & 0xfu, m = v.bits & 0x7u;
  if (e == 0xf && m == 0x7) return bits_float(0x7fc00000u | sign);
  if (e == 0) {  // subnormal: m * 2^-9
    const float mag = static_cast<float>(m) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

/// float -> fp16 (IEEE half), round to nearest even; for completeness of the dtype set.
EPMOE_HD fp16_t float_to_fp16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16_t{static_cast<std::uint16_t>(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return fp16_t{static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -14) {
    const float q = ::nearbyintf(bits_float(a) * 16777216.0f);  // step 2^-24
    return fp16_t{static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q))};
  }
  const std::uint32_t m = a & 0x7fffffu, drop = m & 0x1fffu, keep = m >> 13;
  std::uint32_t bits = (static_cast<std::uint32_t>(exp + 15) << 10) + keep;
  bits += (drop > 0x1000u || (drop == 0x1000u && (keep & 1u))) ? 1u : 0u;
  return fp16_t{static_cast<std::uint16_t>(sign | bits)};
}
EPMOE_HD float fp16_to_float(fp16_t h) {
  const std::uint32_t sign = (h.bits & 0x8000u) ? 0x80000000u : 0u;
  const std::uint32_t e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
  if (e == 0) { const float mag = static_cast<float>(m) * (1.0f / 16777216.0f); return sign ? -mag : mag; }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace epmoe
