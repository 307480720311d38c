// The MPI transport: CPU ranks as processes (semantics §10).
//
// exchange(): a count exchange, then one message per (source, destination) pair carrying every field,
// received into a private staging buffer (the views returned stay valid until end_exchange). Each
// message is described by one derived datatype (a struct of per-field blocks whose element is one
// row, MPI_Type_contiguous(row_bytes)), so no MPI count ever holds a byte total: rows * row_bytes may
// exceed 2^31. Point-to-point rather than MPI_Ialltoallv so a timeout can name the peers whose
// messages are missing (libnbc implements Ialltoallv with the same point-to-point messages).
// Contiguous and strided blocks are sent straight from the caller's memory (hvector for strides);
// indexed blocks are described by an hindexed datatype by default, so Open MPI packs the rows straight
// into its shared-memory fragments, pipelined with the receiver. BufferOptions::mpi_pack_rows packs them
// into a send staging buffer first instead. Measured with bench_mpi_alltoall (16-core host, Open MPI
// 4.1, T = 4096, H = 7168, K = 8 of E = 256): datatype 22.5 ms (R = 2) and 54.7 ms (R = 4) per
// exchange, pack 33.3 and 96.1 ms, a plain MPI_Alltoallv of the same, already packed rows 27.7 and
// 59.3 ms. With more ranks than cores (mpirun --oversubscribe on 2 cores) pack measured faster, since
// the datatype path needs sender and receiver running at the same time; there the knob helps.
//
// Windows: MPI_Win_allocate of the signal slots (uint64, first) and the data, in a passive-target
// epoch for the window's life (MPI_Win_lock_all). put = MPI_Put (then MPI_Win_flush_local, so the
// source may be reused at once, as with the threads backend); signal = MPI_Win_flush(dst), which
// completes the earlier puts at the target, then an MPI_Accumulate(MPI_REPLACE) of the value and
// another flush; wait_signal polls its own slot with MPI_Fetch_and_op(MPI_NO_OP) (atomic with respect
// to the peers' accumulates) and finishes with MPI_Win_sync so the data read afterwards is current.
#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "transport/group/mpi.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe {

namespace {

constexpr int kCountTag = 0x4501;  // count exchange of exchange()
constexpr int kRowsTag = 0x4502;   // rows of exchange()
constexpr std::size_t kAlign = 64;

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/// Grow-only, 64-byte aligned scratch memory; shared so it can outlive the transport after a fault.
struct Scratch {
  std::shared_ptr<std::byte> data;
  std::size_t capacity = 0;
  std::byte* reserve(std::size_t bytes) {
    if (bytes > capacity) {
      data.reset(static_cast<std::byte*>(std::aligned_alloc(kAlign, align_up(bytes))), std::free);
      if (!data) raise(ErrorCode::out_of_memory, "MPI transport: cannot allocate {} bytes of staging", bytes);
      capacity = align_up(bytes);
    }
    return data.get();
  }
};

/// Owns the datatypes of one exchange and frees them at the end.
class Datatypes {
 public:
  Datatypes() = default;
  Datatypes(const Datatypes&) = delete;
  Datatypes& operator=(const Datatypes&) = delete;
  ~Datatypes() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
      for (auto& t : types_) MPI_Type_free(&t);
  }
  MPI_Datatype keep(MPI_Datatype t) {
    types_.push_back(t);
    return t;
  }
  /// One row of `row_bytes` bytes (the element type of every block).
  MPI_Datatype row(std::size_t row_bytes) {
    MPI_Datatype t;
    check_mpi(MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &t), "MPI_Type_contiguous");
    return keep(t);
  }

 private:
  std::vector<MPI_Datatype> types_;
};

