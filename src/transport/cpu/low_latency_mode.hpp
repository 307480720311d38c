// Low-latency mode, written once over Transport windows and signals (semantics §5).
//
// Protocol (what every backend reproduces; see cpu/low_latency_mode.cpp for the byte layout):
//  - low-latency call number g (dispatch or combine, counted from the last clean) uses half g % 2 of
//    every rank's window. The sender puts its data and a header with its counts into the peer's
//    staging area of that half, then sets the peer's data signal [half][sender] to g + 1. Nothing is
//    exchanged on the host before the data.
//  - dispatch sends each token once per destination rank, with the list of (k, local expert) pairs
//    that rank owns; the receiver fans it out into the packed per-expert rows (ascending source rank,
//    source token order), which live in the output area of the same half and stay valid until this
//    rank's call g + 2.
//  - combine sends one bf16 row per (token, k) back to the token's rank, which sums over k ascending.
//  - a receiver that has read a half's staging area sets consumed [half][receiver] = g + 1 on every
//    peer; a sender waits for consumed >= g - 1 before writing that half again for call g, so a slow
//    receiver (a pending recv hook) is never overwritten: it is waited for, or the wait times out.
#pragma once

#include <epmoe/buffer.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "transport/args/low_latency.hpp"
#include "transport/backend.hpp"
#include "transport/low_latency_protocol.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe {

class LowLatencyMode final : public LowLatencyBackend {
 public:
  /// `transport` is shared with the backend's normal mode; `num_rdma_bytes` is BufferOptions::num_rdma_bytes.
  LowLatencyMode(std::shared_ptr<Transport> transport, std::uint64_t buffer_id, std::int64_t num_rdma_bytes)
      : owner_(std::move(transport)), transport_(*owner_), buffer_id_(buffer_id), num_rdma_bytes_(num_rdma_bytes) {}
  /// Window bytes per rank for these settings (both halves). Errors: non-positive sizes, E % R != 0,
  /// E / R > 1024.
  static std::int64_t size_hint(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                int num_experts);
  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args) override;
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& args) override;
  TensorView next_combine_buffer(const LowLatencyHandle& handle) override;
  /// Collective: re-creates the (zeroed) window; pending hooks and earlier handles become stale.
  void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) override;

  /// Byte layout of one rank's window (public so tests and other backends can reason about it).
  using Layout = low_latency_protocol::Layout;
  /// A dispatch's outputs as views of the output area of the half at `half` (semantics §5), in the call's format:
  /// packed_recv_x, packed_recv_x_scales (fp8 or nvfp4), packed_recv_count and the handle's routing and settings
  /// (its generation and buffer id are the caller's). Shared by every backend, so shapes have one definition.
  static LowLatencyDispatchResult output_views(const Layout& L, void* half, bool use_fp8, bool use_ue8m0,
                                               bool use_nvfp4, Device device);

 private:
  using Config = low_latency_args::Config;
  // What the receive half of a call needs; kept per half so a hook can run after the call returned.
  struct Pending {
    bool active = false;
    bool is_dispatch = true;
    std::uint64_t generation = 0;  // the call's generation (absolute, as handles carry it)
    std::int64_t num_tokens = 0;
    bool use_fp8 = false, round_scale = false, use_ue8m0 = false, use_nvfp4 = false;
    TensorView stats;  // dispatch: cumulative_local_expert_recv_stats
    TensorView wait_cost;  // dispatch_ / combine_wait_recv_cost_stats: int64 [R] or undefined
    // combine
    std::int64_t topk = 0;
    std::vector<std::int32_t> topk_idx;
    std::vector<float> topk_weights;
    Tensor out;  // kept alive until the hook has written it
  };
  // This rank's own routing at a dispatch, kept so combine can check it gets the same topk_idx.
  struct Sent {
    std::uint64_t generation = ~0ull;
    std::int64_t num_tokens = 0, topk = 0;
    std::vector<std::int32_t> topk_idx;
  };

  void ensure_configured(int tmax, std::int64_t hidden, int num_experts, std::string_view phase);
  std::size_t stage_records(const LowLatencyDispatchArgs& a, const low_latency_args::DispatchSpec& spec);
  void check_usable() const;
  std::byte* half_base(std::uint64_t index) const;
  void begin_call(std::string_view what);
  void wait_consumed(int peer, std::uint64_t index, std::string_view phase);
  void receive(std::uint64_t generation);
  void receive_dispatch(Pending& p);
  void receive_combine(Pending& p);
  /// The combine's send half from x, with the routing of the dispatch of call `dispatch_index`, into half
  /// index % 2 of every peer; with `overlap`, each block (or expert) after its signal. Returns the timeout message
  /// when a signal did not arrive in time (the peers' headers say so; the rows sent are incomplete).
  std::optional<std::string> send_combine(const TensorView& x, std::uint64_t dispatch_index,
                                          const low_latency_args::OverlapSpec& overlap, std::uint64_t index);
  /// After a send that gave up on a signal: waits for every peer's header of call `index`, marks the half read.
  void drain_combine(std::uint64_t index);
  void signal_consumed(std::uint64_t index);
  /// Waits for source `s`'s data flag of call `index` and returns its header from `staging`; raises rank_mismatch
  /// when the source is in another call or sent the other kind of data (`kind`: kKindDispatch or kKindCombine).
  /// `wait_cost` (an int64 [R] statistic, or undefined): entry s += the nanoseconds waited.
  low_latency_protocol::Header receive_header(const std::byte* staging, int half, int s, std::uint64_t index,
                                              std::uint32_t kind, const std::string& phase,
                                              const TensorView& wait_cost);

  std::shared_ptr<Transport> owner_;
  Transport& transport_;
  std::uint64_t buffer_id_;
  std::int64_t num_rdma_bytes_;
  Config config_;
  Layout layout_;
  bool broken_ = false;
  std::uint64_t generation_ = 0;  // low-latency calls over the buffer's life (handles carry it)
  std::uint64_t base_ = 0;        // generation_ at the last clean; call index = generation_ - base_
  std::array<Pending, 2> pending_;
  std::array<Sent, 2> sent_;
  std::vector<std::byte> scratch_;  // quantized rows of this rank before they are put
};

}  // namespace epmoe
