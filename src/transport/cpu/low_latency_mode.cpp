// Low-latency mode (semantics §5) over Transport windows and signals. The protocol is summarised in
// cpu/low_latency_mode.hpp; this file holds the byte layout, the argument checks and both halves of
// dispatch and combine.
//
// Window of one rank: two halves of Layout::half_bytes, call index i (since the last clean) uses half
// i % 2. One half, offsets 64-byte aligned, row-major except the scales:
//   output area (written only by this rank, read by its caller until its call i + 2):
//     packed_x      [E_local, R*Tmax, H]   bfloat16, or float8_e4m3fn (uint8 [.., H/2] nvfp4) from the area's start
//     scales        [E_local, C, M']       float32 (C = G), or int32 (UE8M0, C = ceil(G/4)), M' =
//                                          tma_aligned_scale_rows(R*Tmax): handed out as the column-major view
//                                          [E_local, R*Tmax, C] with strides {C*M', 1, M'}, DeepEP's layout; or
//                                          (nvfp4) float8_e4m3fn [E_local, ceil(R*Tmax/128), H/64 * 512] swizzled
//     count         [E_local]              int32
//     src_info      [E_local, R*Tmax]      int32: source token index
//     layout_range  [E_local, R]           int64: begin << 32 | count
//     packed_k      [E_local, R*Tmax]      uint8: the k of the row's (token, k) pair (for combine)
//     self_row      [Tmax, 16]             int32: own token t's slot k on an own expert: its row e*R*Tmax + r
//   combine slab (written only by this rank's caller, read by a zero_copy combine of this half):
//     combine_slab  [E_local, R*Tmax, H]   bfloat16
//   staging area (peers put into it):
//     headers       [R] x 64 bytes         one Header per source
//     dispatch: per source s, TokenMeta[Tmax] then records[Tmax] (a record is the bf16 row, or the
//               fp8 row followed by its scales, or the nvfp4 packed row followed by its H/16 linear e4m3
//               scales), the first n_s of each valid;
//     combine:  rows [Tmax, 16, H] bfloat16: row (t, k) of this rank's token t, sent by k's owner.
// Signals of one rank (4R uint64 slots): data [half][source] = i + 1 once the source's data of call i
// is in; consumed [half][reader] = i + 1 once `reader` has read its staging area of call i.
#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/nvfp4.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/version.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "quant/quant.hpp"
#include "transport/args/low_latency.hpp"
#include "transport/cpu/low_latency_mode.hpp"

