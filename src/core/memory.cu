// Device memory for Tensor (CUDA builds only).
#include <epmoe/tensor.hpp>

#include "core/cuda_check.hpp"

namespace epmoe {

void* device_alloc(std::size_t bytes, Device d) {
  int prev = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&prev));
  EPMOE_CUDA_CHECK(cudaSetDevice(d.index));
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  cudaSetDevice(prev);
  if (err != cudaSuccess)
    throw Error(ErrorCode::out_of_memory, "epmoe: cudaMalloc of " + std::to_string(bytes) + " bytes on " + to_string(d) +
                                              " failed: " + cudaGetErrorString(err));
  return p;
}

void device_free(void* p, Device) { cudaFree(p); }

}  // namespace epmoe
