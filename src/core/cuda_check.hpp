// Checking every CUDA runtime call (CUDA sources only; no fmt here, see core/check.hpp).
#pragma once

#include <cuda_runtime.h>

namespace epmoe {
/// Throws epmoe::Error (internal) naming the call, the CUDA error and the location.
[[noreturn]] void throw_cuda_error(int error, const char* error_string, const char* expr, const char* file, int line);
}  // namespace epmoe

#define EPMOE_CUDA_CHECK(expr)                                                                   \
  do {                                                                                           \
    const cudaError_t epmoe_err_ = (expr);                                                       \
    if (epmoe_err_ != cudaSuccess)                                                               \
      ::epmoe::throw_cuda_error(static_cast<int>(epmoe_err_), cudaGetErrorString(epmoe_err_), #expr, __FILE__, __LINE__); \
  } while (0)

/// Checks the launch just made (bad configuration, too much shared memory, ...).
#define EPMOE_CUDA_CHECK_LAUNCH() EPMOE_CUDA_CHECK(cudaGetLastError())
