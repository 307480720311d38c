// Transport: how bytes move between the ranks of a Buffer (internal interface).
//
// Two primitives cover both modes, so each mode's semantics are written once (cpu/normal_mode.cpp,
// cpu/low_latency_mode.cpp) and every backend only moves bytes:
//  - exchange(): a collective all-to-all of row blocks, for normal mode. The threads backend hands
//    out the peers' own memory (zero copy); the MPI backend receives into staging.
//  - windows and signals: each rank owns a window of the same size that peers put() into, and a
//    small array of uint64 signal slots; for low-latency mode (no count exchange before the data).
#pragma once

#include <epmoe/group.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace epmoe {

/// `count` rows that one rank offers another: row i is `row_bytes` bytes at
/// base + (index ? index[i] : i) * stride_bytes.
struct RowBlock {
  const std::byte* base = nullptr;
  std::size_t row_bytes = 0;
  std::size_t stride_bytes = 0;
  const std::int32_t* index = nullptr;
  std::int64_t count = 0;
  const std::byte* row(std::int64_t i) const {
    return base + static_cast<std::size_t>(index ? index[i] : i) * stride_bytes;
  }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual Group& group() = 0;

  /// Collective all-to-all of row blocks. offered[d * num_fields + f] is what this rank sends to rank
  /// d in field f (every field of one destination has the same count). Returns received[s *
  /// num_fields + f], what rank s offered to this rank, readable until end_exchange().
  virtual std::vector<RowBlock> exchange(std::span<const RowBlock> offered, int num_fields, std::string_view phase) = 0;
  /// Collective: every rank is done reading; offered memory may be reused after this.
  virtual void end_exchange(std::string_view phase) = 0;

  /// Collective: (re)allocates this rank's window of `bytes` bytes (zeroed) and `num_signals` signal
  /// slots (zeroed). Every rank must pass the same sizes.
  virtual void allocate_window(std::size_t bytes, int num_signals, std::string_view phase) = 0;
  virtual std::byte* local_window() = 0;
  virtual std::size_t window_bytes() const = 0;
  /// Writes `bytes` bytes into rank dst's window at `offset`.
  virtual void put(int dst, std::size_t offset, const void* src, std::size_t bytes) = 0;
  /// Sets slot `slot` of rank dst's signals to `value`, ordered after this rank's earlier puts to dst.
  virtual void signal(int dst, int slot, std::uint64_t value) = 0;
  /// Waits until this rank's own slot `slot` is >= value. On timeout throws ErrorCode::timeout naming
  /// this rank, `peer` (the rank expected to signal) and `phase`.
  virtual void wait_signal(int slot, std::uint64_t value, int peer, std::string_view phase) = 0;
};

/// The transport of a Group of the threads backend (threads/transport.cpp).
std::unique_ptr<Transport> make_threads_transport(std::shared_ptr<Group> group);
#if defined(EPMOE_HAVE_MPI)
/// The transport of an MPI Group (mpi/transport.cpp); `pack_rows`: BufferOptions::mpi_pack_rows. Errors:
/// invalid_argument for a group of another kind.
std::unique_ptr<Transport> make_mpi_transport(std::shared_ptr<Group> group, bool pack_rows = false);
#endif

}  // namespace epmoe
