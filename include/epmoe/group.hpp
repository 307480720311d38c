// Groups: the ranks of one expert-parallel group, with bootstrap and small collectives.
//
// A Group moves control data (counts, settings, handles) between ranks; the dispatch and combine move their bulk
// data through a transport (see buffer.hpp). The all-gather baseline (make_all_gather_prepare_finalize) is the one
// user that sends tokens through the Group's all_gather and reduce_scatter_sum. Every collective names its phase; a wait that exceeds the group's
// timeout throws ErrorCode::timeout naming this rank, the missing peer(s) and the phase, and leaves
// the group unusable (ErrorCode::unusable on later calls) so no rank silently continues after a fault.
#pragma once

#include <epmoe/timeout.hpp>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe {

/// A setting that must agree on every rank, e.g. {"num_max_dispatch_tokens_per_rank", 128}.
struct Setting {
  std::string_view name;
  std::int64_t value;
};

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "threads", "mpi", ...
  virtual std::string_view backend() const = 0;
  /// How many of the group's ranks live in this process and share its memory: every rank for thread ranks, one
  /// where each rank is a process (MPI, the Python groups). A host-memory check adds up the windows of these.
  virtual int ranks_in_process() const { return 1; }

  /// Blocks until every rank has entered the barrier of the same phase.
  virtual void barrier(std::string_view phase) = 0;
  /// Every rank contributes `bytes` bytes; `recv` receives size()*bytes bytes, rank-major.
  virtual void all_gather(const void* send, void* recv, std::size_t bytes, std::string_view phase) = 0;
  /// Copies `bytes` bytes from `root`'s `data` to every rank's `data`.
  virtual void broadcast(void* data, std::size_t bytes, int root, std::string_view phase) = 0;
  /// Reduce-scatter of float32 sums. Every rank contributes `send`, float32 [size() * count] (block q of
  /// `count` values meant for rank q); rank r receives `recv`, float32 [count] = the sum over the ranks
  /// q = 0, 1, ..., size() - 1 of their block r, added in that order starting from rank 0's block:
  /// ((s_0 + s_1) + s_2) + ... in float32. Every backend sums in this one order, so the result is deterministic
  /// and bit-identical across backends (threads, mpi, the Python groups). `send` and `recv` must not overlap.
  /// The default (what a Group that does not override it gets, e.g. one implemented in Python) all-gathers the
  /// whole of every rank's `send` (size() times the bytes a reduce-scatter needs) and sums the own block; the
  /// threads group reads its peers' blocks in place, the MPI group exchanges blocks with one MPI_Ialltoall (not
  /// MPI_Reduce_scatter_block: MPI does not fix the order of its sums). Errors: as all_gather (timeout, unusable);
  /// invalid_argument naming send/recv when count > 0 and one is null.
  virtual void reduce_scatter_sum(const float* send, float* recv, std::size_t count, std::string_view phase);

  /// Compares the settings across ranks in one all-gather. On a mismatch every rank throws
  /// ErrorCode::rank_mismatch naming the setting, this rank's value and a differing rank's value.
  /// `settings` must have the same names, in the same order, on every rank (at most 16).
  void check_agreement(std::span<const Setting> settings, std::string_view phase);

  double timeout_s() const { return timeout_s_; }
  /// Seconds; one longer than kMaxTimeoutS (infinity included) is kMaxTimeoutS.
  void set_timeout_s(double s) { timeout_s_ = clamp_timeout_s(s); }

 private:
  double timeout_s_ = default_timeout_s();
};

/// R ranks as threads of one process. Create one world, hand `group(r)` to the thread of rank r.
/// The world must outlive every group it hands out.
class ThreadWorld {
 public:
  explicit ThreadWorld(int num_ranks);
  ~ThreadWorld();
  ThreadWorld(const ThreadWorld&) = delete;
  ThreadWorld& operator=(const ThreadWorld&) = delete;

