// CudaIpcMemory: see cuda_ipc/memory.hpp. Extracted from the cuda_ipc normal mode's buffer mapping.
#include "transport/cuda_ipc/memory.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#if defined(EPMOE_HAVE_CUDA)

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include <unistd.h>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"

namespace epmoe {

namespace {
struct PeerInfo {
  std::int64_t pid;
  std::int64_t device;
  std::uint64_t ptr;
  std::int64_t has_handle;
  cudaIpcMemHandle_t handle;
};
}  // namespace

CudaIpcMemory::CudaIpcMemory(Group& group, int device, std::size_t bytes, std::size_t zero_bytes, std::string_view what,
                             std::string_view phase)
    : device_(device), bytes_(bytes) {
  const int R = group.size(), me = group.rank();
  int previous = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&previous));
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  struct Restore {
    int dev;
    ~Restore() { cudaSetDevice(dev); }
  } restore{previous};
  if (cudaMalloc(&local_, bytes) != cudaSuccess) {
    cudaGetLastError();
    raise(ErrorCode::out_of_memory, "rank {}: cudaMalloc of the {}-byte {} on cuda:{} failed", me, bytes, what, device);
  }
  memory_ = std::shared_ptr<void>(local_, [device](void* p) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaFree(p);
    cudaSetDevice(prev);
  });
  if (zero_bytes > 0) EPMOE_CUDA_CHECK(cudaMemset(local_, 0, zero_bytes < bytes ? zero_bytes : bytes));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer can learn the address

  PeerInfo mine{};
  mine.pid = static_cast<std::int64_t>(::getpid());
  mine.device = device;
  mine.ptr = reinterpret_cast<std::uint64_t>(local_);
  mine.has_handle = cudaIpcGetMemHandle(&mine.handle, local_) == cudaSuccess ? 1 : 0;
  if (!mine.has_handle) cudaGetLastError();
  std::vector<PeerInfo> all(static_cast<std::size_t>(R));
  group.all_gather(&mine, all.data(), sizeof(PeerInfo), phase);
  peers_.assign(static_cast<std::size_t>(R), nullptr);
  for (int r = 0; r < R; ++r) {
    const PeerInfo& p = all[static_cast<std::size_t>(r)];
    if (r == me) {
      peers_[static_cast<std::size_t>(r)] = local_;
    } else if (p.pid == mine.pid) {  // one process drives both GPUs: plain peer access
      if (p.device != device) {
        int can = 0;
        EPMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, static_cast<int>(p.device)));
        if (!can)
          raise(ErrorCode::unsupported, "rank {}: cuda:{} cannot access cuda:{} (rank {}) as a peer", me, device,
                p.device, r);
        // Once per (device, peer) in this process: repeating it returns 'already enabled', which
        // compute-sanitizer reports as an API error.
        static std::mutex enabled_mutex;
        static std::set<std::pair<int, int>> enabled;
        std::lock_guard<std::mutex> lock(enabled_mutex);
        if (enabled.insert({device, static_cast<int>(p.device)}).second) {
          const cudaError_t e = cudaDeviceEnablePeerAccess(static_cast<int>(p.device), 0);
          if (e == cudaErrorPeerAccessAlreadyEnabled)
            cudaGetLastError();
          else
            EPMOE_CUDA_CHECK(e);
        }
      }
      peers_[static_cast<std::size_t>(r)] = reinterpret_cast<void*>(p.ptr);
    } else {
      if (!p.has_handle)
        raise(ErrorCode::unsupported, "rank {}: rank {} could not export a CUDA IPC handle of its {}", me, r, what);
      void* q = nullptr;
      EPMOE_CUDA_CHECK(cudaIpcOpenMemHandle(&q, p.handle, cudaIpcMemLazyEnablePeerAccess));
      opened_.push_back(q);
      peers_[static_cast<std::size_t>(r)] = q;
    }
  }
  group.barrier(phase);
}

CudaIpcMemory::~CudaIpcMemory() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (void* p : opened_) cudaIpcCloseMemHandle(p);
  cudaSetDevice(previous);
}

}  // namespace epmoe

#else

namespace epmoe {
CudaIpcMemory::CudaIpcMemory(Group&, int, std::size_t, std::size_t, std::string_view, std::string_view) {
  raise(ErrorCode::unsupported, "CUDA IPC memory needs a CUDA build of epmoe (this one is CPU-only)");
}
CudaIpcMemory::~CudaIpcMemory() = default;
}  // namespace epmoe

#endif
