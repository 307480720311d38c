// The MPI Group: rank, size and small collectives over a duplicated communicator, every wait
// non-blocking with the group's timeout (semantics §10, 11).
#include "transport/group/mpi.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

namespace epmoe {

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  raise(ErrorCode::internal, "MPI call {} failed: {} (error {})", call,
        std::string_view(text, static_cast<std::size_t>(len)), rc);
}

namespace {

bool mpi_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

/// An MPI datatype of exactly `bytes` bytes (count 1), so byte counts above INT_MAX are expressible.
class ByteBlock {
 public:
  explicit ByteBlock(std::size_t bytes) {
    if (bytes <= static_cast<std::size_t>(INT_MAX)) {
      type_ = MPI_BYTE;
      count_ = static_cast<int>(bytes);
      return;
    }
    // q chunks of 1 GiB plus the remainder, as one struct.
    constexpr std::size_t chunk = std::size_t{1} << 30;
    MPI_Datatype gib, chunks;
    check_mpi(MPI_Type_contiguous(static_cast<int>(chunk), MPI_BYTE, &gib), "MPI_Type_contiguous");
    check_mpi(MPI_Type_contiguous(static_cast<int>(bytes / chunk), gib, &chunks), "MPI_Type_contiguous");
    int lengths[2] = {1, static_cast<int>(bytes % chunk)};
    MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(bytes / chunk * chunk)};
    MPI_Datatype types[2] = {chunks, MPI_BYTE};
    check_mpi(MPI_Type_create_struct(2, lengths, displs, types, &type_), "MPI_Type_create_struct");
    check_mpi(MPI_Type_commit(&type_), "MPI_Type_commit");
    MPI_Type_free(&chunks);
    MPI_Type_free(&gib);
    owned_ = true;
    count_ = 1;
  }
  ~ByteBlock() {
    if (owned_ && mpi_initialized()) MPI_Type_free(&type_);
  }
  ByteBlock(const ByteBlock&) = delete;
  ByteBlock& operator=(const ByteBlock&) = delete;
  MPI_Datatype type() const { return type_; }
  int count() const { return count_; }

 private:
  MPI_Datatype type_ = MPI_BYTE;
  int count_ = 0;
  bool owned_ = false;
};

// Memory abandoned to pending MPI requests after a fault: MPI may still write into it until
// MPI_Finalize, so it outlives every group. Only filled on the (rare) timeout path.
std::mutex graveyard_mutex;
std::vector<std::shared_ptr<void>>& graveyard() {
  static auto* g = new std::vector<std::shared_ptr<void>>();  // never destroyed on purpose
  return *g;
}

}  // namespace

MpiGroup::MpiGroup(MPI_Comm comm) {
  if (!mpi_initialized())
    raise(ErrorCode::unsupported,
          "make_mpi_group: MPI is not initialised (or already finalised); call MPI_Init first or hold an "
          "epmoe::MpiSession");
  EPMOE_CHECK_ARG(comm != MPI_COMM_NULL, "comm", "a valid communicator", "MPI_COMM_NULL");
  int r = 0, n = 0;
  check_mpi(MPI_Comm_rank(comm, &r), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &n), "MPI_Comm_size");
  rank_ = r;
  size_ = n;
  // A private duplicate: epmoe's messages and collectives can never match the caller's.
  MPI_Request request;
  check_mpi(MPI_Comm_idup(comm, &comm_, &request), "MPI_Comm_idup");
  wait_collective(request, "make_mpi_group (MPI_Comm_idup)", "not every rank of the communicator joined");
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
}

MpiGroup::~MpiGroup() {
  // After a fault, requests on the communicator may still be pending: leave it to MPI_Finalize.
  if (!broken_ && comm_ != MPI_COMM_NULL && mpi_initialized()) MPI_Comm_free(&comm_);
}

