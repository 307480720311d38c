// Normal (high-throughput) mode over Transport::exchange; the protocol is described in cpu/normal_mode.hpp.
#include "transport/cpu/normal_mode.hpp"
#include "transport/args/normal.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace epmoe {

// ---- OutputPool ----

namespace {
constexpr std::size_t kMinPooledBytes = std::size_t{1} << 20;  // smaller ones come from malloc's heap
constexpr std::size_t kMaxFreeBlocks = 8;
}  // namespace

struct OutputPool::State {
  struct Block {
    void* p;
    std::size_t bytes;
  };
  std::mutex mutex;
  std::vector<Block> free;  // oldest first
  bool closed = false;

  void give_back(void* p, std::size_t bytes) {
    std::lock_guard lock(mutex);
    if (closed) {
      std::free(p);
      return;
    }
    free.push_back({p, bytes});
    if (free.size() > kMaxFreeBlocks) {
      std::free(free.front().p);
      free.erase(free.begin());
    }
  }
};

OutputPool::OutputPool() : state_(std::make_shared<State>()) {}

OutputPool::~OutputPool() {
  std::lock_guard lock(state_->mutex);
  state_->closed = true;  // tensors still out free their storage themselves
  for (const auto& b : state_->free) std::free(b.p);
  state_->free.clear();
}

Tensor OutputPool::empty(DType dtype, Shape shape) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  if (bytes < kMinPooledBytes) return Tensor::empty(dtype, shape);
  void* p = nullptr;
  std::size_t capacity = 0;
  {
    // Best fit among blocks no more than twice the request.
    std::lock_guard lock(state_->mutex);
    auto& free = state_->free;
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it)
      if (it->bytes >= bytes && it->bytes <= 2 * bytes && (best == free.end() || it->bytes < best->bytes)) best = it;
    if (best != free.end()) {
      p = best->p;
      capacity = best->bytes;
      free.erase(best);
    }
  }
  if (!p) {
    // 1/8 of slack so the next call, whose row count varies a little, still fits.
    capacity = (bytes + bytes / 8 + 65535) / 65536 * 65536;
    p = std::aligned_alloc(64, capacity);
    if (!p) raise(ErrorCode::out_of_memory, "host allocation of {} bytes for a {} output failed", capacity, dtype_name(dtype));
  }
  std::shared_ptr<State> state = state_;
  std::shared_ptr<void> storage(p, [state, capacity](void* q) { state->give_back(q, capacity); });
  return Tensor::wrap(TensorView(p, dtype, shape), std::move(storage));
}

