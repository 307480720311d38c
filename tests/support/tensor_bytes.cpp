#include "support/tensor_bytes.hpp"

#include <gtest/gtest.h>

#include <cstring>

namespace epmoe::test {

const std::byte* element_at(const TensorView& v, std::int64_t i) {
  std::int64_t offset = 0;
  for (int d = v.ndim() - 1; d >= 0; --d) {
    offset += (i % v.shape[d]) * v.strides[d];
    i /= v.shape[d];
  }
  return static_cast<const std::byte*>(v.data) + offset * static_cast<std::int64_t>(dtype_size(v.dtype));
}

InputBytes& InputBytes::add(std::string name, const TensorView& v) {
  if (!v.defined()) return *this;
  Entry e{std::move(name), v, {}};
  const std::size_t es = dtype_size(v.dtype);
  e.bytes.resize(v.nbytes());
  for (std::int64_t i = 0; i < v.numel(); ++i) std::memcpy(e.bytes.data() + i * es, element_at(v, i), es);
  entries_.push_back(std::move(e));
  return *this;
}

void InputBytes::expect_unchanged() const {
  for (const Entry& e : entries_) {
    const std::size_t es = dtype_size(e.view.dtype);
    for (std::int64_t i = 0; i < e.view.numel(); ++i)
      if (std::memcmp(e.bytes.data() + i * es, element_at(e.view, i), es) != 0) {
        ADD_FAILURE() << "input '" << e.name << "' (" << describe(e.view) << ") was written: element " << i
                      << " differs from its bytes before the call";
        break;
      }
  }
}

}  // namespace epmoe::test
