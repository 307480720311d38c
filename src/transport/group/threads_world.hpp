// Shared state of a ThreadWorld: the rendezvous its groups and transports meet at.
#pragma once

#include <epmoe/group.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace epmoe {

struct ThreadWorld::State {
  explicit State(int n);

  const int num_ranks;
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<std::uint64_t> generation{0};  // completed barriers (written under `mutex`; spinning waiters read it)
  const bool spin_before_sleep;               // as many hardware threads as ranks (see barrier)
  int count = 0;                 // ranks arrived at the current barrier
  std::vector<bool> arrived;
  // Per rank, the collective and phase it arrived in (checked equal by the last to arrive: ranks in different
  // collectives would read each other's published pointers as the wrong thing).
  std::vector<std::string> arrived_in;
  bool mismatch = false;  // broken because ranks met in different collectives (rank_mismatch)
  bool broken = false;
  std::string broken_reason;
  std::atomic<bool> aborted{false};  // set with broken by ThreadWorld::abort; read by spinning waiters
  std::vector<int> failure_order;    // per rank, the order of its first abort (-1: none; ThreadWorld::failure_order)
  int failures = 0;                  // aborted ranks so far
  // Ranks whose function returned (ThreadWorld::mark_returned): they reach no later barrier or signal.
  std::vector<bool> returned;
  std::atomic<bool> any_returned{false};  // read by spinning waiters before they take `mutex`

  // Scratch for small collectives and for publishing pointers to peers (one slot per rank).
  std::vector<std::vector<std::byte>> slots;
  std::vector<const void*> pointers;

  /// Barrier with timeout. On timeout the world is marked broken and every waiter throws. `op` names the collective
  /// ("barrier", "all_gather", ...): ranks that meet with another op or phase raise rank_mismatch naming both.
  void barrier(int rank, std::string_view op, std::string_view phase, double timeout_s);
  /// Whether rank `peer`'s function returned (under `mutex`).
  bool has_returned(int peer) const { return returned[static_cast<std::size_t>(peer)]; }
};

}  // namespace epmoe