namespace {

constexpr std::string_view kDispatchPhase = "normal dispatch";
constexpr std::string_view kCombinePhase = "normal combine";

// ---- argument checks (all local, before any communication); the dispatch's own are in args/normal ----

/// First position where two equally shaped int32/bool tensors differ, compared as `T`; -1 if none.
template <class V>
std::int64_t first_difference(const TensorView& a, const Tensor& b) {
  const V* pa = static_cast<const V*>(a.data);
  const V* pb = static_cast<const V*>(b.data());
  for (std::int64_t i = 0; i < b.numel(); ++i)
    if (pa[i] != pb[i]) return i;
  return -1;
}

/// The layout tensors must be what get_dispatch_layout computes from topk_idx (semantics §3).
void check_layout_matches(const DispatchArgs& a, const DispatchLayout& want, int R) {
  if (const auto i = first_difference<std::int32_t>(a.num_tokens_per_rank, want.num_tokens_per_rank); i >= 0)
    throw_invalid_argument("num_tokens_per_rank", fmt::format("the layout of topk_idx ({} at [{}])",
                                                              want.num_tokens_per_rank.ptr<std::int32_t>()[i], i),
                           fmt::format("{}", static_cast<const std::int32_t*>(a.num_tokens_per_rank.data)[i]));
  if (const auto i = first_difference<std::int32_t>(a.num_tokens_per_expert, want.num_tokens_per_expert); i >= 0)
    throw_invalid_argument("num_tokens_per_expert", fmt::format("the layout of topk_idx ({} at [{}])",
                                                                want.num_tokens_per_expert.ptr<std::int32_t>()[i], i),
                           fmt::format("{}", static_cast<const std::int32_t*>(a.num_tokens_per_expert.data)[i]));
  if (const auto i = first_difference<bool>(a.is_token_in_rank, want.is_token_in_rank); i >= 0)
    throw_invalid_argument("is_token_in_rank", fmt::format("the layout of topk_idx ({} at [{}, {}])",
                                                           want.is_token_in_rank.ptr<bool>()[i], i / R, i % R),
                           fmt::format("{}", static_cast<const bool*>(a.is_token_in_rank.data)[i]));
}

std::int64_t layout_hash(const NormalHandle& h) {
  // FNV-1a over rank_prefix_matrix: handles of different dispatches almost surely differ.
  std::uint64_t x = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(h.rank_prefix_matrix.data());
  for (std::size_t i = 0; i < h.rank_prefix_matrix.nbytes(); ++i) x = (x ^ p[i]) * 1099511628211ull;
  return static_cast<std::int64_t>(x & 0x7fffffffffffffffull);
}


// ---- the settings packet of dispatch (one all-gather) ----

// Slots [0, kNumAgreed) must be equal on every rank; the rest are per rank. After the header come R
// counts: the tokens this rank sends to each rank. The size depends only on R.
enum Slot : int {
  kHidden, kDtype, kTopk, kExperts, kScaleFormat, kAlignment, kWorstTokens, kCached, kHasWeights, kHandleLayout,
  kNumAgreed,
  kIdxBytes = kNumAgreed,  // 8 or 4 (int64 / int32 topk_idx); may differ between ranks
  kNumTokens,
  kHeader
};
constexpr const auto& kSlotNames = kDispatchSettingNames;
static_assert(kDispatchSettingNames.size() == kNumAgreed);

std::string setting_text(int slot, std::int64_t v) {
  if (slot == kDtype) return std::string(dtype_name(static_cast<DType>(v)));
  if (slot == kScaleFormat) return v == 0 ? "none" : v == 1 ? "float32" : "ue8m0 int32";
  return std::to_string(v);
}

// ---- row copies ----

/// Copies the first n rows of `b` to dst, consecutive rows of b.row_bytes bytes.
void copy_rows(const RowBlock& b, std::int64_t n, std::byte* dst) {
  if (n == 0) return;
  if (!b.index && b.stride_bytes == b.row_bytes) {  // a staged, dense block (MPI): one copy
    std::memcpy(dst, b.base, static_cast<std::size_t>(n) * b.row_bytes);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) std::memcpy(dst + static_cast<std::size_t>(i) * b.row_bytes, b.row(i), b.row_bytes);
}

/// Reads global id k of a received topk row whose ids are `idx_bytes` wide.
inline std::int64_t read_id(const std::byte* row, int k, std::int64_t idx_bytes) {
  if (idx_bytes == 8) return reinterpret_cast<const std::int64_t*>(row)[k];
  return reinterpret_cast<const std::int32_t*>(row)[k];
}

RowBlock dense_block(const void* base, std::size_t row_bytes, std::int64_t first, std::int64_t count) {
  return RowBlock{static_cast<const std::byte*>(base) + static_cast<std::size_t>(first) * row_bytes, row_bytes, row_bytes,
                  nullptr, count};
}

/// Runs `fn` between exchange() and end_exchange(); end_exchange is reached even if fn throws, so the
/// peers are not left waiting for this rank.
template <class Fn>
void while_exchanged(Transport& transport, std::string_view phase, Fn&& fn) {
  try {
    fn();
  } catch (...) {
    try { transport.end_exchange(phase); } catch (...) {}
    throw;
  }
  transport.end_exchange(phase);
}

}  // namespace

