// One device buffer per rank, mapped into every rank of a Group (the cuda_ipc backend's normal and low-latency
// buffers both use it). CUDA builds only (the class is declared in every build so headers stay CUDA-free).
//
// Mapping: the ranks all-gather (pid, device, pointer, IPC handle). A peer in the same process (a threads group,
// or an MPI rank driving several GPUs) is reached through its raw pointer after cudaDeviceEnablePeerAccess (once
// per (device, peer device) in the process); a peer in another process through cudaIpcOpenMemHandle of its
// cudaIpcGetMemHandle. The buffer's first `zero_bytes` are zeroed, and the device synchronised, before any peer
// can learn the address; a barrier ends the (collective) construction.
#pragma once

#include <epmoe/group.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe {

class CudaIpcMemory {
 public:
  /// Collective over `group`: allocates `bytes` bytes on cuda:`device` and maps every rank's buffer.
  /// `what` names the buffer in errors (e.g. "cuda_ipc buffer (num_nvl_bytes = ...)").
  /// Errors: out_of_memory (cudaMalloc failed; the message names `bytes`, the device and `what`), unsupported
  /// (a peer device without peer access, a peer that could not export an IPC handle), CUDA errors, and the
  /// group's errors (timeout, ...) from its all_gather and barrier.
  CudaIpcMemory(Group& group, int device, std::size_t bytes, std::size_t zero_bytes, std::string_view what,
                std::string_view phase);
  /// Closes the opened IPC handles (no collective); the allocation itself lives as long as owner() copies do.
  ~CudaIpcMemory();
  CudaIpcMemory(const CudaIpcMemory&) = delete;
  CudaIpcMemory& operator=(const CudaIpcMemory&) = delete;

  /// This rank's buffer.
  void* local() const { return local_; }
  /// Rank r's buffer as mapped in this process (local() for r == this rank).
  void* peer(int r) const { return peers_[static_cast<std::size_t>(r)]; }
  std::size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  /// Keeps the allocation alive (cudaFree when the last copy is dropped): for tensors that view it.
  const std::shared_ptr<void>& owner() const { return memory_; }

 private:
  int device_ = 0;
  std::size_t bytes_ = 0;
  void* local_ = nullptr;
  std::shared_ptr<void> memory_;
  std::vector<void*> peers_;
  std::vector<void*> opened_;
};

}  // namespace epmoe
