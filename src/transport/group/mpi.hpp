// The MPI Group (internal): shared by group/mpi.cpp and mpi/transport.cpp.
//
// The transport sends on the group's duplicated communicator and waits through the group, so one
// timeout rule and one "unusable after a fault" flag cover the group and its transport.
#pragma once

#include <epmoe/mpi.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe {

/// Throws ErrorCode::internal naming the MPI call and MPI's error string when rc != MPI_SUCCESS.
void check_mpi(int rc, const char* call);

class MpiGroup final : public Group {
 public:
  explicit MpiGroup(MPI_Comm comm);
  ~MpiGroup() override;
  MpiGroup(const MpiGroup&) = delete;
  MpiGroup& operator=(const MpiGroup&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

  void barrier(std::string_view phase) override;
  void all_gather(const void* send, void* recv, std::size_t bytes, std::string_view phase) override;
  void broadcast(void* data, std::size_t bytes, int root, std::string_view phase) override;
  void reduce_scatter_sum(const float* send, float* recv, std::size_t count, std::string_view phase) override;

  /// The duplicated communicator all of this group's and its transports' traffic uses.
  MPI_Comm comm() const { return comm_; }

  /// Throws ErrorCode::unusable if an earlier fault broke the group.
  void check_usable(std::string_view phase) const;

  /// Waits for every request with the group's timeout, testing in a loop (never blocking in MPI).
  /// peers[i] is the rank request i talks to (or -1 for a collective). On timeout the group becomes
  /// unusable, the pending requests are abandoned (their buffers must be handed to keep_after_fault
  /// by the caller, since MPI may still write into or read from them), and ErrorCode::timeout names
  /// this rank, `phase` and the peer(s) of the unfinished requests ("one or more peers" if unknowable).
  /// Completed requests are set to MPI_REQUEST_NULL.
  void wait_all(std::span<MPI_Request> requests, std::span<const int> peers, std::string_view phase,
                std::string_view what);
  /// As wait_all for one collective request; `detail` is added to a timeout's message.
  void wait_collective(MPI_Request& request, std::string_view phase, std::string_view detail);

  /// Keeps memory that abandoned MPI requests may still touch alive for as long as the process lives.
  void keep_after_fault(std::shared_ptr<void> memory);
  bool broken() const { return broken_; }
  /// Marks the group unusable and throws ErrorCode::timeout for this rank, `peer` (-1: unknown) and `phase`.
  [[noreturn]] void timeout(int peer, std::string_view phase, std::string detail);

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
};

/// Polls `test` (returns true when done) with the spin-then-yield rule every MPI wait of epmoe uses:
/// a short burst of tight polls for latency, then yielding the core between polls because MPI ranks
/// are often oversubscribed (mpirun --oversubscribe) and a spinning rank would starve the peer it
/// waits for. Returns false when `deadline_s` seconds passed without `test` succeeding.
template <class Test>
bool poll_until(Test&& test, double deadline_s);

}  // namespace epmoe

#include <epmoe/timeout.hpp>

#include <thread>

namespace epmoe {

template <class Test>
bool poll_until(Test&& test, double deadline_s) {
  if (test()) return true;
  const Deadline deadline(deadline_s);
  for (int spins = 0;; ++spins) {
    if (test()) return true;
    if (spins >= 256) {
      if (deadline.expired()) return test();
      std::this_thread::yield();
    }
  }
}

}  // namespace epmoe