namespace {

/// Every id of topk_idx, checked by recomputing its layout (naming the first bad id and its position): it must
/// match the layout tensors given, or for a cached dispatch the routing of the handle.
void check_routing(const DispatchArgs& a, const DispatchSpec& spec, int R) {
  if (!spec.has_topk && !spec.cached) {
    // Layout-only dispatch: num_tokens_per_rank must count is_token_in_rank's columns (nothing else to check it by).
    const bool* in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
    const auto* per_rank = static_cast<const std::int32_t*>(a.num_tokens_per_rank.data);
    for (int d = 0; d < R; ++d) {
      std::int64_t n = 0;
      for (std::int64_t t = 0; t < spec.T; ++t) n += in_rank[t * R + d] ? 1 : 0;
      if (n != per_rank[d])
        throw_invalid_argument("num_tokens_per_rank",
                               fmt::format("the tokens is_token_in_rank sends to each rank ({} at [{}])", n, d),
                               std::to_string(per_rank[d]));
    }
    return;
  }
  if (!spec.has_topk) return;
  const DispatchLayout layout = get_dispatch_layout(a.topk_idx, spec.E, R);
  if (!spec.cached) return check_layout_matches(a, layout, R);
  if (const auto i = first_difference<bool>(a.handle->is_token_in_rank, layout.is_token_in_rank); i >= 0)
    throw_invalid_argument("topk_idx", "the routing the handle was made with",
                           fmt::format("token {} {} rank {}", i / R,
                                       layout.is_token_in_rank.ptr<bool>()[i] ? "routed to" : "not routed to", i % R));
}

/// What this rank sends: the tokens of each destination rank d, ascending, at tokens[begin[d], begin[d + 1]).
struct SendLists {
  std::vector<std::int64_t> begin;
  std::vector<std::int32_t> tokens;
  std::int64_t count(int d) const { return begin[static_cast<std::size_t>(d) + 1] - begin[static_cast<std::size_t>(d)]; }
};

SendLists make_send_lists(const bool* in_rank, std::int64_t T, int R) {
  SendLists l;
  l.begin.assign(static_cast<std::size_t>(R) + 1, 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int d = 0; d < R; ++d) l.begin[static_cast<std::size_t>(d) + 1] += in_rank[t * R + d] ? 1 : 0;
  for (int d = 0; d < R; ++d) l.begin[static_cast<std::size_t>(d) + 1] += l.begin[static_cast<std::size_t>(d)];
  l.tokens.resize(static_cast<std::size_t>(l.begin[static_cast<std::size_t>(R)]));
  std::vector<std::int64_t> fill(l.begin.begin(), l.begin.end() - 1);
  for (std::int64_t t = 0; t < T; ++t)
    for (int d = 0; d < R; ++d)
      if (in_rank[t * R + d])
        l.tokens[static_cast<std::size_t>(fill[static_cast<std::size_t>(d)]++)] = static_cast<std::int32_t>(t);
  return l;
}

/// Every rank's settings packet, after the one all-gather of dispatch.
struct Gathered {
  std::vector<std::int64_t> packets;
  std::size_t size = 0;  // int64 slots per rank
  std::int64_t at(int r, int slot) const {
    return packets[static_cast<std::size_t>(r) * size + static_cast<std::size_t>(slot)];
  }
};

/// One all-gather of the settings that must agree and this rank's counts per destination; raises rank_mismatch,
/// on every rank (all scan the same data in the same order), when a setting differs.
Gathered agree_and_count(Group& group, const DispatchArgs& a, const DispatchSpec& spec, const SendLists& send,
                         std::string_view phase) {
  const int R = group.size();
  Gathered g;
  g.size = static_cast<std::size_t>(kHeader + R);
  std::vector<std::int64_t> packet(g.size, 0);
  g.packets.resize(g.size * static_cast<std::size_t>(R));
  packet[kHidden] = spec.H;
  packet[kDtype] = static_cast<std::int64_t>(a.x.dtype);
  packet[kTopk] = spec.K;
  packet[kExperts] = spec.E;
  packet[kScaleFormat] = static_cast<std::int64_t>(spec.scale_format);
  packet[kAlignment] = spec.alignment;
  packet[kWorstTokens] = spec.worst;
  packet[kCached] = spec.cached;
  packet[kHasWeights] = spec.has_weights;
  packet[kHandleLayout] = spec.cached ? layout_hash(*a.handle) : 0;
  packet[kIdxBytes] = spec.has_topk ? static_cast<std::int64_t>(dtype_size(a.topk_idx.dtype)) : 0;
  packet[kNumTokens] = spec.T;
  for (int d = 0; d < R; ++d) packet[static_cast<std::size_t>(kHeader + d)] = send.count(d);
  group.all_gather(packet.data(), g.packets.data(), g.size * sizeof(std::int64_t), phase);
  for (int r = 1; r < R; ++r)
    for (int s = 0; s < kNumAgreed; ++s)
      if (g.at(r, s) != g.at(0, s))
        raise(ErrorCode::rank_mismatch,
              "rank {}: setting '{}' of normal dispatch must be equal on all ranks: rank 0 has {}, rank {} has {}",
              group.rank(), kSlotNames[static_cast<std::size_t>(s)], setting_text(s, g.at(0, s)), r,
              setting_text(s, g.at(r, s)));
  return g;
}

/// prefix[s][d] = tokens ranks 0..s send to rank d (the handle's rank_prefix_matrix), checked against the cached
/// handle's and num_worst_tokens. Every rank sees the same counts, so every rank raises the same error.
Tensor make_prefix_matrix(const Gathered& g, const DispatchArgs& a, const DispatchSpec& spec, int R, int me) {
  Tensor prefix = Tensor::empty(DType::int32, {R, R});
  auto* pm = prefix.ptr<std::int32_t>();
  for (int d = 0; d < R; ++d) {
    std::int64_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += g.at(s, kHeader + d);
      if (acc > INT32_MAX)
        raise(ErrorCode::invalid_argument, "rank {}: rank {} would receive more than 2^31 - 1 rows", me, d);
      pm[s * R + d] = static_cast<std::int32_t>(acc);
    }
  }
  if (spec.cached && std::memcmp(pm, a.handle->rank_prefix_matrix.data(), prefix.nbytes()) != 0)
    raise(ErrorCode::rank_mismatch, "rank {}: the handles passed to the cached dispatch do not describe the tokens the "
          "ranks send (is every rank passing the handle of the same dispatch?)", me);
  if (spec.worst > 0)
    for (int d = 0; d < R; ++d)
      if (pm[(R - 1) * R + d] > spec.worst)
        throw_invalid_argument("num_worst_tokens",
                               fmt::format("at least the rows every rank receives (rank {} receives {})", d,
                                           pm[(R - 1) * R + d]),
                               std::to_string(spec.worst));
  return prefix;
}

