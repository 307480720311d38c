// The low-latency mode's byte protocol (semantics §5), one definition for the CPU implementation (cpu/low_latency_mode.cpp)
// and the cuda_ipc kernels (cuda_ipc/low_latency_kernels.cu): the records a source writes into a peer's window,
// the flag bits, and the window's layout. Plain C++ without fmt or CUDA, so .cu files include it too. The layout
// is described at the top of cpu/low_latency_mode.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epmoe::low_latency_protocol {

inline constexpr int kMaxTopk = 16;                  // semantics §1: K in 1..16 (kLowLatencyMaxTopk)
inline constexpr std::uint32_t kMagic = 0x4c4c4550;  // "PELL"
inline constexpr std::size_t kHeaderBytes = 64;
/// Header::kind.
enum : std::uint32_t { kKindDispatch = 1, kKindCombine = 2 };

/// Header::flags of a combine whose send gave up waiting for an overlap signal (LowLatencyCombineArgs::overlap): the
/// rows are incomplete, reserved[0] holds the local expert and reserved[1] the block (-1: the per-expert form).
inline constexpr std::uint32_t kFlagSignalTimeout = 1u;
/// Header::flags of a dispatch: its per-call settings, which every rank must pass equal.
inline constexpr std::uint32_t kFlagNvfp4 = 8u;
constexpr std::uint32_t dispatch_flags(bool use_fp8, bool round_scale, bool use_ue8m0, bool use_nvfp4) {
  return (use_fp8 ? 1u : 0u) | (round_scale ? 2u : 0u) | (use_ue8m0 ? 4u : 0u) | (use_nvfp4 ? kFlagNvfp4 : 0u);
}

/// NVFP4 dispatch (H % 64 == 0): a record is the packed row (H / 2 bytes of e2m1 pairs) then its H / 16 e4m3 block
/// scales (linear); the receiver writes each expert's rows' scales as one swizzled matrix of 128-row tiles
/// (nvfp4.hpp), nvfp4_slab_scale_bytes apart.
constexpr std::size_t nvfp4_row_bytes(std::int64_t hidden) { return static_cast<std::size_t>(hidden / 2); }
constexpr std::size_t nvfp4_scale_bytes(std::int64_t hidden) { return static_cast<std::size_t>(hidden / 16); }
constexpr std::size_t nvfp4_slab_scale_bytes(std::int64_t rows, std::int64_t hidden) {
  // ceil(rows / 128) tiles of 128 rows times ceil(H / 64) tiles of 4 scales, 512 bytes each
  return static_cast<std::size_t>((rows + 127) / 128) * static_cast<std::size_t>((hidden / 16 + 3) / 4) * 512u;
}

/// The rank owning expert `id` is id / local_experts. The GPU's id cleaning computes it as a multiply and a shift
/// rather than an integer division (~20 dependent instructions on its path): the round-up method of Granlund and
/// Montgomery, "Division by invariant integers using multiplication" (PLDI 1994), with m = floor(2^40 / d) + 1.
/// Exact for 0 <= id < 2^24 and 1 <= d <= 1024 (semantics §1's bound on local experts): m = (2^40 + e) / d with
/// 1 <= e <= d, so id * m / 2^40 = id / d + id * e / (d * 2^40), and the second term stays below 1 / d, under one
/// step to the next multiple of d, as long as id * e < 2^40.
inline constexpr int kExpertRankShift = 40;
constexpr std::uint64_t expert_rank_multiplier(int local_experts) {
  return (std::uint64_t{1} << kExpertRankShift) / static_cast<std::uint64_t>(local_experts) + 1;
}
/// id / local_experts for the multiplier of expert_rank_multiplier(local_experts); 0 <= id < 2^24.
constexpr int expert_rank(std::int32_t id, std::uint64_t multiplier) {
  return static_cast<int>(static_cast<std::uint64_t>(id) * multiplier >> kExpertRankShift);
}

/// What a source writes before its data; the receiver checks it, so two ranks in different calls or with different
/// per-call settings fail loudly instead of misreading each other's bytes.
struct Header {
  std::uint32_t magic;
  std::uint32_t kind;
  std::uint64_t index;  // call index since the last clean
  std::int64_t count;   // dispatch: tokens sent; combine: rows sent
  std::int64_t hidden;
  std::uint32_t flags;  // dispatch: dispatch_flags
  std::int32_t tmax;
  std::int32_t num_experts;
  std::int32_t reserved[5];
};
static_assert(sizeof(Header) == kHeaderBytes);

/// One dispatched token: its index at the source and the (k, local expert) pairs of this destination, in ascending
/// k.
struct TokenMeta {
  std::int32_t token;
  std::int32_t num_entries;
  std::uint32_t entries[kMaxTopk];  // k << 16 | local expert
};

/// Byte layout of one rank's window: offsets inside one half, and the half's size.
struct Layout {
  int tmax = 0, num_ranks = 0, num_experts = 0, local_experts = 0;
  std::int64_t hidden = 0, groups = 0;
  /// Column stride (elements) of one expert's scales, which are column-major as DeepEP's: tma_aligned_scale_rows(R *
  /// tmax); scale [e][row][c] (c a float32 group or a UE8M0 word) is element (e * C + c) * scale_rows + row.
  std::int64_t scale_rows = 0;
  std::size_t record_bytes = 0;  // payload of one dispatched token (bf16 row, or fp8 row + scales)
  std::size_t meta_bytes = 0;    // TokenMeta of one dispatched token
  std::size_t packed_x = 0, scales = 0, count = 0, src_info = 0, layout_range = 0, packed_k = 0;  // offsets
  /// int32 [tmax, kMaxTopk]: for this rank's own token t and slot k routed to one of its own experts, the row
  /// (e * R * tmax + r) the dispatch placed it at, so a combine can read that expert output where it lies instead of
  /// a copy of it (the GPU's one-kernel combine). Part of the dispatch's routing, as src_info and packed_k.
  std::size_t self_row = 0;
  /// The zero-copy combine's input, bfloat16 [E_local, R * tmax, H] (DeepEP's combine send buffer): the caller
  /// writes it (Buffer::get_next_low_latency_combine_buffer), a combine with zero_copy reads it; no call writes it.
  std::size_t combine_slab = 0;
  std::size_t staging = 0;              // offset of the area peers put into
  std::size_t dispatch_slot_bytes = 0;  // one source's dispatch staging (meta + records)
  std::size_t half_bytes = 0;
  std::uint64_t expert_rank_multiplier = 0;  // of local_experts (expert_rank)
  /// Checks the settings (low_latency_args::check_settings: invalid_argument naming the first bad one).
  static Layout make(int tmax, std::int64_t hidden, int num_ranks, int num_experts);
};

}  // namespace epmoe::low_latency_protocol