  int size() const;
  /// The group of rank `rank`, in [0, size()).
  std::shared_ptr<Group> group(int rank);
  /// Marks the world broken because rank `rank` failed (`reason`, e.g. its error's message, whose "epmoe: " prefix
  /// is dropped as it is quoted inside the peers' messages): ranks waiting in, or later entering,
  /// a collective or a signal wait throw ErrorCode::unusable naming that rank at once, instead of
  /// waiting out their timeout. Records the order of the failures (failure_order).
  void abort(int rank, std::string_view reason);
  /// Per rank, the order in which abort() was first called for it (0 first), -1 for a rank never aborted: the
  /// `order` first_root_cause takes, so the failure nearest to the cause is the one reported.
  std::vector<int> failure_order() const;
  /// Records that rank `rank`'s function returned: it reaches no later collective, so ranks waiting in, or later
  /// entering, one it has not reached, or waiting for its signal, throw ErrorCode::unusable naming it at once,
  /// instead of waiting out their timeout. run_thread_ranks calls it for each rank that returns.
  void mark_returned(int rank);
  /// Runs `body(rank)` on one new thread per rank of this world and joins them all. `body` must not throw (catch
  /// in it). If the system cannot start a thread (more ranks than this machine runs threads), the world is
  /// aborted so the started ranks stop at their next collective, they are joined, and Error(out_of_memory)
  /// names the rank and size() (nothing is left running).
  void run_threads(const std::function<void(int rank)>& body);

  struct State;  // shared by the world's groups and transports

 private:
  std::shared_ptr<State> state_;
};

/// Runs `fn(group)` on `num_ranks` threads, one per rank of a fresh ThreadWorld, and joins them.
/// Returns one exception_ptr per rank (null where the rank returned normally).
std::vector<std::exception_ptr> run_thread_ranks_collect(int num_ranks, const std::function<void(Group&)>& fn,
                                                         double timeout_s = default_timeout_s());
/// The exception worth reporting among per-rank results (null when every rank succeeded): a root cause (an error
/// that is not a timeout or unusable, which are what the other ranks see of a failed one), else a timeout (a rank
/// that never came), else unusable. Among those of one kind, the first to fail by `order` (per rank: the order in
/// which the ranks failed, 0 first; empty: rank order), whose message is the nearest to the cause.
std::exception_ptr first_root_cause(const std::vector<std::exception_ptr>& errors, const std::vector<int>& order = {});
/// As above, with the kind of each exception given by `cause_class` (0 root cause, 1 timeout, 2 unusable), for
/// callers whose exceptions wrap epmoe's (the Python module).
std::exception_ptr first_root_cause(const std::vector<std::exception_ptr>& errors, const std::vector<int>& order,
                                    const std::function<int(const std::exception_ptr&)>& cause_class);
/// Rank `rank`'s error message `message` as run_thread_ranks re-raises it, so the caller learns which rank raised it:
/// "epmoe: rank R: ..." for "epmoe: ...", "rank R: ..." for another message; unchanged where it already names a rank
/// first ("rank 0: ..." after any "epmoe: ").
std::string naming_rank(std::string_view message, int rank);
/// Rethrows rank `rank`'s exception `e` naming the rank (naming_rank): an epmoe::Error as an epmoe::Error of the same
/// code; another std::exception as a std::runtime_error whose what() names the rank, nesting the original
/// (std::rethrow_if_nested gives it back with its own type: C++ cannot edit an exception's message in place); anything
/// else as it is (it has no message to name the rank in).
[[noreturn]] void rethrow_naming_rank(const std::exception_ptr& e, int rank);
/// As run_thread_ranks_collect, then rethrows first_root_cause() of the ranks' exceptions, if any: the failing rank's
/// own exception, whatever the rank order, naming that rank (rethrow_naming_rank: an epmoe::Error with the same code,
/// another std::exception as a std::runtime_error nesting it). Unlike run_thread_ranks_collect, a rank that throws
/// releases the others at once (ThreadWorld::abort): their collectives raise unusable naming it.
void run_thread_ranks(int num_ranks, const std::function<void(Group&)>& fn, double timeout_s = default_timeout_s());

}  // namespace epmoe
