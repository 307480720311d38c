// Host-side stream helpers shared by the cuda_ipc modes (normal: cuda_ipc/normal.cpp, low-latency:
// cuda_ipc/low_latency.cpp). CUDA builds only.
#pragma once

#include <epmoe/stream.hpp>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"

namespace epmoe::cuda_ipc {

using cuda_util::capturing;  // one definition, in core

/// An async_finish event: recorded on a buffer's communication stream `stream` of GPU `device` when made.
class CudaEvent final : public EventImpl {
 public:
  CudaEvent(int device, cudaStream_t stream) {
    cuda_util::DeviceGuard guard(Device::cuda(device));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void current_stream_wait() const override {
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(cuda_util::to_cuda(current_stream()), event_, 0));
  }
  bool done() const override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    EPMOE_CUDA_CHECK(e);
    return true;
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_{};
};

/// A buffer's communication stream (non-blocking, on its GPU), shared by the buffer's normal and low-latency modes
/// so async_finish work of either mode is ordered on one stream, as DeepEP's one comm stream per buffer (what
/// Buffer::comm_stream returns). Destroyed after the last mode holding it finished its work.
class CommStream {
 public:
  explicit CommStream(int device) : device_(device) {
    cuda_util::DeviceGuard guard(Device::cuda(device));
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CommStream() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaSetDevice(previous);
  }
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  int device_;
  cudaStream_t stream_{};
};

}  // namespace epmoe::cuda_ipc
