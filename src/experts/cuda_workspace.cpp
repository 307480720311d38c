// Host-side CUDA helpers of the CUDA experts (see cuda_workspace.hpp).
#if defined(EPMOE_HAVE_CUDA)
#include "experts/cuda_workspace.hpp"

#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "core/check.hpp"
#include "core/cuda_check.hpp"

namespace epmoe::experts_cuda {

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = pools.find(device); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  EPMOE_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
  EPMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools.emplace(device, pool);
  return pool;
}

Workspace::Workspace(int device, std::size_t bytes, cudaStream_t stream) : stream_(stream) {
  if (bytes == 0) return;
  const cudaError_t err = cudaMallocFromPoolAsync(&data_, bytes, workspace_pool(device), stream);
  if (err != cudaSuccess)
    raise(ErrorCode::out_of_memory, "CUDA experts: a workspace of {} bytes on cuda:{} could not be allocated: {}",
          bytes, device, cudaGetErrorString(err));
}

Workspace::~Workspace() {
  if (data_ != nullptr) cudaFreeAsync(data_, stream_);
}

}  // namespace epmoe::experts_cuda
#endif  // EPMOE_HAVE_CUDA
