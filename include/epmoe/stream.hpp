// CUDA streams at the API boundary, without a CUDA header.
//
// A Stream names a cudaStream_t opaquely (handle nullptr = the legacy default stream). Functions on
// CUDA tensors enqueue their kernels on a stream and return without waiting: their outputs are ready
// once the stream reaches that point (cudaStreamSynchronize, an event, or later work on the same stream).
// On CPU tensors the stream is ignored and the work is done when the call returns.
//
// Like PyTorch's "current stream", epmoe keeps one current stream per host thread. A function called
// without a Stream argument uses it (initially the legacy default stream); the overloads that take a
// Stream set it for the duration of the call only (StreamGuard).
#pragma once

namespace epmoe {

/// Opaque cudaStream_t; nullptr is the legacy default stream.
struct Stream {
  void* handle = nullptr;
};

namespace stream_detail {
inline Stream& current_slot() {
  static thread_local Stream current;
  return current;
}
}  // namespace stream_detail

/// The calling thread's current stream (the legacy default stream unless a StreamGuard is alive).
inline Stream current_stream() { return stream_detail::current_slot(); }

/// Makes `stream` the calling thread's current stream until the guard is destroyed (guards nest).
class StreamGuard {
 public:
  explicit StreamGuard(Stream stream) : previous_(stream_detail::current_slot()) {
    stream_detail::current_slot() = stream;
  }
  ~StreamGuard() { stream_detail::current_slot() = previous_; }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
};

}  // namespace epmoe