/// Builds one message out of blocks at absolute addresses (sent from / received into MPI_BOTTOM).
struct MessageBuilder {
  std::vector<int> lengths;
  std::vector<MPI_Aint> displacements;
  std::vector<MPI_Datatype> types;
  void add(const void* address, int count, MPI_Datatype type) {
    if (count == 0) return;
    MPI_Aint a;
    check_mpi(MPI_Get_address(address, &a), "MPI_Get_address");
    lengths.push_back(count);
    displacements.push_back(a);
    types.push_back(type);
  }
  bool empty() const { return lengths.empty(); }
  MPI_Datatype commit(Datatypes& owner) {
    MPI_Datatype t;
    check_mpi(MPI_Type_create_struct(static_cast<int>(lengths.size()), lengths.data(), displacements.data(),
                                     types.data(), &t),
              "MPI_Type_create_struct");
    check_mpi(MPI_Type_commit(&t), "MPI_Type_commit");
    return owner.keep(t);
  }
};

class MpiTransport final : public Transport {
 public:
  MpiTransport(std::shared_ptr<Group> group, bool pack_rows) : holder_(std::move(group)), pack_indexed_(pack_rows) {
    group_ = dynamic_cast<MpiGroup*>(holder_.get());
    EPMOE_CHECK_ARG(group_ != nullptr, "group", "a group from make_mpi_group (backend 'mpi')", holder_->backend());
  }

  ~MpiTransport() override { free_window("MPI transport destruction", /*in_destructor=*/true); }

  Group& group() override { return *group_; }

  std::vector<RowBlock> exchange(std::span<const RowBlock> offered, int num_fields, std::string_view phase) override;
  void end_exchange(std::string_view phase) override {
    // Peers never read this rank's memory (every message completed inside exchange()), so releasing
    // the staging is local: no communication is needed.
    group_->check_usable(phase);
    active_ = 0;
  }

  void allocate_window(std::size_t bytes, int num_signals, std::string_view phase) override;
  std::byte* local_window() override { return window_ == MPI_WIN_NULL ? nullptr : base_ + data_offset_; }
  std::size_t window_bytes() const override { return window_bytes_; }
  void put(int dst, std::size_t offset, const void* src, std::size_t bytes) override;
  void signal(int dst, int slot, std::uint64_t value) override;
  void wait_signal(int slot, std::uint64_t value, int peer, std::string_view phase) override;

 private:
  struct Exchange;
  void describe_sends(Exchange& x) const;
  void exchange_counts(Exchange& x, std::string_view phase);
  void lay_out_receives(Exchange& x, Scratch& staging) const;
  void reserve_packing(Exchange& x);
  void post_row_receives(Exchange& x, Datatypes& types);
  void post_row_sends(Exchange& x, Datatypes& types);
  static std::vector<RowBlock> received_views(const Exchange& x);
  void free_window(std::string_view phase, bool in_destructor);
  /// Staging `index` of the current exchange (a pool so that two exchanges before one end_exchange
  /// keep their views apart).
  Scratch& recv_staging() {
    if (static_cast<std::size_t>(active_) == recv_pool_.size()) recv_pool_.emplace_back();
    return recv_pool_[static_cast<std::size_t>(active_++)];
  }

  std::shared_ptr<Group> holder_;
  MpiGroup* group_ = nullptr;
  bool pack_indexed_ = false;  // BufferOptions::mpi_pack_rows: see the top of the file
  std::vector<Scratch> recv_pool_;
  int active_ = 0;
  Scratch send_staging_;

  MPI_Win window_ = MPI_WIN_NULL;
  std::byte* base_ = nullptr;
  std::size_t data_offset_ = 0;
  std::size_t window_bytes_ = 0;
  int num_signals_ = 0;
};

// exchange() in steps; every step sees the same bookkeeping: the offer, and per rank [count, row_bytes of each field]
// sent to it (send) and received from it (recv).
struct MpiTransport::Exchange {
  std::span<const RowBlock> offered;
  int R = 0, me = 0, F = 0;
  std::size_t M = 0;  // F + 1 int64 per rank
  std::vector<std::int64_t> send_meta, recv_meta;
  std::vector<std::byte*> recv_ptr;  // [source * F + field]: where its block lands (null for this rank's own)
  std::byte* pack = nullptr;         // send staging of packed indexed blocks (pack_indexed_)
  std::vector<MPI_Request> requests;
  std::vector<int> peers;  // the rank of each request, for wait_all's timeout message
  const RowBlock& block(int rank, int f) const {
    return offered[static_cast<std::size_t>(rank) * static_cast<std::size_t>(F) + static_cast<std::size_t>(f)];
  }
  std::int64_t recv_count(int s) const { return recv_meta[static_cast<std::size_t>(s) * M]; }
  std::size_t recv_row_bytes(int s, int f) const {
    return static_cast<std::size_t>(recv_meta[static_cast<std::size_t>(s) * M + 1 + static_cast<std::size_t>(f)]);
  }
};

