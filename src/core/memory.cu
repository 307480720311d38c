// Device memory for Tensor (CUDA builds only): stream-ordered, from each device's default memory pool.
//
// Why: a cudaMalloc/cudaFree pair per output costs tens to hundreds of microseconds and cudaFree synchronises the
// device, which dominated the first cuda_ipc dispatch (docs/cuda_ipc_design.md). cudaMallocAsync draws from a
// pool that keeps freed blocks (release threshold raised to "never trim"), so steady-state allocation is a
// host-side bookkeeping step, like PyTorch's caching allocator.
//
// Ordering rule (documented on Tensor::empty): a block is allocated on the calling thread's current stream and
// returned to the pool on the *releasing* thread's current stream. When the two differ and the allocating stream
// is the device's legacy default stream (always alive), the releasing stream first waits for it, so the free is
// ordered after both the producer's and the consumer's work. A block freed on stream B and reallocated on stream A
// is safe: the pool inserts the A-after-B dependency itself (cudaMemPoolReuseAllowInternalDependencies, on by
// default).
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <mutex>

#include "core/cuda_util.hpp"

namespace epmoe {
namespace {

constexpr int kMaxDevices = 64;

// Once per device: never trim the default pool at synchronisation points, so freed blocks are reused.
void configure_pool(int device) {
  static std::array<std::once_flag, kMaxDevices> once;
  if (device < 0 || device >= kMaxDevices) return;
  std::call_once(once[static_cast<std::size_t>(device)], [device] {
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) return;
    std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  });
}

// The device a stream belongs to (nullptr: the current device's legacy stream).
int stream_device(cudaStream_t stream, int fallback) {
  if (stream == nullptr) return fallback;
  // While a stream captures a CUDA graph, only capture-safe calls may be made in this thread: skip the device query
  // then (a capturing stream of another device fails the capture by itself).
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) cudaGetLastError();
  if (status != cudaStreamCaptureStatusNone) return fallback;
  int device = fallback;
  if (cudaStreamGetDevice(stream, &device) != cudaSuccess) return fallback;
  return device;
}

}  // namespace

void* device_alloc(std::size_t bytes, Device d, void** alloc_stream) {
  // Errors are reported below, as out_of_memory naming the device.
  cuda_util::DeviceGuard guard(d.index, std::nothrow);
  configure_pool(d.index);
  auto stream = cuda_util::to_cuda(current_stream());
  // A current stream of another device cannot order this device's allocation: use this device's legacy stream.
  if (stream_device(stream, d.index) != d.index) stream = nullptr;
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, bytes, stream);
  if (err == cudaErrorMemoryAllocation) {
    // The pool may hold blocks whose frees are still pending on some stream: wait for them once and retry.
    cudaGetLastError();
    cudaDeviceSynchronize();
    err = cudaMallocAsync(&p, bytes, stream);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::out_of_memory, "epmoe: allocation of " + std::to_string(bytes) + " bytes on " +
                                              to_string(d) + " failed: " + cudaGetErrorString(err));
  }
  *alloc_stream = stream;
  return p;
}

void device_free(void* p, Device d, void* alloc_stream_handle) noexcept {
  cuda_util::DeviceGuard guard(d.index, std::nothrow);
  auto alloc_stream = static_cast<cudaStream_t>(alloc_stream_handle);
  auto release = cuda_util::to_cuda(current_stream());
  if (stream_device(release, d.index) != d.index) release = nullptr;
  if (release != alloc_stream && alloc_stream == nullptr) {
    // The legacy stream never dies, so the free can also wait for the producer's work on it.
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
      cudaEventRecord(ev, alloc_stream);
      cudaStreamWaitEvent(release, ev, 0);
      cudaEventDestroy(ev);
    }
  }
  // Errors here (e.g. a context already torn down at exit) cannot be reported from a destructor.
  if (cudaFreeAsync(p, release) != cudaSuccess) cudaGetLastError();
}

}  // namespace epmoe
