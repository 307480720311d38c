// epmoe's float -> e2m1 conversion is bit-exact with CUDA's own host-callable converter
// __nv_cvt_float_to_fp4(v, __NV_E2M1, cudaRoundNearest) (semantics §6, "NVFP4"), and its decoder with CUDA's.
// Runs on the host: no GPU needed. Built only when CUDA is enabled.
#include <gtest/gtest.h>

#include <cuda_fp16.h>
#include <cuda_fp4.h>

#include <epmoe/nvfp4.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "support/nvfp4_reference.hpp"

namespace {

std::uint8_t cuda_encode(float f) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp4(f, __NV_E2M1, cudaRoundNearest) & 0xfu);
}

TEST(Nvfp4CudaParity, DenseSweepMatchesNvCvtFloatToFp4) {
  const auto sweep = epmoe::test::e2m1_sweep_bits();
  std::size_t mismatches = 0;
  for (std::uint32_t u : sweep) {
    const float f = epmoe::bits_float(u);
    const std::uint8_t want = cuda_encode(f), got = epmoe::float_to_e2m1(f);
    if (want != got && ++mismatches <= 10)
      ADD_FAILURE() << "float bits 0x" << std::hex << u << ": CUDA 0x" << int(want) << ", epmoe 0x" << int(got);
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Nvfp4CudaParity, DecodeMatchesCudaForAll16Codes) {
  for (int c = 0; c < 16; ++c) {
    const __half_raw h = __nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1);
    __half hv;
    std::memcpy(&hv, &h, sizeof(hv));
    const float want = __half2float(hv), got = epmoe::e2m1_to_float(static_cast<std::uint8_t>(c));
    EXPECT_EQ(got, want) << "code " << c;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << c;
  }
}

}  // namespace