/// Row sizes of the exchanged fields, and which field index each one has (-1 when not sent).
struct Fields {
  std::size_t x_row = 0, scale_row = 0, idx_row = 0, w_row = 0;
  int x = 0, scales = -1, idx = -1, w = -1, src = -1;
  int count = 1;
  Fields(const DispatchArgs& a, const DispatchSpec& spec) {
    x_row = static_cast<std::size_t>(spec.H) * dtype_size(a.x.dtype);
    scale_row = static_cast<std::size_t>(spec.scale_cols) * 4;
    idx_row = static_cast<std::size_t>(spec.K) * (spec.has_topk ? dtype_size(a.topk_idx.dtype) : 0);
    w_row = static_cast<std::size_t>(spec.K) * sizeof(float);
    scales = spec.fp8 ? count++ : -1;
    idx = spec.has_topk ? count++ : -1;
    w = spec.has_weights ? count++ : -1;
    src = spec.cached ? -1 : count++;
  }
};

/// x_scales as rows of 4-byte elements for the exchange: the tensor itself when row-major (any row stride), else
/// (column-major, DeepGEMM's layout) a row-major copy in `keep`, made before any communication.
TensorView scale_rows(const TensorView& scales, Tensor& keep) {
  if (scales_have_layout(scales, ScaleLayout::row_major)) return scales;
  const std::int64_t T = scales.size(0), C = scales.size(1);
  keep = Tensor::empty(scales.dtype, {T, C});
  const auto* src = static_cast<const std::uint32_t*>(scales.data);
  auto* dst = static_cast<std::uint32_t*>(keep.data());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t c = 0; c < C; ++c) dst[t * C + c] = src[t * scales.stride(0) + c * scales.stride(1)];
  return keep.view();
}

