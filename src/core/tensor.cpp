#include "core/check.hpp"
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace epmoe {

std::string to_string(Device d) { return d.is_cpu() ? "cpu" : fmt::format("cuda:{}", d.index); }

Shape::Shape(std::initializer_list<std::int64_t> dims) {
  EPMOE_ASSERT(dims.size() <= kMaxDims);
  for (auto v : dims) d_[static_cast<std::size_t>(ndim_++)] = v;
}

std::int64_t Shape::numel() const {
  for (int i = 0; i < ndim_; ++i)
    if (d_[static_cast<std::size_t>(i)] == 0) return 0;  // before multiplying: [huge, huge, 0] is empty, not UB
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= d_[static_cast<std::size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if ((*this)[i] != o[i]) return false;
  return true;
}

Shape Shape::contiguous_strides() const {
  Shape s = *this;
  std::int64_t acc = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= (*this)[i];
  }
  return s;
}

std::string to_string(const Shape& s) {
  std::string out = "[";
  for (int i = 0; i < s.ndim(); ++i) out += fmt::format("{}{}", i ? ", " : "", s[i]);
  return out + "]";
}

bool TensorView::is_contiguous() const {
  // An empty tensor has no element to misplace (NumPy's DLPack export gives it zero strides).
  if (numel() == 0) return true;
  std::int64_t acc = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != acc) return false;
    acc *= shape[i];
  }
  return true;
}

TensorView TensorView::row(std::int64_t i) const {
  EPMOE_ASSERT(ndim() >= 1 && i >= 0 && i < shape[0]);
  TensorView v;
  v.data = static_cast<char*>(data) + i * strides[0] * static_cast<std::int64_t>(dtype_size(dtype));
  v.dtype = dtype;
  v.device = device;
  Shape s, st;
  if (ndim() == 1) { s = Shape{}; st = Shape{}; }
  else if (ndim() == 2) { s = Shape{shape[1]}; st = Shape{strides[1]}; }
  else if (ndim() == 3) { s = Shape{shape[1], shape[2]}; st = Shape{strides[1], strides[2]}; }
  else { s = Shape{shape[1], shape[2], shape[3]}; st = Shape{strides[1], strides[2], strides[3]}; }
  v.shape = s;
  v.strides = st;
  return v;
}

TensorView TensorView::slice_rows(std::int64_t begin, std::int64_t end) const {
  EPMOE_ASSERT(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape[0]);
  TensorView v = *this;
  v.data = static_cast<char*>(data) + begin * strides[0] * static_cast<std::int64_t>(dtype_size(dtype));
  v.shape[0] = end - begin;
  return v;
}

std::string describe(const TensorView& t) {
  if (!t.defined()) return "None";
  return fmt::format("{}{} {}", dtype_name(t.dtype), to_string(t.shape), to_string(t.device));
}

// core/memory.cu (stream-ordered pool), or the stubs below. device_alloc reports the stream it allocated on.
void* device_alloc(std::size_t bytes, Device d, void** alloc_stream);
void device_free(void* p, Device d, void* alloc_stream) noexcept;

Tensor Tensor::empty(DType dtype, Shape shape, Device device) {
  // The byte count is checked as it is built: a shape whose size does not fit in size_t (a caller's arithmetic
  // gone wrong, or a user's huge setting) is an allocation that cannot succeed, reported with the shape.
  std::size_t bytes = dtype_size(dtype);
  bool overflow = false, has_zero = false;
  for (int i = 0; i < shape.ndim(); ++i) {
    EPMOE_ASSERT(shape[i] >= 0);
    has_zero = has_zero || shape[i] == 0;
    overflow = __builtin_mul_overflow(bytes, static_cast<std::size_t>(shape[i]), &bytes) || overflow;
  }
  if (has_zero) bytes = 0;  // an empty tensor never overflows
  else if (overflow || bytes > SIZE_MAX - 63)  // 63: the host allocation rounds up to 64 bytes
    raise(ErrorCode::out_of_memory, "a {} tensor of shape {} needs more than 2^64 bytes", dtype_name(dtype),
          to_string(shape));
  Tensor t;
  if (device.is_cpu()) {
    const std::size_t rounded = ((bytes + 63) / 64) * 64;
    void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
    if (rounded && !p) raise(ErrorCode::out_of_memory, "host allocation of {} bytes failed", bytes);
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    void* stream = nullptr;
    void* p = bytes ? device_alloc(bytes, device, &stream) : nullptr;
    t.storage_ = std::shared_ptr<void>(p, [device, stream](void* q) { if (q) device_free(q, device, stream); });
  }
  t.view_ = TensorView(t.storage_.get(), dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape, Device device) {
  Tensor t = empty(dtype, shape, device);
  EPMOE_ASSERT(device.is_cpu());  // device zeros go through the CUDA stage helpers
  if (t.nbytes()) std::memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::wrap(TensorView view, std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.storage_ = std::move(keep_alive);
  t.view_ = view;
  return t;
}

#if !defined(EPMOE_HAVE_CUDA)
void* device_alloc(std::size_t, Device d, void**) {
  raise(ErrorCode::unsupported, "device {} requested but epmoe was built without CUDA", to_string(d));
}
void device_free(void*, Device, void*) noexcept {}
#endif

}  // namespace epmoe
