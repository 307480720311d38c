#include "gpu/gpu_util.hpp"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace epmoe::gputest {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

std::size_t row_bytes(const TensorView& t) {
  std::size_t b = dtype_size(t.dtype);
  for (int i = 1; i < t.ndim(); ++i) b *= static_cast<std::size_t>(t.size(i));
  return b;
}

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

Tensor to_device(const TensorView& host) {
  Tensor d = Tensor::empty(host.dtype, host.shape, gpu());
  if (host.numel() == 0) return d;
  if (host.is_contiguous()) {
    check(cudaMemcpy(d.data(), host.data, host.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  } else {
    // Rows strided in dimension 0 only (what the tests build).
    const std::size_t rb = row_bytes(host);
    check(cudaMemcpy2D(d.data(), rb, host.data, static_cast<std::size_t>(host.stride(0)) * dtype_size(host.dtype), rb,
                       static_cast<std::size_t>(host.size(0)), cudaMemcpyHostToDevice),
          "cudaMemcpy2D H2D");
  }
  return d;
}

Tensor to_host(const TensorView& dev) {
  Tensor h = Tensor::empty(dev.dtype, dev.shape);
  if (dev.numel() == 0) return h;
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (dev.is_contiguous()) {
    check(cudaMemcpy(h.data(), dev.data, dev.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  } else {
    const std::size_t rb = row_bytes(dev);
    check(cudaMemcpy2D(h.data(), rb, dev.data, static_cast<std::size_t>(dev.stride(0)) * dtype_size(dev.dtype), rb,
                       static_cast<std::size_t>(dev.size(0)), cudaMemcpyDeviceToHost),
          "cudaMemcpy2D D2H");
  }
  return h;
}

void poison(const TensorView& dev) {
  if (!dev.defined() || dev.numel() == 0) return;
  std::size_t bytes = dev.nbytes();
  if (!dev.is_contiguous()) {  // every element the view spans (non-negative strides), the gaps between them too
    std::int64_t span = 1;
    for (int i = 0; i < dev.ndim(); ++i) span += (dev.size(i) - 1) * dev.stride(i);
    bytes = static_cast<std::size_t>(span) * dtype_size(dev.dtype);
  }
  check(cudaMemset(dev.data, 0xff, bytes), "cudaMemset");
}

void sync_ok() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaGetLastError(), "cudaGetLastError");
}

std::int64_t first_difference(const void* a, const void* b, std::size_t bytes) {
  if (std::memcmp(a, b, bytes) == 0) return -1;
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < bytes; ++i)
    if (x[i] != y[i]) return static_cast<std::int64_t>(i);
  return -1;
}

::testing::AssertionResult same_rows(const TensorView& want, const TensorView& got, std::int64_t rows) {
  if (want.dtype != got.dtype || !(want.shape == got.shape))
    return ::testing::AssertionFailure() << "shape/dtype differ: want " << describe(want) << ", got " << describe(got);
  if (!want.is_contiguous() || !got.is_contiguous())
    return ::testing::AssertionFailure() << "same_rows needs contiguous host tensors";
  const std::size_t rb = want.ndim() ? row_bytes(want) : dtype_size(want.dtype);
  const std::size_t bytes = want.ndim() ? rb * static_cast<std::size_t>(rows) : rb;
  if (bytes == 0) return ::testing::AssertionSuccess();
  const std::int64_t i = first_difference(want.data, got.data, bytes);
  if (i < 0) return ::testing::AssertionSuccess();
  const std::size_t es = dtype_size(want.dtype);
  const std::int64_t elem = i / static_cast<std::int64_t>(es);
  std::uint64_t w = 0, g = 0;
  std::memcpy(&w, static_cast<const char*>(want.data) + elem * static_cast<std::int64_t>(es), es);
  std::memcpy(&g, static_cast<const char*>(got.data) + elem * static_cast<std::int64_t>(es), es);
  std::ostringstream os;
  const std::int64_t per_row = want.ndim() ? static_cast<std::int64_t>(rb / es) : 1;
  os << describe(want) << ": first difference at element " << elem << " (row " << elem / per_row << ", column "
     << elem % per_row << "): want bits 0x" << std::hex << w << ", got 0x" << g;
  return ::testing::AssertionFailure() << os.str();
}

::testing::AssertionResult same_bits(const TensorView& want, const TensorView& got) {
  return same_rows(want, got, want.ndim() ? want.size(0) : 1);
}

void fill_random(std::uint64_t seed, const TensorView& host, float scale) {
  std::uint64_t s = seed;
  const std::int64_t n = host.numel();
  switch (host.dtype) {
    case DType::bf16: {
      auto* p = static_cast<bf16_t*>(host.data);
      for (std::int64_t i = 0; i < n; i += 4) {
        std::uint64_t r = splitmix(s);
        for (int j = 0; j < 4 && i + j < n; ++j, r >>= 16) {
          // Uniform in (-1, 1) from 16 random bits, times scale: varied exponents, never zero overall.
          const float u = (static_cast<float>(r & 0x7fffu) + 0.5f) / 32768.0f;
          p[i + j] = float_to_bf16(((r & 0x8000u) ? -u : u) * scale);
        }
      }
      break;
    }
    case DType::fp32: {
      auto* p = static_cast<float*>(host.data);
      for (std::int64_t i = 0; i < n; i += 2) {
        std::uint64_t r = splitmix(s);
        for (int j = 0; j < 2 && i + j < n; ++j, r >>= 32) {
          const float u = (static_cast<float>(r & 0x7fffffu) + 0.5f) / 8388608.0f;
          p[i + j] = ((r & 0x80000000u) ? -u : u) * scale;
        }
      }
      break;
    }
    default: {
      auto* p = static_cast<std::uint8_t*>(host.data);
      for (std::int64_t i = 0; i < static_cast<std::int64_t>(host.nbytes()); i += 8) {
        const std::uint64_t r = splitmix(s);
        std::memcpy(p + i, &r, std::min<std::size_t>(8, host.nbytes() - static_cast<std::size_t>(i)));
      }
    }
  }
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

std::shared_ptr<Group> borrow(Group& g) {
  return std::shared_ptr<Group>(&g, [](Group*) {});
}

Tensor to_gpu(const TensorView& host, int device) {
  if (!host.defined()) return {};
  Tensor d = Tensor::empty(host.dtype, host.shape, Device::cuda(device));
  if (host.numel() > 0) cuda_ok(cudaMemcpy(d.data(), host.data, host.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

Tensor to_cpu(const TensorView& v) {
  if (!v.defined()) return {};
  Tensor h = Tensor::empty(v.dtype, v.shape);
  if (v.numel() == 0) return h;
  if (v.is_contiguous()) {
    if (v.device.is_cuda()) {
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      cuda_ok(cudaMemcpy(h.data(), v.data, v.nbytes(), cudaMemcpyDeviceToHost), "D2H");
    } else {
      std::memcpy(h.data(), v.data, v.nbytes());
    }
    return h;
  }
  // The elements the view spans (its strides are non-negative), copied whole, then gathered row-major.
  std::int64_t span = 1;
  for (int i = 0; i < v.ndim(); ++i) span += (v.size(i) - 1) * v.stride(i);
  const std::size_t es = dtype_size(v.dtype);
  std::vector<char> raw(static_cast<std::size_t>(span) * es);
  if (v.device.is_cuda()) {
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_ok(cudaMemcpy(raw.data(), v.data, raw.size(), cudaMemcpyDeviceToHost), "D2H");
  } else {
    std::memcpy(raw.data(), v.data, raw.size());
  }
  const Shape steps = v.shape.contiguous_strides();
  auto* out = static_cast<char*>(h.data());
  for (std::int64_t i = 0; i < v.numel(); ++i) {
    std::int64_t off = 0, rest = i;
    for (int d = 0; d < v.ndim(); ++d) {
      off += rest / steps[d] * v.stride(d);
      rest %= steps[d];
    }
    std::memcpy(out + static_cast<std::size_t>(i) * es, raw.data() + static_cast<std::size_t>(off) * es, es);
  }
  return h;
}

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

int thread_ranks() {
  static const int n = [] {
    int cap = 8;
    if (const char* s = std::getenv("EPMOE_TEST_RANKS"); s != nullptr && *s != '\0') cap = std::max(1, std::atoi(s));
    return std::min({cap, 8, gpu_count()});
  }();
  return n;
}

bool quick() {
  const char* q = std::getenv("EPMOE_GPU_TEST_QUICK");
  return q && *q && std::string(q) != "0";
}

std::vector<std::int64_t> token_counts() {
  if (quick()) return {0, 1, 7, 128};
  return {0, 1, 7, 128, 4096};
}

std::vector<std::int64_t> hidden_sizes() {
  if (quick()) return {2048, 2880};
  return {2048, 2880, 7168};
}

}  // namespace epmoe::gputest