/// What this rank offers each destination, one RowBlock per field, indexed by the send lists; `scales` are
/// x_scales as scale_rows gives them.
std::vector<RowBlock> make_offers(const DispatchArgs& a, const TensorView& scales, const DispatchSpec& spec,
                                  const Fields& f, const SendLists& send, int R) {
  const std::size_t scale_stride =
      spec.fp8 && spec.T > 1 ? static_cast<std::size_t>(scales.stride(0)) * 4 : f.scale_row;
  std::vector<RowBlock> offered(static_cast<std::size_t>(R * f.count));
  for (int d = 0; d < R; ++d) {
    const std::int64_t b = send.begin[static_cast<std::size_t>(d)], n = send.count(d);
    const std::int32_t* index = send.tokens.data() + b;
    RowBlock* o = &offered[static_cast<std::size_t>(d * f.count)];
    o[f.x] = RowBlock{static_cast<const std::byte*>(a.x.data), f.x_row, f.x_row, index, n};
    if (spec.fp8)
      o[f.scales] = RowBlock{static_cast<const std::byte*>(scales.data), f.scale_row, scale_stride, index, n};
    if (spec.has_topk)
      o[f.idx] = RowBlock{static_cast<const std::byte*>(a.topk_idx.data), f.idx_row, f.idx_row, index, n};
    if (spec.has_weights)
      o[f.w] = RowBlock{static_cast<const std::byte*>(a.topk_weights.data), f.w_row, f.w_row, index, n};
    if (!spec.cached) o[f.src] = dense_block(send.tokens.data(), sizeof(std::int32_t), b, n);
  }
  return offered;
}

/// Copies each source rank's rows into place (source rank ascending), mapping global ids to local ones (-1 and
/// weight 0 for another rank's expert) and counting this rank's experts' rows into `counts` (not when cached).
void receive_rows(const std::vector<RowBlock>& received, const Gathered& g, const Fields& f, const DispatchSpec& spec,
                  const std::int32_t* pm, int R, int me, DispatchResult& out, std::int32_t* recv_src_idx,
                  std::int32_t* counts) {
  const int E_local = spec.E / R, K = spec.K;
  auto* recv_x = static_cast<std::byte*>(out.recv_x.data());
  auto* recv_scales = spec.fp8 ? static_cast<std::byte*>(out.recv_x_scales.data()) : nullptr;
  std::int64_t* recv_idx = spec.has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
  float* recv_w = spec.has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
  const std::int64_t first_expert = static_cast<std::int64_t>(me) * E_local;
  for (int s = 0; s < R; ++s) {
    const std::int64_t off = s > 0 ? pm[(s - 1) * R + me] : 0, n = pm[s * R + me] - off;
    const RowBlock* blk = &received[static_cast<std::size_t>(s * f.count)];
    for (int i = 0; i < f.count; ++i) EPMOE_ASSERT(blk[i].count == n);
    copy_rows(blk[f.x], n, recv_x + static_cast<std::size_t>(off) * f.x_row);
    if (spec.fp8) copy_rows(blk[f.scales], n, recv_scales + static_cast<std::size_t>(off) * f.scale_row);
    if (!spec.cached) copy_rows(blk[f.src], n, reinterpret_cast<std::byte*>(recv_src_idx + off));
    if (!spec.has_topk) continue;
    const std::int64_t idx_bytes = g.at(s, kIdxBytes);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::byte* ids = blk[f.idx].row(i);
      const float* w = spec.has_weights ? reinterpret_cast<const float*>(blk[f.w].row(i)) : nullptr;
      std::int64_t* oi = recv_idx + (off + i) * K;
      float* ow = spec.has_weights ? recv_w + (off + i) * K : nullptr;
      for (int k = 0; k < K; ++k) {
        const std::int64_t local = read_id(ids, k, idx_bytes) - first_expert;
        const bool mine = local >= 0 && local < E_local;
        oi[k] = mine ? local : -1;
        if (ow) ow[k] = mine ? w[k] : 0.0f;
        if (counts && mine) ++counts[local];
      }
    }
  }
}

