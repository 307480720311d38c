// Normal (high-throughput) mode, written once over Transport::exchange (semantics §4).
//
// Every backend whose Transport implements exchange() gets the same semantics from this class; the
// ordering rules are those of include/epmoe/buffer.hpp. The threads backend is the reference the
// others are tested against bit for bit.
//
// Dispatch, per call (collective):
//  1. validate every argument locally (nothing is exchanged before this);
//  2. one Group::all_gather of a fixed-size packet: the settings that must agree (H, dtype, K, E,
//     scale format, expert_alignment, num_worst_tokens, cached or not, topk given, weights given,
//     the cached handle's layout) and this rank's tokens per destination rank. Every rank checks
//     every rank's settings and sees the same counts, so a mismatch (rank_mismatch) or a
//     num_worst_tokens overflow (invalid_argument) is raised on every rank, before any data moves;
//  3. one exchange() with one field per row-wise tensor (x, scales, topk_idx, topk_weights, and the
//     source token index); the receiver copies each row once, straight from what the transport hands
//     out (the peer's memory on the threads backend), into its place in recv_x;
//  4. end_exchange().
// The packet's size depends only on R, so a rank with different settings cannot make the all-gather
// itself read past a buffer. num_recv_tokens_per_expert is counted on the receiver from the topk ids
// it receives (equal to the sum of the senders' num_tokens_per_expert, which dispatch checks against
// topk_idx), so the packet needs no E-sized part.
//
// Combine (collective): validate; Group::check_agreement of (H, K of topk_weights, handle layout);
// one exchange() in which each rank offers back, to each source rank, the block of rows it received
// from it; the source reduces, per token, the destination ranks' rows in ascending rank order in
// float32 starting from +0.0f, adds bias_0 then bias_1 and rounds to bfloat16 once.
#pragma once

#include <epmoe/buffer.hpp>

#include <memory>

#include "transport/backend.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe {

/// Recycles the host storage of large outputs (recv_x, combined_x, ...). A fresh allocation of that
/// size is an mmap whose first touch page-faults every page, which costs as much as the copy itself; an
/// output's storage comes back here when its last Tensor is released and is handed out again for the
/// next output that fits. Thread-safe (tensors may be released on any thread) and safe to outlive.
class OutputPool {
 public:
  OutputPool();
  ~OutputPool();
  OutputPool(const OutputPool&) = delete;
  OutputPool& operator=(const OutputPool&) = delete;
  /// Uninitialised host tensor, 64-byte aligned; from the pool when it is large enough to matter.
  Tensor empty(DType dtype, Shape shape);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

class NormalMode final : public NormalBackend {
 public:
  /// `transport` is shared with the backend's low-latency mode (both live as long as the Buffer).
  NormalMode(std::shared_ptr<Transport> transport, std::uint64_t buffer_id)
      : owner_(std::move(transport)), transport_(*owner_), buffer_id_(buffer_id) {}
  /// See Buffer::dispatch and DispatchArgs. Errors: invalid_argument (before any exchange),
  /// rank_mismatch (every rank), timeout.
  DispatchResult dispatch(const DispatchArgs& args) override;
  /// See Buffer::combine and CombineArgs. Errors as dispatch.
  CombineResult combine(const CombineArgs& args) override;

 private:
  std::shared_ptr<Transport> owner_;
  Transport& transport_;
  std::uint64_t buffer_id_;
  OutputPool pool_;
};

}  // namespace epmoe
