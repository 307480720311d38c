// Raw bytes of host tensors for the tests: one element through its strides, and the bytes of a call's inputs copied
// before the call, to check that it wrote none of them (semantics §1: inputs are never written).
#pragma once

#include <epmoe/tensor.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace epmoe::test {

/// Element `i` (row-major over the shape) of a strided view, as raw bytes.
const std::byte* element_at(const TensorView& v, std::int64_t i);

class InputBytes {
 public:
  /// Copies the bytes of every element of `v` (any strides; an undefined view is skipped).
  InputBytes& add(std::string name, const TensorView& v);
  /// Adds a test failure naming each input whose elements no longer hold the bytes copied, and the first one changed.
  void expect_unchanged() const;

 private:
  struct Entry {
    std::string name;
    TensorView view;
    std::vector<std::byte> bytes;
  };
  std::vector<Entry> entries_;
};

}  // namespace epmoe::test