/// Padding rows of num_worst_tokens: x and scales zero, no expert, weight 0.
void pad_rows(DispatchResult& out, const DispatchSpec& spec, const Fields& f, std::int64_t num_recv, std::int64_t rows) {
  if (rows <= num_recv) return;
  const std::size_t pad = static_cast<std::size_t>(rows - num_recv);
  const auto K = static_cast<std::size_t>(spec.K);
  std::memset(static_cast<std::byte*>(out.recv_x.data()) + static_cast<std::size_t>(num_recv) * f.x_row, 0,
              pad * f.x_row);
  if (spec.fp8)
    std::memset(static_cast<std::byte*>(out.recv_x_scales.data()) + static_cast<std::size_t>(num_recv) * f.scale_row,
                0, pad * f.scale_row);
  if (spec.has_topk) std::fill_n(out.recv_topk_idx.ptr<std::int64_t>() + num_recv * spec.K, pad * K, -1);
  if (spec.has_weights) std::fill_n(out.recv_topk_weights.ptr<float>() + num_recv * spec.K, pad * K, 0.0f);
}

}  // namespace

DispatchResult NormalMode::dispatch(const DispatchArgs& a) {
  Group& group = transport_.group();
  const int R = group.size(), me = group.rank();

  // Everything is validated locally, before any communication.
  const DispatchSpec spec = check_dispatch_args(a, R, buffer_id_, Device::cpu());
  if (spec.cached) check_normal_handle(a.handle, buffer_id_, R);
  check_routing(a, spec, R);
  const int E_local = spec.E / R;

  const TensorView& in_rank = spec.cached ? a.handle->is_token_in_rank.view() : a.is_token_in_rank;
  const bool* in_rank_p = static_cast<const bool*>(in_rank.data);
  const SendLists send = make_send_lists(in_rank_p, spec.T, R);
  const Gathered gathered = agree_and_count(group, a, spec, send, kDispatchPhase);
  // Layout-only dispatch (every rank: K = 0 is agreed above): this rank's expert counts are the sums of every rank's
  // num_tokens_per_expert over its local experts, as DeepEP's notify computes them.
  std::vector<std::int32_t> layout_counts;
  if (!spec.cached && !spec.has_topk) {
    std::vector<std::int32_t> all(static_cast<std::size_t>(spec.E) * static_cast<std::size_t>(R));
    group.all_gather(a.num_tokens_per_expert.data, all.data(), static_cast<std::size_t>(spec.E) * sizeof(std::int32_t),
                     kDispatchPhase);
    layout_counts.assign(static_cast<std::size_t>(E_local), 0);
    for (int s = 0; s < R; ++s)
      for (int e = 0; e < E_local; ++e)
        layout_counts[static_cast<std::size_t>(e)] +=
            all[static_cast<std::size_t>(s) * static_cast<std::size_t>(spec.E) + static_cast<std::size_t>(me * E_local + e)];
  }
  Tensor prefix = make_prefix_matrix(gathered, a, spec, R, me);
  const auto* pm = prefix.ptr<std::int32_t>();
  auto before = [&](int s, int d) -> std::int64_t { return s > 0 ? pm[(s - 1) * R + d] : 0; };
  const std::int64_t num_recv = pm[(R - 1) * R + me];
  const std::int64_t rows = spec.worst > 0 ? spec.worst : num_recv;

  // Outputs are allocated before the exchange, so an allocation failure leaves no peer waiting.
  DispatchResult out;
  const Fields f(a, spec);
  out.recv_x = pool_.empty(a.x.dtype, {rows, spec.H});
  if (spec.fp8) out.recv_x_scales = pool_.empty(a.x_scales.dtype, {rows, spec.scale_cols});
  if (spec.has_topk) out.recv_topk_idx = pool_.empty(DType::int64, {rows, spec.K});
  if (spec.has_weights) out.recv_topk_weights = pool_.empty(DType::fp32, {rows, spec.K});
  Tensor recv_src_idx, expert_counts;
  if (!spec.cached) {
    recv_src_idx = pool_.empty(DType::int32, {num_recv});
    expert_counts = Tensor::zeros(DType::int32, {E_local});
    if (!layout_counts.empty()) std::memcpy(expert_counts.data(), layout_counts.data(), expert_counts.nbytes());
  }

  // One exchange, a field per row-wise tensor. The offers stay alive until end_exchange (peers may read them).
  Tensor scales_copy;
  const TensorView scales = spec.fp8 ? scale_rows(a.x_scales, scales_copy) : TensorView{};
  const std::vector<RowBlock> offered = make_offers(a, scales, spec, f, send, R);
  const std::vector<RowBlock> received = transport_.exchange(offered, f.count, kDispatchPhase);
  while_exchanged(transport_, kDispatchPhase, [&] {
    receive_rows(received, gathered, f, spec, pm, R, me, out,
                 spec.cached ? nullptr : recv_src_idx.ptr<std::int32_t>(),
                 spec.cached ? nullptr : expert_counts.ptr<std::int32_t>());
  });
  pad_rows(out, spec, f, num_recv, rows);

  if (spec.cached) {
    out.handle = *a.handle;
  } else {
    NormalHandle& h = out.handle;
    for (int e = 0; e < E_local; ++e) {
      std::int32_t& c = expert_counts.ptr<std::int32_t>()[e];
      c = static_cast<std::int32_t>((static_cast<std::int64_t>(c) + spec.alignment - 1) / spec.alignment *
                                    spec.alignment);
    }
    h.rank_prefix_matrix = prefix;
    h.is_token_in_rank = pool_.empty(DType::boolean, {spec.T, R});
    if (spec.T > 0) std::memcpy(h.is_token_in_rank.data(), in_rank_p, h.is_token_in_rank.nbytes());
    h.send_pos = pool_.empty(DType::int32, {spec.T, R});
    auto* sp = h.send_pos.ptr<std::int32_t>();
    std::fill_n(sp, spec.T * R, -1);
    for (int d = 0; d < R; ++d) {
      const std::int64_t b = send.begin[static_cast<std::size_t>(d)];
      for (std::int64_t j = 0; j < send.count(d); ++j)
        sp[static_cast<std::int64_t>(send.tokens[static_cast<std::size_t>(b + j)]) * R + d] =
            static_cast<std::int32_t>(before(me, d) + j);
    }
    h.recv_src_idx = recv_src_idx;
    h.num_recv_tokens_per_expert = expert_counts;
    h.num_tokens = spec.T;
    h.num_recv_tokens = num_recv;
    h.num_recv_rows = rows;
    h.hidden = spec.H;
    h.num_experts = spec.E;
    h.expert_alignment = spec.alignment;
    h.num_worst_tokens = spec.worst;
    h.buffer_id = buffer_id_;
  }
  if (spec.worst == 0) {
    const auto* c = out.handle.num_recv_tokens_per_expert.ptr<std::int32_t>();
    out.num_recv_tokens_per_expert_list.assign(c, c + E_local);
  }
  return out;
}