// 1. What this rank sends: per destination [count, row_bytes of each field], the offer's rules checked.
void MpiTransport::describe_sends(Exchange& x) const {
  x.send_meta.resize(static_cast<std::size_t>(x.R) * x.M);
  x.recv_meta.resize(static_cast<std::size_t>(x.R) * x.M);
  for (int d = 0; d < x.R; ++d) {
    const std::int64_t count = x.block(d, 0).count;
    EPMOE_CHECK_ARG(count >= 0 && count <= INT_MAX, "offered count", "in [0, 2^31)", count);
    x.send_meta[static_cast<std::size_t>(d) * x.M] = count;
    for (int f = 0; f < x.F; ++f) {
      const RowBlock& b = x.block(d, f);
      EPMOE_ASSERT(b.count == count);  // every field of one destination has the same count
      EPMOE_CHECK_ARG(b.row_bytes <= static_cast<std::size_t>(INT_MAX), "offered row_bytes", "< 2^31", b.row_bytes);
      EPMOE_ASSERT(count == 0 || b.row_bytes == 0 || b.base != nullptr);
      x.send_meta[static_cast<std::size_t>(d) * x.M + 1 + static_cast<std::size_t>(f)] =
          static_cast<std::int64_t>(b.row_bytes);
    }
  }
}

// 2. Count exchange: the receiver learns how many rows of which size come from every source (before it can post
// its receives), and this rank's own entry is copied.
void MpiTransport::exchange_counts(Exchange& x, std::string_view phase) {
  const MPI_Comm comm = group_->comm();
  for (int s = 0; s < x.R; ++s) {
    if (s == x.me) continue;
    x.requests.emplace_back();
    x.peers.push_back(s);
    check_mpi(MPI_Irecv(&x.recv_meta[static_cast<std::size_t>(s) * x.M], static_cast<int>(x.M), MPI_INT64_T, s,
                        kCountTag, comm, &x.requests.back()),
              "MPI_Irecv");
  }
  for (int d = 0; d < x.R; ++d) {
    if (d == x.me) continue;
    x.requests.emplace_back();
    x.peers.push_back(d);
    check_mpi(MPI_Isend(&x.send_meta[static_cast<std::size_t>(d) * x.M], static_cast<int>(x.M), MPI_INT64_T, d,
                        kCountTag, comm, &x.requests.back()),
              "MPI_Isend");
  }
  group_->wait_all(x.requests, x.peers, phase, "count exchange");
  const std::size_t own = static_cast<std::size_t>(x.me) * x.M;
  std::copy_n(&x.send_meta[own], x.M, &x.recv_meta[own]);
}

// 3. Receive layout: per source, per field, count * row_bytes bytes of `staging`, each block 64-byte aligned (the
// views handed back point there).
void MpiTransport::lay_out_receives(Exchange& x, Scratch& staging) const {
  const int R = x.R, F = x.F;
  std::vector<std::size_t> recv_offset(static_cast<std::size_t>(R * F), 0);
  std::size_t recv_total = 0;
  for (int s = 0; s < R; ++s) {
    if (s == x.me) continue;
    const auto count = static_cast<std::size_t>(x.recv_count(s));
    for (int f = 0; f < F; ++f) {
      recv_offset[static_cast<std::size_t>(s * F + f)] = recv_total;
      recv_total += align_up(count * x.recv_row_bytes(s, f));
    }
  }
  std::byte* recv_base = staging.reserve(std::max<std::size_t>(recv_total, 1));
  x.recv_ptr.assign(static_cast<std::size_t>(R * F), nullptr);
  for (int s = 0; s < R; ++s)
    for (int f = 0; f < F && s != x.me; ++f)
      x.recv_ptr[static_cast<std::size_t>(s * F + f)] = recv_base + recv_offset[static_cast<std::size_t>(s * F + f)];
}

