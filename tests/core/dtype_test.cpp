#include <gtest/gtest.h>
#include <epmoe/dtype.hpp>
TEST(Dtype, Bf16RoundTrip) { EXPECT_EQ(epmoe::bf16_to_float(epmoe::float_to_bf16(1.5f)), 1.5f); }
