// Low-latency mode, written once over Transport windows and signals (SPEC 5).
#pragma once

#include <epmoe/buffer.hpp>

#include "transport/transport.hpp"

namespace epmoe {

class LowLatencyMode {
 public:
  LowLatencyMode(Transport& transport, std::uint64_t buffer_id, std::int64_t num_rdma_bytes)
      : transport_(transport), buffer_id_(buffer_id), num_rdma_bytes_(num_rdma_bytes) {}
  static std::int64_t size_hint(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_ranks, int num_experts);
  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& args);
  void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts);

 private:
  Transport& transport_;
  std::uint64_t buffer_id_;
  std::int64_t num_rdma_bytes_;
};

}  // namespace epmoe
