// epmoe's float -> fp8 e4m3 conversion is bit-exact with CUDA's own host-callable converter
// __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) (semantics §6), and its decoder with CUDA's.
// Runs on the host: no GPU needed. Built only when CUDA is enabled.
#include <gtest/gtest.h>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <epmoe/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "support/quant_reference.hpp"

namespace {

std::uint8_t cuda_encode(float f) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

TEST(Fp8CudaParity, DenseSweepMatchesNvCvtFloatToFp8) {
  const auto sweep = epmoe::test::fp8_sweep_bits();
  ASSERT_GT(sweep.size(), 3'000'000u);
  std::size_t mismatches = 0;
  for (std::uint32_t u : sweep) {
    const float f = epmoe::bits_float(u);
    const std::uint8_t want = cuda_encode(f), got = epmoe::float_to_fp8_e4m3(f).bits;
    if (want != got && ++mismatches <= 10)
      ADD_FAILURE() << "float bits 0x" << std::hex << u << ": CUDA 0x" << int(want) << ", epmoe 0x" << int(got);
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Fp8CudaParity, SpecialValues) {
  for (float f : {0.0f, -0.0f, 448.0f, -448.0f, 464.0f, 480.0f, 1e30f, INFINITY, -INFINITY, NAN, -NAN, 1.0625f,
                  0.0009765625f, 0.00048828125f})
    EXPECT_EQ(epmoe::float_to_fp8_e4m3(f).bits, cuda_encode(f)) << f;
}

TEST(Fp8CudaParity, DecodeMatchesCudaForAll256Codes) {
  for (int c = 0; c < 256; ++c) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    __half hv;
    std::memcpy(&hv, &h, sizeof(hv));
    const float want = __half2float(hv);
    const float got = epmoe::fp8_e4m3_to_float(epmoe::fp8_e4m3_t{static_cast<std::uint8_t>(c)});
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(got, want) << "code " << c;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << c;
    }
  }
}

}  // namespace