namespace epmoe {

namespace {

constexpr int kMaxLocalExperts = 1024;  // semantics §1
using namespace low_latency_protocol;
static_assert(kMaxTopk == kLowLatencyMaxTopk);

constexpr std::size_t align_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

using low_latency_args::check_settings;
using low_latency_args::read_topk_idx;
using low_latency_args::read_topk_weights;

void check_against_config(bool set, int cfg_tmax, std::int64_t cfg_hidden, int cfg_e, int tmax, std::int64_t hidden,
                          int num_experts, int R, std::int64_t num_rdma_bytes, std::string_view hidden_name) {
  low_latency_args::check_against_config(
      set, cfg_tmax, cfg_hidden, cfg_e, tmax, hidden, num_experts, R, num_rdma_bytes,
      set ? 0 : LowLatencyMode::size_hint(tmax, hidden, R, num_experts), hidden_name);
}

int data_slot(int half, int source, int R) { return half * R + source; }
int consumed_slot(int half, int reader, int R) { return 2 * R + half * R + reader; }

// Acquire loads of a caller's signal until it reaches `expect` (int32 entries compare signed, uint32 unsigned) or
// `seconds` pass; false on timeout. The writer is another thread of this process (the experts, or a test).
bool wait_host_signal(const void* entry, bool is_unsigned, std::uint32_t expect, double seconds,
                      std::int64_t& last) {
  const auto ready = [&] {
    if (is_unsigned) {
      const std::uint32_t v = __atomic_load_n(static_cast<const std::uint32_t*>(entry), __ATOMIC_ACQUIRE);
      last = v;
      return v >= expect;
    }
    const std::int32_t v = __atomic_load_n(static_cast<const std::int32_t*>(entry), __ATOMIC_ACQUIRE);
    last = v;
    return v >= static_cast<std::int32_t>(expect);
  };
  if (ready()) return true;
  const Deadline deadline(seconds);
  for (int spins = 0;; ++spins) {
    if (ready()) return true;
    if (spins > 64) {
      if (deadline.expired()) return ready();
      std::this_thread::yield();
    }
  }
}

// LowLatencyCombineArgs::send_stamps: [0] lowered (first) or [1] raised (last) to now, in steady_clock ns.
void stamp(std::int64_t* stamps, bool last) {
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch()).count();
  std::int64_t* slot = stamps + (last ? 1 : 0);
  std::int64_t seen = __atomic_load_n(slot, __ATOMIC_RELAXED);
  while ((last ? now > seen : now < seen) &&
         !__atomic_compare_exchange_n(slot, &seen, now, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// What the receive of a combine raises when a source's send gave up on its overlap signal: the half was read and
// marked consumed first, so receive() keeps the buffer usable.
struct PeerSignalTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

low_latency_protocol::Layout low_latency_protocol::Layout::make(int tmax, std::int64_t hidden, int R, int E) {
  check_settings(tmax, hidden, R, E);
  Layout L;
  L.tmax = tmax;
  L.num_ranks = R;
  L.num_experts = E;
  L.local_experts = E / R;
  L.expert_rank_multiplier = low_latency_protocol::expert_rank_multiplier(L.local_experts);
  L.hidden = hidden;
  L.groups = num_scale_groups(hidden);
  L.scale_rows = tma_aligned_scale_rows(static_cast<std::int64_t>(R) * tmax);
  const auto H = static_cast<std::size_t>(hidden), G = static_cast<std::size_t>(L.groups);
  const auto rows =
      static_cast<std::size_t>(L.local_experts) * static_cast<std::size_t>(R) * static_cast<std::size_t>(tmax);
  L.record_bytes = align_up(std::max(2 * H, H + 4 * G), 16);
  L.meta_bytes = align_up(sizeof(TokenMeta), 16);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off = align_up(off + bytes, 64);
    return at;
  };
  L.packed_x = take(rows * H * 2);
  // fp8: float32 groups (or UE8M0 words), column-major per expert; nvfp4: every expert's swizzled block scales
  L.scales = take(std::max(static_cast<std::size_t>(L.local_experts) * G * static_cast<std::size_t>(L.scale_rows) * 4,
                           static_cast<std::size_t>(L.local_experts) *
                               nvfp4_slab_scale_bytes(static_cast<std::int64_t>(R) * tmax, hidden)));
  L.count = take(static_cast<std::size_t>(L.local_experts) * 4);
  L.src_info = take(rows * 4);
  L.layout_range = take(static_cast<std::size_t>(L.local_experts) * static_cast<std::size_t>(R) * 8);
  L.packed_k = take(rows);
  L.self_row = take(static_cast<std::size_t>(tmax) * kMaxTopk * 4);
  L.combine_slab = take(rows * H * 2);
  L.dispatch_slot_bytes = align_up(static_cast<std::size_t>(tmax) * (L.meta_bytes + L.record_bytes), 64);
  const std::size_t dispatch_body = static_cast<std::size_t>(R) * L.dispatch_slot_bytes;
  const std::size_t combine_body = static_cast<std::size_t>(tmax) * kMaxTopk * H * 2;
  L.staging = take(static_cast<std::size_t>(R) * kHeaderBytes + std::max(dispatch_body, combine_body));
  L.half_bytes = off;
  return L;
}

std::int64_t LowLatencyMode::size_hint(int tmax, std::int64_t hidden, int num_ranks, int num_experts) {
  return 2 * static_cast<std::int64_t>(Layout::make(tmax, hidden, num_ranks, num_experts).half_bytes);
}

void LowLatencyMode::check_usable() const {
  if (broken_)
    raise(ErrorCode::unusable, "rank {}: the low-latency buffer is unusable after an earlier fault; re-create it",
          transport_.group().rank());
}

std::byte* LowLatencyMode::half_base(std::uint64_t index) const {
  return transport_.local_window() + (index % 2) * layout_.half_bytes;
}

// Fixes Tmax/H/E on the first call: agreement across ranks, then the (collective) window allocation.
void LowLatencyMode::ensure_configured(int tmax, std::int64_t hidden, int num_experts, std::string_view phase) {
  if (config_.set) return;
  Group& g = transport_.group();
  const Layout L = Layout::make(tmax, hidden, g.size(), num_experts);
  const std::int64_t bytes = num_rdma_bytes_ > 0 ? num_rdma_bytes_ : static_cast<std::int64_t>(2 * L.half_bytes);
  const Setting settings[] = {{"num_max_dispatch_tokens_per_rank", tmax},
                              {"hidden", hidden},
                              {"num_experts", num_experts},
                              {"num_rdma_bytes (low-latency window bytes)", bytes}};
  g.check_agreement(settings, fmt::format("{}: low-latency settings", phase));
  // After the agreement, so every rank raises alike rather than leaving its peers in the collective allocation. The
  // windows of thread ranks share one process, so theirs add up. The setting named is the one that can mend it: Tmax,
  // unless even Tmax = 1 needs more (then hidden).
  const double have = host_memory_bytes(), here = g.ranks_in_process();
  if (have > 0 && here * static_cast<double>(bytes) > have) {
    const bool per_hidden =
        num_rdma_bytes_ <= 0 &&
        here * 2.0 * static_cast<double>(Layout::make(1, hidden, g.size(), num_experts).half_bytes) > have;
    const std::string expected = fmt::format("low-latency windows within this machine's {} bytes of memory",
                                             static_cast<std::int64_t>(have));
    const std::string ranks = here > 1 ? fmt::format(" (x {} thread ranks in this process)", g.size()) : "";
    if (num_rdma_bytes_ > 0) throw_invalid_argument("num_rdma_bytes", expected, fmt::format("{}{}", bytes, ranks));
    const std::string window = fmt::format("a window of {} bytes{} for num_max_dispatch_tokens_per_rank {}, hidden {}, "
                                           "num_experts {} over {} ranks",
                                           bytes, ranks, tmax, hidden, num_experts, g.size());
    throw_invalid_argument(per_hidden ? "hidden" : "num_max_dispatch_tokens_per_rank", expected,
                           fmt::format("{} ({})", per_hidden ? hidden : std::int64_t{tmax}, window));
  }
  transport_.allocate_window(static_cast<std::size_t>(bytes), 4 * g.size(), fmt::format("{}: allocate window", phase));
  layout_ = L;
  scratch_.assign(static_cast<std::size_t>(tmax) * L.record_bytes, std::byte{0});
  config_ = {true, tmax, hidden, num_experts};
}

void LowLatencyMode::begin_call(std::string_view what) {
  check_usable();
  const std::uint64_t gen = generation_;
  const Pending& p = pending_[(gen - base_) % 2];
  if (p.active)
    raise(ErrorCode::stale_handle,
          "rank {}: {} would reuse the receive buffer of low-latency call {}, whose recv hook was never called; "
          "call that hook first (at most two low-latency calls can be in flight)",
          transport_.group().rank(), what, p.generation);
}

void LowLatencyMode::wait_consumed(int peer, std::uint64_t index, std::string_view phase) {
  if (index < 2) return;
  const int R = transport_.group().size();
  transport_.wait_signal(consumed_slot(static_cast<int>(index % 2), peer, R), index - 1, peer, phase);
}

void LowLatencyMode::signal_consumed(std::uint64_t index) {
  const int R = transport_.group().size(), me = transport_.group().rank();
  for (int d = 0; d < R; ++d) transport_.signal(d, consumed_slot(static_cast<int>(index % 2), me, R), index + 1);
}

// ------------------------------------------------------------------------------------------------
// dispatch

// fp8 / nvfp4: quantizes x into scratch_, one record (the row, then its scales) per token, record_bytes apart.
// Returns the bytes of a record that travel (a bf16 row is sent from x itself).
std::size_t LowLatencyMode::stage_records(const LowLatencyDispatchArgs& a, const low_latency_args::DispatchSpec& spec) {
  const Layout& L = layout_;
  const std::int64_t T = spec.T, H = spec.H, stride = static_cast<std::int64_t>(L.record_bytes);
  if (a.use_nvfp4) {
    if (T > 0) {
      const TensorView q(scratch_.data(), DType::uint8, {T, H / 2}, {stride, 1}, Device::cpu());
      const TensorView sc(scratch_.data() + nvfp4_row_bytes(H), DType::fp8_e4m3, {T, H / 16}, {stride, 1},
                          Device::cpu());
      quant_detail::Nvfp4Problem p{a.x, q, sc, T, H, Nvfp4ScaleLayout::linear, spec.global_scale};
      quant_detail::quantize_nvfp4_cpu(p);
    }
    return nvfp4_row_bytes(H) + nvfp4_scale_bytes(H);
  }
  if (!a.use_fp8) return static_cast<std::size_t>(2 * H);
  const std::int64_t sc_cols = a.use_ue8m0 ? num_ue8m0_words(H) : L.groups;
  if (T > 0) {
    const TensorView q(scratch_.data(), DType::fp8_e4m3, {T, H}, {stride, 1}, Device::cpu());
    const TensorView sc(scratch_.data() + H, a.use_ue8m0 ? DType::int32 : DType::fp32, {T, sc_cols}, {stride / 4, 1},
                        Device::cpu());
    quantize_fp8_into(a.x, q, sc, Fp8Options{a.round_scale, a.use_ue8m0});
  }
  return static_cast<std::size_t>(H + 4 * sc_cols);
}

LowLatencyDispatchResult LowLatencyMode::output_views(const Layout& L, void* half, bool use_fp8, bool use_ue8m0,
                                                      bool use_nvfp4, Device device) {
  auto* base = static_cast<std::byte*>(half);
  const int El = L.local_experts, R = L.num_ranks;
  const std::int64_t H = L.hidden, rows = static_cast<std::int64_t>(R) * L.tmax;
  LowLatencyDispatchResult r;
  if (use_nvfp4) {
    r.packed_recv_x = TensorView(base + L.packed_x, DType::uint8, {El, rows, H / 2}, device);
    r.packed_recv_x_scales = TensorView(base + L.scales, DType::fp8_e4m3,
                                        {El, nvfp4_row_tiles(rows), nvfp4_col_tiles(H) * kNvfp4TileBytes}, device);
  } else {
    r.packed_recv_x = TensorView(base + L.packed_x, use_fp8 ? DType::fp8_e4m3 : DType::bf16, {El, rows, H}, device);
    if (use_fp8) r.packed_recv_x_scales = low_latency_args::recv_scales_view(L, base + L.scales, use_ue8m0, device);
  }
  r.packed_recv_count = TensorView(base + L.count, DType::int32, {El}, device);
  r.handle.src_info = TensorView(base + L.src_info, DType::int32, {El, rows}, device);
  r.handle.layout_range = TensorView(base + L.layout_range, DType::int64, {El, R}, device);
  r.handle.num_max_dispatch_tokens_per_rank = L.tmax;
  r.handle.hidden = H;
  r.handle.num_experts = L.num_experts;
  return r;
}

LowLatencyDispatchResult LowLatencyMode::dispatch(const LowLatencyDispatchArgs& a) {
  Group& g = transport_.group();
  const int R = g.size(), me = g.rank();
  const int tmax = a.num_max_dispatch_tokens_per_rank, E = a.num_experts;

  // --- every argument, before any communication
  low_latency_args::DispatchSpec spec = low_latency_args::check_dispatch(a, R, Device::cpu());
  const std::int64_t T = spec.T, H = spec.H, K = spec.K;
  const int El = spec.El;
  const std::vector<std::int32_t> idx = std::move(spec.idx);
  check_against_config(config_.set, config_.tmax, config_.hidden, config_.num_experts, tmax, H, E, R, num_rdma_bytes_,
                       "x");
  begin_call("low_latency_dispatch");

  // --- send half: nothing here waits for a peer's data, only for a half the peer has finished reading.
  std::uint64_t gen = 0, index = 0;
  try {
    ensure_configured(tmax, H, E, "low_latency_dispatch");
    const Layout& L = layout_;
    gen = generation_;
    index = gen - base_;
    const int half = static_cast<int>(index % 2);
    const std::size_t payload = stage_records(a, spec);
    const std::size_t staging = static_cast<std::size_t>(half) * L.half_bytes + L.staging;
    const std::size_t slot =
        staging + static_cast<std::size_t>(R) * kHeaderBytes + static_cast<std::size_t>(me) * L.dispatch_slot_bytes;
    const std::size_t records = slot + static_cast<std::size_t>(tmax) * L.meta_bytes;
    std::vector<std::byte> metas(static_cast<std::size_t>(tmax) * L.meta_bytes);
    const std::string phase =
        fmt::format("low_latency_dispatch send (call {}): waiting until the peer has read half {}", index, half);
    for (int j = 0; j < R; ++j) {
      const int d = (me + 1 + j) % R;  // start with the next rank so ranks do not all hit rank 0 first
      std::int32_t n = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        TokenMeta m{};
        m.token = static_cast<std::int32_t>(t);
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int32_t e = idx[static_cast<std::size_t>(t * K + k)];
          if (e >= 0 && e / El == d)
            m.entries[m.num_entries++] = static_cast<std::uint32_t>(k) << 16 | static_cast<std::uint32_t>(e % El);
        }
        if (m.num_entries == 0) continue;
        std::memcpy(metas.data() + static_cast<std::size_t>(n) * L.meta_bytes, &m, sizeof(m));
        ++n;
      }
      wait_consumed(d, index, phase);
      const bool quantized = a.use_fp8 || a.use_nvfp4;  // records staged in scratch_
      for (std::int32_t i = 0; i < n; ++i) {
        TokenMeta m;
        std::memcpy(&m, metas.data() + static_cast<std::size_t>(i) * L.meta_bytes, sizeof(m));
        const void* src =
            quantized ? static_cast<const void*>(scratch_.data() + static_cast<std::size_t>(m.token) * L.record_bytes)
                      : static_cast<const void*>(static_cast<const bf16_t*>(a.x.data) + m.token * a.x.stride(0));
        transport_.put(d, records + static_cast<std::size_t>(i) * L.record_bytes, src, payload);
      }
      transport_.put(d, slot, metas.data(), static_cast<std::size_t>(n) * L.meta_bytes);
      Header h{};
      h.magic = kMagic;
      h.kind = kKindDispatch;
      h.index = index;
      h.count = n;
      h.hidden = H;
      h.flags = dispatch_flags(a.use_fp8, a.round_scale, a.use_ue8m0, a.use_nvfp4);
      h.tmax = tmax;
      h.num_experts = E;
      transport_.put(d, staging + static_cast<std::size_t>(me) * kHeaderBytes, &h, sizeof(h));
      transport_.signal(d, data_slot(half, me, R), index + 1);
    }
  } catch (...) {
    if (config_.set) broken_ = true;  // a fault mid-send leaves peers with partial data
    throw;
  }
  ++generation_;
  Sent& s = sent_[index % 2];
  s = {gen, T, K, idx};
  Pending& p = pending_[index % 2];
  p = Pending{};
  p.active = true;
  p.is_dispatch = true;
  p.generation = gen;
  p.num_tokens = T;
  p.use_fp8 = a.use_fp8;
  p.round_scale = a.round_scale;
  p.use_ue8m0 = a.use_ue8m0;
  p.use_nvfp4 = a.use_nvfp4;
  p.stats = a.cumulative_local_expert_recv_stats;
  p.wait_cost = a.dispatch_wait_recv_cost_stats;

