// The branch-free fp8 converter of the CPU quantization loops gives the same bits as
// epmoe::float_to_fp8_e4m3 (itself checked against CUDA in tests/core) and as the reference.
#include <gtest/gtest.h>

#include <epmoe/dtype.hpp>

#include "quant/fp8_cpu.hpp"
#include "support/quant_reference.hpp"

namespace epmoe {
namespace {

TEST(Fp8VectorConverter, DenseSweepMatchesScalarConverterAndReference) {
  const auto sweep = test::fp8_sweep_bits();
  for (std::uint32_t u : sweep) {
    const float f = bits_float(u);
    const std::uint8_t got = quant_detail::fp8_e4m3_from_float_vec(f);
    ASSERT_EQ(got, float_to_fp8_e4m3(f).bits) << "float bits 0x" << std::hex << u;
    ASSERT_EQ(got, test::ref_fp8_encode(static_cast<double>(f))) << "float bits 0x" << std::hex << u;
  }
}

}  // namespace
}  // namespace epmoe