// Send staging for packed indexed blocks, sized up front so packing never reallocates (pack_indexed_ only).
void MpiTransport::reserve_packing(Exchange& x) {
  std::size_t pack_total = 0;
  if (pack_indexed_)
    for (int d = 0; d < x.R; ++d)
      for (int f = 0; f < x.F && d != x.me; ++f) {
        const RowBlock& b = x.block(d, f);
        if (b.index) pack_total += align_up(static_cast<std::size_t>(b.count) * b.row_bytes);
      }
  x.pack = pack_total ? send_staging_.reserve(pack_total) : nullptr;
}

// 4a. Every receive, posted before any send: one message per source, a struct of its fields' blocks.
void MpiTransport::post_row_receives(Exchange& x, Datatypes& types) {
  for (int s = 0; s < x.R; ++s) {
    if (s == x.me) continue;
    const auto count = static_cast<int>(x.recv_count(s));
    MessageBuilder msg;
    for (int f = 0; f < x.F; ++f) {
      const std::size_t row_bytes = x.recv_row_bytes(s, f);
      if (row_bytes) msg.add(x.recv_ptr[static_cast<std::size_t>(s * x.F + f)], count, types.row(row_bytes));
    }
    if (msg.empty()) continue;
    x.requests.emplace_back();
    x.peers.push_back(s);
    check_mpi(MPI_Irecv(MPI_BOTTOM, 1, msg.commit(types), s, kRowsTag, group_->comm(), &x.requests.back()),
              "MPI_Irecv");
  }
}

// 4b. Pack (pack_indexed_) and send destination by destination, starting after this rank so that not every rank
// sends to rank 0 first. Each block goes straight from the caller's memory unless packed: contiguous, strided
// (hvector) or indexed (hindexed) rows.
void MpiTransport::post_row_sends(Exchange& x, Datatypes& types) {
  std::size_t packed = 0;
  for (int step = 1; step < x.R; ++step) {
    const int d = (x.me + step) % x.R;
    const auto count = static_cast<int>(x.send_meta[static_cast<std::size_t>(d) * x.M]);
    MessageBuilder msg;
    for (int f = 0; f < x.F && count > 0; ++f) {
      const RowBlock& b = x.block(d, f);
      if (b.row_bytes == 0) continue;
      const MPI_Datatype row = types.row(b.row_bytes);
      if (b.index && pack_indexed_) {
        std::byte* out = x.pack + packed;
        for (int i = 0; i < count; ++i)
          std::memcpy(out + static_cast<std::size_t>(i) * b.row_bytes, b.row(i), b.row_bytes);
        packed += align_up(static_cast<std::size_t>(count) * b.row_bytes);
        msg.add(out, count, row);
      } else if (b.index) {
        std::vector<MPI_Aint> displacements(static_cast<std::size_t>(count));
        for (int i = 0; i < count; ++i)
          displacements[static_cast<std::size_t>(i)] =
              static_cast<MPI_Aint>(b.index[i]) * static_cast<MPI_Aint>(b.stride_bytes);
        // (Merging runs of adjacent rows into longer blocks measured no faster.)
        MPI_Datatype t;
        check_mpi(MPI_Type_create_hindexed_block(count, 1, displacements.data(), row, &t),
                  "MPI_Type_create_hindexed_block");
        msg.add(b.base, 1, types.keep(t));
      } else if (b.stride_bytes == b.row_bytes || count == 1) {
        msg.add(b.base, count, row);
      } else {
        MPI_Datatype t;
        check_mpi(MPI_Type_create_hvector(count, 1, static_cast<MPI_Aint>(b.stride_bytes), row, &t),
                  "MPI_Type_create_hvector");
        msg.add(b.base, 1, types.keep(t));
      }
    }
    if (msg.empty()) continue;
    x.requests.emplace_back();
    x.peers.push_back(d);
    check_mpi(MPI_Isend(MPI_BOTTOM, 1, msg.commit(types), d, kRowsTag, group_->comm(), &x.requests.back()),
              "MPI_Isend");
  }
}

