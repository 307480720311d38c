// Host-side CUDA helpers the bf16 and fp8 CUDA experts share (CUDA builds only): stream-ordered
// workspaces from a per-device pool that never trims (repeated calls reuse memory; the BatchedExperts path stays
// capturable in a CUDA graph), and offsets of several buffers inside one workspace.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace epmoe::experts_cuda {

inline constexpr std::size_t kWorkspaceAlign = 256;  // bytes; every carved buffer starts on this boundary

/// The experts' memory pool of `device` (created once; release threshold: never).
cudaMemPool_t workspace_pool(int device);

/// A stream-ordered allocation of `bytes` from workspace_pool, freed on the same stream when the scope ends.
/// Errors: out_of_memory naming the size and device.
class Workspace {
 public:
  Workspace(int device, std::size_t bytes, cudaStream_t stream);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  char* at(std::size_t offset) const { return static_cast<char*>(data_) + offset; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

/// Offsets of several buffers inside one allocation (each kWorkspaceAlign-aligned); `size` is the total.
struct Carve {
  std::size_t size = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = (size + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    size = offset + bytes;
    return offset;
  }
};

}  // namespace epmoe::experts_cuda