CombineResult NormalMode::combine(const CombineArgs& a) {
  Group& group = transport_.group();
  const int R = group.size(), me = group.rank();

  // ---- validate everything locally ----
  const CombineSpec spec = check_combine_args(a, R, buffer_id_, Device::cpu());
  const NormalHandle& h = *a.handle;
  const TensorView& x = a.x;
  const std::int64_t T = spec.T, H = spec.H;
  const int K = spec.K;
  const bool has_w = K > 0;

  const std::array<Setting, 3> settings = {Setting{"hidden", H}, Setting{"topk_weights K (0 = not given)", K},
                                           Setting{"handle layout (rank_prefix_matrix hash)", layout_hash(h)}};
  group.check_agreement(settings, kCombinePhase);

  // ---- outputs ----
  CombineResult out;
  out.combined_x = pool_.empty(DType::bf16, {T, H});
  if (has_w) out.combined_topk_weights = pool_.empty(DType::fp32, {T, K});

  // ---- one exchange: each rank returns to source s the rows it received from s ----
  const std::int32_t* pm = h.rank_prefix_matrix.ptr<std::int32_t>();
  auto before = [&](int s, int d) -> std::int64_t { return s > 0 ? pm[(s - 1) * R + d] : 0; };
  const int F = has_w ? 2 : 1;
  const std::size_t x_row = static_cast<std::size_t>(H) * sizeof(bf16_t), w_row = static_cast<std::size_t>(K) * sizeof(float);
  std::vector<RowBlock> offered(static_cast<std::size_t>(R * F));
  for (int s = 0; s < R; ++s) {
    const std::int64_t b = before(s, me), n = pm[s * R + me] - b;
    offered[static_cast<std::size_t>(s * F)] = dense_block(x.data, x_row, b, n);
    if (has_w) offered[static_cast<std::size_t>(s * F + 1)] = dense_block(a.topk_weights.data, w_row, b, n);
  }
  const std::vector<RowBlock> received = transport_.exchange(offered, F, kCombinePhase);

  while_exchanged(transport_, kCombinePhase, [&] {
    for (int d = 0; d < R; ++d) EPMOE_ASSERT(received[static_cast<std::size_t>(d * F)].count == pm[me * R + d] - before(me, d));
    const std::int32_t* send_pos = h.send_pos.ptr<std::int32_t>();
    const auto* b0 = a.bias_0.defined() ? static_cast<const bf16_t*>(a.bias_0.data) : nullptr;
    const auto* b1 = a.bias_1.defined() ? static_cast<const bf16_t*>(a.bias_1.data) : nullptr;
    auto* out_x = out.combined_x.ptr<bf16_t>();
    float* out_w = has_w ? out.combined_topk_weights.ptr<float>() : nullptr;
    // Rows of one token, in ascending destination rank; the sum runs over H in chunks that stay in L1.
    constexpr std::int64_t kChunk = 2048;
    std::vector<const bf16_t*> src(static_cast<std::size_t>(R));
    std::vector<const float*> src_w(static_cast<std::size_t>(R));
    std::vector<float> acc(static_cast<std::size_t>(kChunk));
    for (std::int64_t t = 0; t < T; ++t) {
      int n = 0;
      for (int d = 0; d < R; ++d) {
        const std::int64_t pos = send_pos[t * R + d];
        if (pos < 0) continue;
        const std::int64_t i = pos - before(me, d);
        const RowBlock& blk = received[static_cast<std::size_t>(d * F)];
        EPMOE_ASSERT(i >= 0 && i < blk.count);
        src[static_cast<std::size_t>(n)] = reinterpret_cast<const bf16_t*>(blk.row(i));
        if (has_w) src_w[static_cast<std::size_t>(n)] = reinterpret_cast<const float*>(received[static_cast<std::size_t>(d * F + 1)].row(i));
        ++n;
      }
      for (std::int64_t h0 = 0; h0 < H; h0 += kChunk) {
        const std::int64_t len = std::min(kChunk, H - h0);
        float* ac = acc.data();
        for (std::int64_t j = 0; j < len; ++j) ac[j] = 0.0f;
        for (int r = 0; r < n; ++r) {
          const bf16_t* row = src[static_cast<std::size_t>(r)] + h0;
          for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(row[j]);
        }
        if (b0) for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(b0[t * H + h0 + j]);
        if (b1) for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(b1[t * H + h0 + j]);
        bf16_t* o = out_x + t * H + h0;
        for (std::int64_t j = 0; j < len; ++j) o[j] = float_to_bf16(ac[j]);
      }
      if (has_w) {
        float* ow = out_w + t * K;
        for (int k = 0; k < K; ++k) ow[k] = 0.0f;
        for (int r = 0; r < n; ++r)
          for (int k = 0; k < K; ++k) ow[k] += src_w[static_cast<std::size_t>(r)][k];
      }
    }
  });
  return out;
}

}  // namespace epmoe
