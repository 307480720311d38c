// Helpers of the MPI suite: the world's rank and size, a seed shared by every rank, and groups with a
// test timeout so a broken test fails instead of hanging.
#pragma once

#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "support/random.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <epmoe/tensor.hpp>

#include <algorithm>
#include <cstdlib>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#endif

namespace epmoe::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// Rank 0's fresh_seed(), broadcast, so every rank can regenerate every other rank's inputs.
inline std::uint64_t shared_seed() {
  std::uint64_t seed = world_rank() == 0 ? fresh_seed() : 0;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

/// A generator for (seed, rank, stream): the inputs of rank `rank`, reproducible on any rank.
inline std::mt19937_64 rank_rng(std::uint64_t seed, int rank, std::uint64_t stream = 0) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(stream)};
  return std::mt19937_64(seq);
}

/// A group of MPI_COMM_WORLD with a timeout short enough for a test.
inline std::shared_ptr<Group> test_group(double timeout_s = 30.0) {
  auto g = make_mpi_group(MPI_COMM_WORLD);
  g->set_timeout_s(timeout_s);
  return g;
}

/// Runs `fn` and returns the epmoe::Error it throws (fails the test when it throws nothing).
inline std::optional<Error> catch_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an epmoe::Error";
  return std::nullopt;
}

#if defined(EPMOE_HAVE_CUDA)
// ---- the cuda_ipc MPI tests (one process per GPU) ----

// cuda_ok, to_gpu and to_cpu: the GPU tests' own (gpu/gpu_util.cpp, which test_mpi builds when CUDA is on).
using gputest::cuda_ok;
using gputest::to_cpu;
using gputest::to_gpu;

/// GPUs of this host (0 when CUDA has none or no driver).
inline int gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

/// This rank's GPU (rank % GPUs), or nullopt (skip the test) when the host has fewer GPUs than the R ranks, unless
/// EPMOE_TEST_SHARE_GPU=1 and it has one: ranks then share the GPUs there are (processes time-slice a GPU), which
/// tests the protocol on a one-GPU machine, not its speed.
inline std::optional<int> rank_device(int R, int rank) {
  const char* share = std::getenv("EPMOE_TEST_SHARE_GPU");
  const bool shared = share != nullptr && std::string(share) == "1" && gpus() > 0;
  if (gpus() < R && !shared) return std::nullopt;
  return rank % std::max(1, gpus());
}

#endif  // EPMOE_HAVE_CUDA

}  // namespace epmoe::test
