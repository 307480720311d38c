// Device discovery (CUDA builds).
#include <epmoe/version.hpp>

#include <mutex>

#include "core/cuda_util.hpp"

namespace epmoe {

int cuda_device_count() {
  int n = 0;
  // No driver or no device is not an error here: the caller falls back to CPU ranks.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace cuda_util {

int num_sms() {
  static std::mutex mutex;
  static int cached[64] = {};
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device] = n;
  return n;
}

}  // namespace cuda_util

}  // namespace epmoe
