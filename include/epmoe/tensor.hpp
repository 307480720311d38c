// Tensor views and owning tensors.
//
// A TensorView is a non-owning (pointer, dtype, shape, strides, device) record: what crosses the API.
// A Tensor owns its storage (host memory, or device memory in CUDA builds) and converts to a view.
// Strides are in elements, as in PyTorch and DLPack.
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/error.hpp>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace epmoe {

/// Where a tensor's memory lives.
enum class DeviceType : std::uint8_t { cpu, cuda };
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  static Device cpu() { return {}; }
  static Device cuda(int i) { return {DeviceType::cuda, i}; }
};
std::string to_string(Device d);

/// Up to 4 dimensions (the widest tensor of the API is 3-d: [E_local, R*Tmax, H]).
class Shape {
 public:
  static constexpr int kMaxDims = 4;
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  int ndim() const { return ndim_; }
  std::int64_t operator[](int i) const { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t numel() const;
  bool operator==(const Shape& o) const;
  /// Row-major strides for this shape.
  Shape contiguous_strides() const;

 private:
  std::array<std::int64_t, kMaxDims> d_{};
  int ndim_ = 0;
};
std::string to_string(const Shape& s);

/// Non-owning view of a strided tensor. An empty view (data == nullptr, ndim 0) means "absent".
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::fp32;
  Shape shape;
  Shape strides;  ///< in elements
  Device device;

  TensorView() = default;
  TensorView(void* p, DType t, Shape s, Device d = {}) : data(p), dtype(t), shape(s), strides(s.contiguous_strides()), device(d) {}
  TensorView(void* p, DType t, Shape s, Shape st, Device d) : data(p), dtype(t), shape(s), strides(st), device(d) {}

  bool defined() const { return data != nullptr || shape.ndim() > 0; }
  int ndim() const { return shape.ndim(); }
  std::int64_t size(int i) const { return shape[i < 0 ? i + ndim() : i]; }
  std::int64_t stride(int i) const { return strides[i < 0 ? i + ndim() : i]; }
  std::int64_t numel() const { return shape.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;

  /// Typed pointer; throws internal error if T does not match dtype.
  template <class T> T* ptr() const {
    EPMOE_ASSERT(dtype_of_v<T> == dtype || (sizeof(T) == dtype_size(dtype) && std::is_integral_v<T> && !std::is_same_v<T, bool>));
    return static_cast<T*>(data);
  }
  /// Row `i` of dimension 0, as a view of the remaining dimensions.
  TensorView row(std::int64_t i) const;
  /// Rows [begin, end) of dimension 0.
  TensorView slice_rows(std::int64_t begin, std::int64_t end) const;
};
std::string describe(const TensorView& t);  ///< "bfloat16[4, 128] cpu"

/// Owning tensor: shared storage plus a view of it. Copying a Tensor shares the storage.
class Tensor {
 public:
  Tensor() = default;
  /// Allocates uninitialised storage: 64-byte aligned on the host; on a CUDA device, stream-ordered from the
  /// device's memory pool (cudaMallocAsync; freed blocks are kept and reused, like PyTorch's caching
  /// allocator). A CUDA tensor is allocated on the calling thread's current stream (stream.hpp) and is valid
  /// for work on that stream, or on streams that wait for it. Its memory returns to the pool on the current
  /// stream of the thread that drops the last reference: drop a tensor only after the work that uses it was
  /// enqueued on (or ordered before) that stream, the rule PyTorch's record_stream exists for.
  /// Errors: out_of_memory naming the size and device; unsupported for a CUDA device in a CPU-only build.
  static Tensor empty(DType dtype, Shape shape, Device device = {});
  static Tensor zeros(DType dtype, Shape shape, Device device = {});
  /// Wraps storage owned elsewhere; `keep_alive` is held as long as the tensor lives.
  static Tensor wrap(TensorView view, std::shared_ptr<void> keep_alive);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  bool defined() const { return view_.defined(); }
  template <class T> T* ptr() const { return view_.ptr<T>(); }
  void* data() const { return view_.data; }
  DType dtype() const { return view_.dtype; }
  const Shape& shape() const { return view_.shape; }
  std::int64_t size(int i) const { return view_.size(i); }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }
  Device device() const { return view_.device; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

}  // namespace epmoe

