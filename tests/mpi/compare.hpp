// Bit-for-bit comparison of tensors for the MPI-vs-threads tests.
#pragma once

#include <epmoe/tensor.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "support/tensor_bytes.hpp"

namespace epmoe::test {

/// Same definedness, dtype, shape and bytes of every element (strides may differ).
inline ::testing::AssertionResult same_tensor(const TensorView& got, const TensorView& want) {
  if (got.defined() != want.defined())
    return ::testing::AssertionFailure() << "defined: got " << got.defined() << ", want " << want.defined();
  if (!got.defined()) return ::testing::AssertionSuccess();
  if (got.dtype != want.dtype)
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got.dtype) << " != " << dtype_name(want.dtype);
  if (!(got.shape == want.shape))
    return ::testing::AssertionFailure() << "shape " << to_string(got.shape) << " != " << to_string(want.shape);
  const std::size_t es = dtype_size(got.dtype);
  for (std::int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(element_at(got, i), element_at(want, i), es) != 0)
      return ::testing::AssertionFailure() << "element " << i << " of " << to_string(got.shape) << " differs";
  return ::testing::AssertionSuccess();
}

}  // namespace epmoe::test
