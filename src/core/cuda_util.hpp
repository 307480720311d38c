// Host-side helpers of every stage's CUDA code (router, layout, quant, experts, moe, transport), defined once.
// No fmt here (nvcc compiles some of the includers: it cannot evaluate fmt's compile-time format checks).
// aligned16 and ceil_div need no CUDA header, so the CPU-compiled argument checks of CUDA tensors use them in
// every build; the rest exists in CUDA builds only (EPMOE_HAVE_CUDA).
#pragma once

#include <cstdint>

namespace epmoe::cuda_util {

/// Whether `p` is 16-byte aligned, as the kernels' 16-byte vector loads and stores need.
inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace epmoe::cuda_util

#if defined(EPMOE_HAVE_CUDA)

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <new>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"

namespace epmoe::cuda_util {

/// Makes a device current for the scope, restoring the previous one after (only when it changed it).
class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& device) : DeviceGuard(device.index) {}
  /// Errors of the runtime calls: epmoe::Error (internal).
  explicit DeviceGuard(int device) {
    int current = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) {
      EPMOE_CUDA_CHECK(cudaSetDevice(device));
      previous_ = current;
    }
  }
  /// For code that must not throw (a deallocation): errors are ignored, as they cannot be reported there.
  DeviceGuard(int device, std::nothrow_t) noexcept {
    int current = 0;
    cudaGetDevice(&current);
    if (current != device) {
      cudaSetDevice(device);
      previous_ = current;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

/// Whether `s` is capturing a CUDA graph (a capture can neither synchronise nor wait for host-recorded events).
inline bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EPMOE_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}

/// Multiprocessors of the current device (cached per device; core/device.cu).
int num_sms();

}  // namespace epmoe::cuda_util

#endif  // EPMOE_HAVE_CUDA