void MpiGroup::check_usable(std::string_view phase) const {
  if (broken_)
    raise(ErrorCode::unusable, "rank {}: MPI group is unusable after an earlier fault ({}); phase '{}' not started",
          rank_, broken_reason_, phase);
}

void MpiGroup::keep_after_fault(std::shared_ptr<void> memory) {
  std::lock_guard lock(graveyard_mutex);
  graveyard().push_back(std::move(memory));
}

void MpiGroup::timeout(int peer, std::string_view phase, std::string detail) {
  broken_ = true;
  broken_reason_ = fmt::format("rank {} timed out in phase '{}'", rank_, phase);
  throw_timeout(rank_, peer, phase, timeout_s(), detail);
}

void MpiGroup::wait_all(std::span<MPI_Request> requests, std::span<const int> peers, std::string_view phase,
                        std::string_view what) {
  EPMOE_ASSERT(peers.size() == requests.size());
  int rc = MPI_SUCCESS;
  const int n = static_cast<int>(requests.size());
  auto all_done = [&] {
    int flag = 0;
    rc = MPI_Testall(n, requests.data(), &flag, MPI_STATUSES_IGNORE);
    return rc != MPI_SUCCESS || flag != 0;
  };
  const bool done = poll_until(all_done, timeout_s());
  check_mpi(rc, "MPI_Testall");
  if (done) return;
  // Name the peers whose messages are still outstanding.
  std::vector<int> missing;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == MPI_REQUEST_NULL) continue;
    int flag = 0;
    MPI_Test(&requests[i], &flag, MPI_STATUS_IGNORE);
    if (flag || requests[i] == MPI_REQUEST_NULL) continue;
    if (peers[i] >= 0 && std::find(missing.begin(), missing.end(), peers[i]) == missing.end())
      missing.push_back(peers[i]);
    // Point-to-point requests may be freed while active; MPI completes them in the background.
    if (peers[i] >= 0) MPI_Request_free(&requests[i]);
  }
  std::sort(missing.begin(), missing.end());
  std::string list;
  for (int p : missing) list += fmt::format("{}{}", list.empty() ? "" : ", ", p);
  if (missing.size() == 1) timeout(missing[0], phase, fmt::format("{} from/to rank {} did not complete", what, list));
  timeout(-1, phase,
               missing.empty() ? fmt::format("{} did not complete (one or more peers)", what)
                               : fmt::format("{} with ranks {} did not complete", what, list));
}

void MpiGroup::wait_collective(MPI_Request& request, std::string_view phase, std::string_view detail) {
  int rc = MPI_SUCCESS;
  auto done = [&] {
    int flag = 0;
    rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    return rc != MPI_SUCCESS || flag != 0;
  };
  const bool ok = poll_until(done, timeout_s());
  check_mpi(rc, "MPI_Test");
  if (ok) return;
  // A pending collective request may be neither cancelled nor freed (MPI-3.1 5.12): abandon it.
  request = MPI_REQUEST_NULL;
  timeout(-1, phase, fmt::format("one or more peers did not arrive; MPI cannot tell which ({})", detail));
}

void MpiGroup::barrier(std::string_view phase) {
  check_usable(phase);
  MPI_Request request;
  check_mpi(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
  wait_collective(request, phase, "barrier");
}

void MpiGroup::all_gather(const void* send, void* recv, std::size_t bytes, std::string_view phase) {
  check_usable(phase);
  EPMOE_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "send/recv", "non-null pointers", "null");
  // Private copies: after a timeout MPI may still read or write them, but not the caller's memory.
  auto staging = std::shared_ptr<std::byte[]>(new std::byte[bytes * static_cast<std::size_t>(size_ + 1)]);
  std::byte* my_copy = staging.get() + bytes * static_cast<std::size_t>(size_);
  if (bytes) std::memcpy(my_copy, send, bytes);
  const ByteBlock block(bytes);
  MPI_Request request;
  check_mpi(MPI_Iallgather(my_copy, block.count(), block.type(), staging.get(), block.count(), block.type(), comm_,
                           &request),
            "MPI_Iallgather");
  try {
    wait_collective(request, phase, fmt::format("all_gather of {} bytes", bytes));
  } catch (const Error&) {
    keep_after_fault(staging);
    throw;
  }
  if (bytes) std::memcpy(recv, staging.get(), bytes * static_cast<std::size_t>(size_));
}