  // --- the result: views of this half's output area (filled by the receive half)
  LowLatencyDispatchResult r =
      output_views(layout_, half_base(index), a.use_fp8, a.use_ue8m0, a.use_nvfp4, Device::cpu());
  r.handle.generation = gen;
  r.handle.buffer_id = buffer_id_;
  if (a.return_recv_hook)
    r.hook = RecvHook([this, gen] { receive(gen); });
  else
    receive(gen);
  return r;
}

void LowLatencyMode::receive(std::uint64_t gen) {
  check_usable();
  Pending& p = pending_[(gen - base_) % 2];
  if (gen < base_ || !p.active || p.generation != gen)
    raise(ErrorCode::stale_handle,
          "rank {}: the receive of low-latency call {} is no longer pending (the buffer was "
          "cleaned since)",
          transport_.group().rank(), gen);
  try {
    if (p.is_dispatch)
      receive_dispatch(p);
    else
      receive_combine(p);
  } catch (const PeerSignalTimeout& e) {
    p = Pending{};
    raise(ErrorCode::timeout, "{}", e.what());
  } catch (...) {
    p = Pending{};
    broken_ = true;
    throw;
  }
  p = Pending{};
}

low_latency_protocol::Header LowLatencyMode::receive_header(const std::byte* staging, int half, int s,
                                                            std::uint64_t index, std::uint32_t kind,
                                                            const std::string& phase, const TensorView& wait_cost) {
  const int R = transport_.group().size(), me = transport_.group().rank();
  const auto start = std::chrono::steady_clock::now();
  transport_.wait_signal(data_slot(half, s, R), index + 1, s, phase);
  if (wait_cost.defined())
    static_cast<std::int64_t*>(wait_cost.data)[s] +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  Header h;
  std::memcpy(&h, staging + static_cast<std::size_t>(s) * kHeaderBytes, sizeof(h));
  if (h.magic != kMagic || h.kind != kind || h.index != index) {
    const char* op = kind == kKindDispatch ? "dispatch" : "combine";
    const char* other = kind == kKindDispatch ? "a combine" : "a dispatch";
    const bool other_kind = h.kind == (kind == kKindDispatch ? kKindCombine : kKindDispatch);
    raise(ErrorCode::rank_mismatch,
          "rank {}: rank {} is not in the same low-latency call: this rank is in {} call {}, rank {} sent {} of call "
          "{} (every rank must make the same sequence of low-latency calls)",
          me, s, op, index, s, other_kind ? other : "data", h.index);
  }
  return h;
}

void LowLatencyMode::receive_dispatch(Pending& p) {
  Group& g = transport_.group();
  const int R = g.size(), me = g.rank();
  const Layout& L = layout_;
  const std::uint64_t index = p.generation - base_;
  const int half = static_cast<int>(index % 2);
  const int El = L.local_experts;
  const std::int64_t H = L.hidden, rows = static_cast<std::int64_t>(R) * L.tmax;
  const std::int64_t sc_cols = p.use_ue8m0 ? num_ue8m0_words(H) : L.groups;
  const std::size_t x_row = p.use_nvfp4 ? nvfp4_row_bytes(H)
                            : p.use_fp8  ? static_cast<std::size_t>(H)
                                         : static_cast<std::size_t>(2 * H);
  const std::size_t slab_scales = nvfp4_slab_scale_bytes(rows, H);
  std::byte* base = half_base(index);
  std::byte* packed_x = base + L.packed_x;
  auto* scales = reinterpret_cast<std::int32_t*>(base + L.scales);  // float32 or UE8M0 words: moved as 4 bytes
  auto* count = reinterpret_cast<std::int32_t*>(base + L.count);
  auto* src_info = reinterpret_cast<std::int32_t*>(base + L.src_info);
  auto* range = reinterpret_cast<std::int64_t*>(base + L.layout_range);
  auto* packed_k = reinterpret_cast<std::uint8_t*>(base + L.packed_k);
  const std::byte* staging = base + L.staging;
  const std::uint32_t flags = dispatch_flags(p.use_fp8, p.round_scale, p.use_ue8m0, p.use_nvfp4);
  const std::string phase = fmt::format("low_latency_dispatch receive (call {})", index);
  // nvfp4: a record's H / 16 linear scales into row j of expert e's swizzled matrix.
  const auto scatter_scales = [&](int e, std::int64_t j, const std::byte* rec) {
    std::byte* slab = base + L.scales + static_cast<std::size_t>(e) * slab_scales;
    const std::int64_t col_tiles = nvfp4_col_tiles(H);
    for (std::int64_t c = 0; c < H / kNvfp4BlockSize; ++c)
      slab[nvfp4_swizzled_offset(j, c, col_tiles)] = rec[nvfp4_row_bytes(H) + static_cast<std::size_t>(c)];
  };

  std::vector<std::int32_t> fill(static_cast<std::size_t>(El), 0), begin(static_cast<std::size_t>(El));
  // Every source's header is checked before any row is read: a peer in another call (or format)
  // writes another layout over this staging area, so nothing of it is trusted until all agree.
  std::vector<std::int64_t> sent_tokens(static_cast<std::size_t>(R));
  for (int s = 0; s < R; ++s) {
    const Header h = receive_header(staging, half, s, index, kKindDispatch, phase, p.wait_cost);
    if (h.flags != flags)
      raise(ErrorCode::rank_mismatch,
            "rank {}: setting 'use_fp8/round_scale/use_ue8m0/use_nvfp4' must be equal on all ranks: rank {} has "
            "{}/{}/{}/{}, rank {} has {}/{}/{}/{}",
            me, me, p.use_fp8, p.round_scale, p.use_ue8m0, p.use_nvfp4, s, (h.flags & 1) != 0, (h.flags & 2) != 0,
            (h.flags & 4) != 0, (h.flags & kFlagNvfp4) != 0);
    EPMOE_ASSERT(h.count >= 0 && h.count <= L.tmax && h.hidden == H);
    sent_tokens[static_cast<std::size_t>(s)] = h.count;
  }
  // Sources in ascending order: rows of source s start after every row of sources < s.
  for (int s = 0; s < R; ++s) {
    for (int e = 0; e < El; ++e) begin[static_cast<std::size_t>(e)] = fill[static_cast<std::size_t>(e)];
    const std::byte* metas =
        staging + static_cast<std::size_t>(R) * kHeaderBytes + static_cast<std::size_t>(s) * L.dispatch_slot_bytes;
    const std::byte* records = metas + static_cast<std::size_t>(L.tmax) * L.meta_bytes;
    for (std::int64_t i = 0; i < sent_tokens[static_cast<std::size_t>(s)]; ++i) {
      TokenMeta m;
      std::memcpy(&m, metas + static_cast<std::size_t>(i) * L.meta_bytes, sizeof(m));
      EPMOE_ASSERT(m.token >= 0 && m.token < L.tmax && m.num_entries >= 1 && m.num_entries <= kMaxTopk);
      const std::byte* rec = records + static_cast<std::size_t>(i) * L.record_bytes;
      for (int j = 0; j < m.num_entries; ++j) {
        const int e = static_cast<int>(m.entries[j] & 0xffffu), k = static_cast<int>(m.entries[j] >> 16);
        EPMOE_ASSERT(e < El && k < kMaxTopk && fill[static_cast<std::size_t>(e)] < rows);
        const std::int64_t j_e = fill[static_cast<std::size_t>(e)]++, row = static_cast<std::int64_t>(e) * rows + j_e;
        std::memcpy(packed_x + static_cast<std::size_t>(row) * x_row, rec, x_row);
        if (p.use_fp8) {  // column-major per expert (Layout::scale_rows)
          const std::int64_t first = e * sc_cols * L.scale_rows + j_e;
          for (std::int64_t c = 0; c < sc_cols; ++c)
            std::memcpy(scales + first + c * L.scale_rows, rec + H + 4 * c, 4);
        }
        if (p.use_nvfp4) scatter_scales(e, j_e, rec);
        src_info[row] = m.token;
        packed_k[row] = static_cast<std::uint8_t>(k);
      }
    }
    for (int e = 0; e < El; ++e) {
      const auto b = begin[static_cast<std::size_t>(e)];
      range[static_cast<std::size_t>(e) * R + s] =
          static_cast<std::int64_t>(b) << 32 | static_cast<std::int64_t>(fill[static_cast<std::size_t>(e)] - b);
    }
  }
  signal_consumed(index);
  for (int e = 0; e < El; ++e) count[e] = fill[static_cast<std::size_t>(e)];
  if (p.stats.defined())
    for (int e = 0; e < El; ++e)
      p.stats.ptr<std::int32_t>()[e * p.stats.stride(0)] += fill[static_cast<std::size_t>(e)];
}

// ------------------------------------------------------------------------------------------------
// combine

TensorView LowLatencyMode::next_combine_buffer(const LowLatencyHandle& handle) {
  LowLatencyCombineArgs a;
  a.handle = &handle;
  low_latency_args::combine_handle(a, buffer_id_);
  EPMOE_ASSERT(config_.set);  // a handle of this buffer implies a configured buffer
  return low_latency_args::combine_slab_view(layout_, half_base(generation_ - base_), Device::cpu());
}

LowLatencyCombineResult LowLatencyMode::combine(const LowLatencyCombineArgs& a) {
  Group& g = transport_.group();
  const int R = g.size(), me = g.rank();

  // --- every argument, before any communication
  const LowLatencyHandle& hd = low_latency_args::combine_handle(a, buffer_id_);
  check_usable();
  EPMOE_ASSERT(config_.set);  // a handle of this buffer implies a configured buffer
  const Layout& L = layout_;
  const int El = L.local_experts, tmax = L.tmax;
  const std::int64_t H = L.hidden, rows = static_cast<std::int64_t>(R) * tmax;
  const Sent& sent = sent_[(hd.generation - base_) % 2];
  const Pending& unreceived = pending_[(hd.generation - base_) % 2];
  // The routing of a dispatch stays in its half until the next dispatch into that half (semantics §5).
  low_latency_args::check_combine_handle(hd, me, tmax, H, L.num_experts, base_, generation_,
                                         sent.generation == hd.generation,
                                         unreceived.active && unreceived.generation == hd.generation);
  const std::int64_t T = sent.num_tokens, K = sent.topk;

  const TensorView x = low_latency_args::combine_input(
      a, low_latency_args::combine_slab_view(L, half_base(generation_ - base_), Device::cpu()), El, rows, H,
      Device::cpu());
  low_latency_args::check_combine_idx_shape(a.topk_idx, T, K);
  std::vector<std::int32_t> idx = read_topk_idx(a.topk_idx, T, L.num_experts);
  for (std::size_t i = 0; i < idx.size(); ++i)
    if (idx[i] != sent.topk_idx[i])
      throw_invalid_argument(
          "topk_idx", "the topk_idx given to the dispatch of this handle",
          fmt::format("{} at [{}, {}] where the dispatch had {}", idx[i], i / K, i % K, sent.topk_idx[i]));
  EPMOE_CHECK_ARG(a.topk_weights.defined(), "topk_weights", fmt::format("float32[{}, {}]", T, K), "None");
  std::vector<float> w = read_topk_weights(a.topk_weights, T, K);
  if (a.out.defined()) low_latency_args::check_combine_out(a.out, T, H, Device::cpu());
  low_latency_args::check_wait_cost_stats(a.combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", R,
                                          Device::cpu());
  EPMOE_CHECK_ARG(!(a.return_recv_hook && a.async_finish), "async_finish",
                  "false with return_recv_hook (the hook and async_finish exclude each other)", "true");
  const low_latency_args::OverlapSpec overlap = low_latency_args::check_combine_overlap(a, El, rows, Device::cpu());
  if (overlap.form == low_latency_args::OverlapSpec::Form::blocks) {
    // The blocks waited on are those of the dispatch's counts: the caller's copy must agree with them.
    const auto* count = reinterpret_cast<const std::int32_t*>(half_base(hd.generation - base_) + L.count);
    for (int e = 0; e < El; ++e)
      if (overlap.packed_recv_count[e] != count[e])
        throw_invalid_argument("packed_recv_count", "the packed_recv_count of the handle's dispatch",
                               fmt::format("{} at [{}] where the dispatch received {}", overlap.packed_recv_count[e],
                                           e, count[e]));
  }
  begin_call("low_latency_combine");

  // --- send half: one bf16 row per (token, k) back to the token's rank, at row (t, k) of its staging.
  const std::uint64_t gen = generation_, index = gen - base_;
  std::optional<std::string> signal_timeout;
  try {
    signal_timeout = send_combine(x, hd.generation - base_, overlap, index);
  } catch (...) {
    broken_ = true;
    throw;
  }
  ++generation_;
  if (signal_timeout) {
    // Every peer got this rank's header marked so, and still sent its own rows here: this rank reads its half's
    // headers and marks it consumed, so all ranks stay in step and the buffer stays usable.
    try {
      drain_combine(index);
    } catch (...) {
      broken_ = true;
      throw;
    }
    raise(ErrorCode::timeout, "{}", *signal_timeout);
  }

  LowLatencyCombineResult r;
  r.combined_x = a.out.defined() ? Tensor::wrap(a.out, nullptr) : Tensor::empty(DType::bf16, {T, H});
  Pending& p = pending_[index % 2];
  p = Pending{};
  p.active = true;
  p.is_dispatch = false;
  p.generation = gen;
  p.num_tokens = T;
  p.topk = K;
  p.topk_idx = std::move(idx);
  p.topk_weights = std::move(w);
  p.out = r.combined_x;
  p.wait_cost = a.combine_wait_recv_cost_stats;
  if (a.return_recv_hook)
    r.hook = RecvHook([this, gen] { receive(gen); });
  else
    receive(gen);
  return r;
}

std::optional<std::string> LowLatencyMode::send_combine(const TensorView& x, std::uint64_t dispatch_index,
                                                        const low_latency_args::OverlapSpec& o, std::uint64_t index) {
  using Form = low_latency_args::OverlapSpec::Form;
  Group& g = transport_.group();
  const int R = g.size(), me = g.rank();
  const Layout& L = layout_;
  const int El = L.local_experts, half = static_cast<int>(index % 2);
  const std::int64_t H = L.hidden, rows = static_cast<std::int64_t>(R) * L.tmax;
  const std::byte* dbase = half_base(dispatch_index);
  const auto* src_info = reinterpret_cast<const std::int32_t*>(dbase + L.src_info);
  const auto* range = reinterpret_cast<const std::int64_t*>(dbase + L.layout_range);
  const auto* packed_k = reinterpret_cast<const std::uint8_t*>(dbase + L.packed_k);
  const auto* count = reinterpret_cast<const std::int32_t*>(dbase + L.count);
  const std::size_t staging = static_cast<std::size_t>(half) * L.half_bytes + L.staging;
  const std::size_t body = staging + static_cast<std::size_t>(R) * kHeaderBytes;
  const std::size_t row_bytes = static_cast<std::size_t>(2 * H);
  const std::string phase =
      fmt::format("low_latency_combine send (call {}): waiting until the peer has read half {}", index, half);
  std::vector<std::int64_t> sent(static_cast<std::size_t>(R), 0);
  const auto put_row = [&](int e, std::int64_t r, int s) {
    const std::int64_t row = static_cast<std::int64_t>(e) * rows + r;
    const auto dst = static_cast<std::size_t>(src_info[row]) * kMaxTopk + packed_k[row];
    const auto* src = static_cast<const bf16_t*>(x.data) + e * x.stride(0) + r * x.stride(1);
    transport_.put(s, body + dst * row_bytes, src, row_bytes);
    ++sent[static_cast<std::size_t>(s)];
  };
  int failed_expert = -1;
  std::int64_t failed_block = -1;
  const auto put_header = [&](int s) {
    Header h{};
    h.magic = kMagic;
    h.kind = kKindCombine;
    h.index = index;
    h.count = sent[static_cast<std::size_t>(s)];
    h.hidden = H;
    h.tmax = L.tmax;
    h.num_experts = L.num_experts;
    if (failed_expert >= 0) {
      h.flags = kFlagSignalTimeout;
      h.reserved[0] = failed_expert;
      h.reserved[1] = static_cast<std::int32_t>(failed_block);
    }
    transport_.put(s, staging + static_cast<std::size_t>(me) * kHeaderBytes, &h, sizeof(h));
    transport_.signal(s, data_slot(half, me, R), index + 1);
  };
  if (!o.active()) {  // destination by destination, each after it has read this half
    for (int j = 0; j < R; ++j) {
      const int s = (me + 1 + j) % R;
      wait_consumed(s, index, phase);
      for (int e = 0; e < El; ++e) {
        const std::int64_t rg = range[static_cast<std::size_t>(e) * R + s];
        for (std::int64_t r = rg >> 32; r < (rg >> 32) + (rg & 0xffffffff); ++r) put_row(e, r, s);
      }
      put_header(s);
    }
    return std::nullopt;
  }
  // Overlap: expert by expert and block by block, in the order the GEMM finishes them; each block's rows go to
  // their sources (ascending in the packed rows) as soon as its signal says the block is done.
  for (int j = 0; j < R; ++j) wait_consumed((me + 1 + j) % R, index, phase);
  // Half the group's timeout: the peers wait the whole timeout for this rank's header, so they hear of it first.
  const double seconds = g.timeout_s() / 2;
  std::optional<std::string> message;
  for (int e = 0; e < El && !message; ++e) {
    const std::int64_t n = count[e];
    const std::int64_t bm = o.form == Form::blocks ? o.block_m : std::max<std::int64_t>(n, 1);
    int s = 0;
    for (std::int64_t b = 0; b * bm < n; ++b) {
      const std::int64_t entry = o.form == Form::blocks ? e * o.blocks_per_expert + b : e;
      std::int64_t last = 0;
      if ((o.form == Form::blocks || b == 0) &&
          !wait_host_signal(static_cast<const std::int32_t*>(o.signal) + entry, o.form == Form::experts, o.expect,
                            seconds, last)) {
        failed_expert = e;
        failed_block = o.form == Form::blocks ? b : -1;
        message = fmt::format(
            "rank {} timed out after {} s in phase 'low_latency_combine send (call {}): overlap signal' waiting for "
            "local expert {} (global {}){}: {}[{}] = {}, expected >= {} (its producer, the down GEMM, never marked "
            "it done; the peers were told and the buffer stays usable)",
            me, seconds, index, e, me * El + e,
            o.form == Form::blocks ? fmt::format(", block {} (rows [{}, {}))", b, b * bm, std::min(n, (b + 1) * bm))
                                   : std::string(),
            o.form == Form::blocks ? "comp_signal" : "src_signals", entry, last, o.expect);
        break;
      }
      if (o.send_stamps != nullptr && b * bm < n) stamp(o.send_stamps, false);
      for (std::int64_t r = b * bm; r < std::min(n, (b + 1) * bm); ++r) {
        while ((range[static_cast<std::size_t>(e) * R + s] >> 32) + (range[static_cast<std::size_t>(e) * R + s] &
                                                                     0xffffffff) <= r)
          ++s;
        put_row(e, r, s);
      }
      if (o.send_stamps != nullptr) stamp(o.send_stamps, true);
    }
  }
  for (int j = 0; j < R; ++j) put_header((me + 1 + j) % R);
  return message;
}

void LowLatencyMode::drain_combine(std::uint64_t index) {
  const int R = transport_.group().size();
  const std::byte* staging = half_base(index) + layout_.staging;
  const std::string phase = fmt::format("low_latency_combine receive (call {}, after an overlap signal timeout)", index);
  for (int s = 0; s < R; ++s)
    (void)receive_header(staging, static_cast<int>(index % 2), s, index, kKindCombine, phase, TensorView{});
  signal_consumed(index);
}

void LowLatencyMode::receive_combine(Pending& p) {
  Group& g = transport_.group();
  const int R = g.size(), me = g.rank();
  const Layout& L = layout_;
  const std::uint64_t index = p.generation - base_;
  const int half = static_cast<int>(index % 2);
  const int El = L.local_experts;
  const std::int64_t H = L.hidden, T = p.num_tokens, K = p.topk;
  const std::byte* staging = half_base(index) + L.staging;
  const auto* body = reinterpret_cast<const bf16_t*>(staging + static_cast<std::size_t>(R) * kHeaderBytes);
  const std::string phase = fmt::format("low_latency_combine receive (call {})", index);

  std::vector<std::int64_t> expected(static_cast<std::size_t>(R), 0);
  for (std::int32_t e : p.topk_idx)
    if (e >= 0) ++expected[static_cast<std::size_t>(e / El)];
  std::vector<Header> headers;
  for (int s = 0; s < R; ++s)
    headers.push_back(receive_header(staging, half, s, index, kKindCombine, phase, p.wait_cost));
  for (int s = 0; s < R; ++s) {
    const Header& h = headers[static_cast<std::size_t>(s)];
    if ((h.flags & kFlagSignalTimeout) == 0) continue;
    signal_consumed(index);  // every header is in: the half may be reused, the rows of it are not read
    throw PeerSignalTimeout(fmt::format(
        "rank {}: {}: rank {}'s send gave up waiting for the overlap signal of its local expert {}{} (rank {} "
        "raised the timeout; this call's output is not written, the buffer stays usable)",
        me, phase, s, h.reserved[0], h.reserved[1] >= 0 ? fmt::format(", block {}", h.reserved[1]) : std::string(),
        s));
  }
  for (int s = 0; s < R; ++s) {
    const Header& h = headers[static_cast<std::size_t>(s)];
    if (h.count != expected[static_cast<std::size_t>(s)])
      raise(ErrorCode::rank_mismatch,
            "rank {}: rank {} sent {} rows back at combine for this rank's tokens, but this rank's topk_idx routes {} "
            "(token, k) pairs to it",
            me, s, h.count, expected[static_cast<std::size_t>(s)]);
  }
  // out[t] = sum over k ascending of w[t, k] * row(t, k), in float32 (product rounded, then added; no
  // fused multiply-add), from 0.0f, rounded to bfloat16 once.
  const TensorView& out = p.out.view();
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < K; ++k) {
      if (p.topk_idx[static_cast<std::size_t>(t * K + k)] < 0) continue;
      const float wk = p.topk_weights[static_cast<std::size_t>(t * K + k)];
      const bf16_t* row =
          body + (static_cast<std::size_t>(t) * kMaxTopk + static_cast<std::size_t>(k)) * static_cast<std::size_t>(H);
      for (std::int64_t c = 0; c < H; ++c) {
        const float prod = wk * bf16_to_float(row[c]);
        acc[static_cast<std::size_t>(c)] += prod;
      }
    }
    bf16_t* o = static_cast<bf16_t*>(out.data) + t * out.stride(0);
    for (std::int64_t c = 0; c < H; ++c) o[c] = float_to_bf16(acc[static_cast<std::size_t>(c)]);
  }
  signal_consumed(index);
}

// ------------------------------------------------------------------------------------------------

void LowLatencyMode::clean(int tmax, std::int64_t hidden, int num_experts) {
  Group& g = transport_.group();
  check_settings(tmax, hidden, g.size(), num_experts);
  check_against_config(config_.set, config_.tmax, config_.hidden, config_.num_experts, tmax, hidden, num_experts,
                       g.size(), num_rdma_bytes_, "hidden");
  check_usable();
  if (!config_.set) {
    ensure_configured(tmax, hidden, num_experts, "clean_low_latency_buffer");
  } else {
    // Re-creating the window zeroes data and signals on every rank at once (collective).
    transport_.allocate_window(transport_.window_bytes(), 4 * g.size(), "clean_low_latency_buffer: allocate window");
  }
  base_ = generation_;
  pending_ = {};
  sent_ = {};
}

}  // namespace epmoe