// 5. Views: this rank's own blocks are handed back as offered (zero copy, like the threads backend), the others
// point into the receive staging.
std::vector<RowBlock> MpiTransport::received_views(const Exchange& x) {
  std::vector<RowBlock> received(static_cast<std::size_t>(x.R * x.F));
  for (int s = 0; s < x.R; ++s)
    for (int f = 0; f < x.F; ++f) {
      RowBlock& r = received[static_cast<std::size_t>(s * x.F + f)];
      if (s == x.me) {
        r = x.block(x.me, f);
        continue;
      }
      r.base = x.recv_ptr[static_cast<std::size_t>(s * x.F + f)];
      r.row_bytes = x.recv_row_bytes(s, f);
      r.stride_bytes = r.row_bytes;
      r.index = nullptr;
      r.count = x.recv_count(s);
    }
  return received;
}

std::vector<RowBlock> MpiTransport::exchange(std::span<const RowBlock> offered, int num_fields,
                                             std::string_view phase) {
  group_->check_usable(phase);
  Exchange x;
  x.offered = offered;
  x.R = group_->size();
  x.me = group_->rank();
  x.F = num_fields;
  EPMOE_ASSERT(x.F >= 1 && offered.size() == static_cast<std::size_t>(x.R) * static_cast<std::size_t>(x.F));
  x.M = static_cast<std::size_t>(x.F) + 1;
  describe_sends(x);
  x.requests.reserve(static_cast<std::size_t>(4 * x.R));
  x.peers.reserve(static_cast<std::size_t>(4 * x.R));
  exchange_counts(x, phase);
  Scratch& staging = recv_staging();
  lay_out_receives(x, staging);
  reserve_packing(x);
  Datatypes types;
  x.requests.clear();
  x.peers.clear();
  post_row_receives(x, types);
  post_row_sends(x, types);
  try {
    group_->wait_all(x.requests, x.peers, phase, "exchange of rows");
  } catch (const Error&) {
    group_->keep_after_fault(staging.data);  // abandoned receives may still land here
    group_->keep_after_fault(send_staging_.data);
    throw;
  }
  return received_views(x);
}

void MpiTransport::free_window(std::string_view phase, bool in_destructor) {
  if (window_ == MPI_WIN_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  // MPI_Win_free is a blocking collective: only call it once every rank is known to be there.
  // After a fault (or MPI_Finalize) the window is left to the process's end instead.
  bool all_here = !finalized && !group_->broken();
  if (all_here) {
    try {
      group_->barrier(phase);
    } catch (const Error&) {
      if (!in_destructor) throw;
      all_here = false;
    }
  }
  if (all_here) {
    MPI_Win_unlock_all(window_);
    MPI_Win_free(&window_);
  }
  window_ = MPI_WIN_NULL;
  base_ = nullptr;
  window_bytes_ = 0;
  num_signals_ = 0;
}

void MpiTransport::allocate_window(std::size_t bytes, int num_signals, std::string_view phase) {
  group_->check_usable(phase);
  EPMOE_CHECK_ARG(num_signals >= 0, "num_signals", ">= 0", num_signals);
  // Equal sizes on every rank; the comparison doubles as the barrier after which nobody writes into
  // the old window any more.
  const Setting sizes[] = {{"window_bytes", static_cast<std::int64_t>(bytes)}, {"num_signals", num_signals}};
  group_->check_agreement(sizes, phase);
  if (window_ != MPI_WIN_NULL) {
    MPI_Win_unlock_all(window_);
    check_mpi(MPI_Win_free(&window_), "MPI_Win_free");
    window_ = MPI_WIN_NULL;
  }
  data_offset_ = align_up(static_cast<std::size_t>(num_signals) * sizeof(std::uint64_t));
  const std::size_t total = data_offset_ + bytes;
  MPI_Info info;
  check_mpi(MPI_Info_create(&info), "MPI_Info_create");
  MPI_Info_set(info, "same_size", "true");
  MPI_Info_set(info, "accumulate_ops", "same_op_no_op");  // REPLACE for signals, NO_OP to read them
  std::byte* base = nullptr;
  const int rc = MPI_Win_allocate(static_cast<MPI_Aint>(total), 1, info, group_->comm(), &base, &window_);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS) {
    window_ = MPI_WIN_NULL;
    raise(ErrorCode::out_of_memory, "MPI transport: MPI_Win_allocate of {} bytes ({} window + {} signal slots) failed",
          total, bytes, num_signals);
  }
  check_mpi(MPI_Win_set_errhandler(window_, MPI_ERRORS_RETURN), "MPI_Win_set_errhandler");
  base_ = base;
  window_bytes_ = bytes;
  num_signals_ = num_signals;
  if (total) std::memset(base_, 0, total);
  check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, window_), "MPI_Win_lock_all");
  check_mpi(MPI_Win_sync(window_), "MPI_Win_sync");
  group_->barrier(phase);  // every window is zeroed before any peer puts into it
}