void MpiGroup::broadcast(void* data, std::size_t bytes, int root, std::string_view phase) {
  check_usable(phase);
  EPMOE_CHECK_ARG(root >= 0 && root < size_, "root", fmt::format("a rank in [0, {})", size_), root);
  EPMOE_CHECK_ARG(bytes == 0 || data != nullptr, "data", "a non-null pointer", "null");
  auto staging = std::shared_ptr<std::byte[]>(new std::byte[bytes]);
  if (rank_ == root && bytes) std::memcpy(staging.get(), data, bytes);
  const ByteBlock block(bytes);
  MPI_Request request;
  check_mpi(MPI_Ibcast(staging.get(), block.count(), block.type(), root, comm_, &request), "MPI_Ibcast");
  try {
    wait_collective(request, phase, fmt::format("broadcast of {} bytes from root {}", bytes, root));
  } catch (const Error&) {
    keep_after_fault(staging);
    throw;
  }
  if (rank_ != root && bytes) std::memcpy(data, staging.get(), bytes);
}

void MpiGroup::reduce_scatter_sum(const float* send, float* recv, std::size_t count, std::string_view phase) {
  check_usable(phase);
  EPMOE_CHECK_ARG(count == 0 || (send != nullptr && recv != nullptr), "send/recv", "non-null pointers", "null");
  // Block q to rank q with one all-to-all, then the sum here in rank order: MPI_Reduce_scatter_block leaves the
  // order of its additions to the implementation, which would make the bits depend on the MPI library.
  const std::size_t R = static_cast<std::size_t>(size_), bytes = count * sizeof(float);
  // Private copies, as all_gather: after a timeout MPI may still touch them.
  auto staging = std::shared_ptr<float[]>(new float[2 * R * count]);
  float* my_copy = staging.get() + R * count;
  if (bytes) std::memcpy(my_copy, send, R * bytes);
  const ByteBlock block(bytes);
  MPI_Request request;
  check_mpi(MPI_Ialltoall(my_copy, block.count(), block.type(), staging.get(), block.count(), block.type(), comm_,
                          &request),
            "MPI_Ialltoall");
  try {
    wait_collective(request, phase, fmt::format("reduce_scatter_sum of {} float32 per rank", count));
  } catch (const Error&) {
    keep_after_fault(staging);
    throw;
  }
  const float* blocks = staging.get();
  for (std::size_t i = 0; i < count; ++i) {
    float acc = blocks[i];
    for (std::size_t q = 1; q < R; ++q) acc += blocks[q * count + i];
    recv[i] = acc;
  }
}

std::shared_ptr<Group> make_mpi_group(MPI_Comm comm) { return std::make_shared<MpiGroup>(comm); }

MpiSession::MpiSession(int* argc, char*** argv, int required) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) raise(ErrorCode::unsupported, "MpiSession: MPI was already finalised and cannot be initialised again");
  if (initialized) {
    MPI_Query_thread(&provided_);
  } else {
    check_mpi(MPI_Init_thread(argc, argv, required, &provided_), "MPI_Init_thread");
    owns_ = true;
  }
  if (provided_ < required) {
    if (owns_) MPI_Finalize();  // the destructor does not run when the constructor throws
    raise(ErrorCode::unsupported, "MpiSession: MPI provides thread level {}, expected at least {}", provided_,
          required);
  }
}

MpiSession::~MpiSession() {
  if (owns_ && mpi_initialized()) MPI_Finalize();
}

}  // namespace epmoe
