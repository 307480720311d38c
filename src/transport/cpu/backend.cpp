// The threads and mpi backends: both modes of cpu/ over the group's byte mover.
#include "transport/backend.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <string_view>

#include "transport/cpu/low_latency_mode.hpp"
#include "transport/cpu/normal_mode.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe {

std::int64_t low_latency_window_bytes(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                      int num_experts) {
  return LowLatencyMode::size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
}

BackendModes make_cpu_backend(std::shared_ptr<Group> group, Backend backend, const BufferOptions& options,
                              std::uint64_t buffer_id) {
  std::shared_ptr<Transport> transport;
  switch (backend) {
    case Backend::threads: transport = make_threads_transport(std::move(group)); break;
#if defined(EPMOE_HAVE_MPI)
    case Backend::mpi: transport = make_mpi_transport(std::move(group), options.mpi_pack_rows); break;
#endif
    default:
      raise(ErrorCode::unsupported, "backend {} is not available for a '{}' group in this build",
            static_cast<int>(backend), group->backend());
  }
  BackendModes modes;
  modes.normal = std::make_unique<NormalMode>(transport, buffer_id);
  modes.low_latency = std::make_unique<LowLatencyMode>(transport, buffer_id, options.num_rdma_bytes);
  return modes;
}

}  // namespace epmoe