void MpiTransport::put(int dst, std::size_t offset, const void* src, std::size_t bytes) {
  EPMOE_ASSERT(window_ != MPI_WIN_NULL && dst >= 0 && dst < group_->size());
  EPMOE_ASSERT(offset <= window_bytes_ && bytes <= window_bytes_ - offset);
  constexpr std::size_t chunk = std::size_t{1} << 30;  // MPI counts are int
  const auto* p = static_cast<const std::byte*>(src);
  for (std::size_t done = 0; done < bytes; done += chunk) {
    const int n = static_cast<int>(std::min(chunk, bytes - done));
    check_mpi(MPI_Put(p + done, n, MPI_BYTE, dst, static_cast<MPI_Aint>(data_offset_ + offset + done), n, MPI_BYTE,
                      window_),
              "MPI_Put");
  }
  // The caller may reuse `src` once put returns (as with the threads backend).
  if (bytes) check_mpi(MPI_Win_flush_local(dst, window_), "MPI_Win_flush_local");
}

void MpiTransport::signal(int dst, int slot, std::uint64_t value) {
  EPMOE_ASSERT(window_ != MPI_WIN_NULL && dst >= 0 && dst < group_->size());
  EPMOE_ASSERT(slot >= 0 && slot < num_signals_);
  // The flush completes this rank's earlier puts at dst, so the data is in place before the signal.
  check_mpi(MPI_Win_flush(dst, window_), "MPI_Win_flush");
  check_mpi(MPI_Accumulate(&value, 1, MPI_UINT64_T, dst, static_cast<MPI_Aint>(slot) * 8, 1, MPI_UINT64_T, MPI_REPLACE,
                           window_),
            "MPI_Accumulate");
  check_mpi(MPI_Win_flush(dst, window_), "MPI_Win_flush");
}

void MpiTransport::wait_signal(int slot, std::uint64_t value, int peer, std::string_view phase) {
  group_->check_usable(phase);
  EPMOE_ASSERT(window_ != MPI_WIN_NULL && slot >= 0 && slot < num_signals_);
  const int me = group_->rank();
  std::uint64_t current = 0;
  int rc = MPI_SUCCESS;
  // Fetch_and_op(NO_OP) on our own slot is atomic with respect to the peers' accumulates. Each poll
  // enters MPI, which also drives progress for osc components whose passive-target operations need
  // the target to progress (osc pt2pt); osc rdma and sm, Open MPI's defaults on one host, do not.
  auto arrived = [&] {
    rc = MPI_Fetch_and_op(nullptr, &current, MPI_UINT64_T, me, static_cast<MPI_Aint>(slot) * 8, MPI_NO_OP, window_);
    if (rc == MPI_SUCCESS) rc = MPI_Win_flush(me, window_);
    return rc != MPI_SUCCESS || current >= value;
  };
  const bool ok = poll_until(arrived, group_->timeout_s());
  check_mpi(rc, "MPI_Fetch_and_op");
  if (!ok)
    group_->timeout(peer, phase, fmt::format("signal slot {} is {}, expected >= {}", slot, current, value));
  check_mpi(MPI_Win_sync(window_), "MPI_Win_sync");  // the peer's puts are visible to this rank's loads
}

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(std::shared_ptr<Group> group, bool pack_rows) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  return std::make_unique<MpiTransport>(std::move(group), pack_rows);
}

}  // namespace epmoe
