// Device discovery (CUDA builds).
#include <epmoe/version.hpp>

#include <cuda_runtime.h>

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

}  // namespace epmoe
