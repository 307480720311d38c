// Small helpers shared by the CUDA stage kernels (router, layout, permute, quant). CUDA sources only:
// no fmt here (nvcc cannot evaluate its compile-time format checks), errors are epmoe::Error with
// std::string messages.
#pragma once

#include <epmoe/error.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"

/// Checks the launch just made (bad configuration, too much shared memory, ...).
#define EPMOE_CUDA_CHECK_LAUNCH() EPMOE_CUDA_CHECK(cudaGetLastError())

namespace epmoe::cuda_util {

/// Makes `device` current for the scope, restoring the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& device) {
    int current = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device.index) {
      EPMOE_CUDA_CHECK(cudaSetDevice(device.index));
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

/// Throws invalid_argument with the project's wording, from CUDA sources.
[[noreturn]] inline void invalid(const std::string& argument, const std::string& expected, const std::string& actual) {
  throw_invalid_argument(argument, expected, actual);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// Multiprocessors of the current device (cached per device).
int num_sms();

}  // namespace epmoe::cuda_util
