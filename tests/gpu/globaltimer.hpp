// Device time stamps for the GPU tests' overlap checks: %globaltimer (nanoseconds, one clock for every stream of
// the device) written by a one-thread kernel where a stream reaches it, and a kernel that spins for a while.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace epmoe::gputest {

/// Enqueues on `stream` a kernel writing %globaltimer into *slot (device memory) when the stream reaches it.
void stamp_globaltimer(std::uint64_t* slot, cudaStream_t stream);
/// Enqueues on `stream` a one-thread kernel that spins until `ns` nanoseconds of %globaltimer have passed.
void spin_globaltimer(std::uint64_t ns, cudaStream_t stream);

}  // namespace epmoe::gputest
