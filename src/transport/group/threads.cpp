// The threads Group: R ranks as threads of one process.
#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "transport/group/threads_world.hpp"

namespace epmoe {

ThreadWorld::State::State(int n)
    : num_ranks(n),
      spin_before_sleep(static_cast<unsigned>(n) <= std::thread::hardware_concurrency()),
      arrived(static_cast<std::size_t>(n), false),
      arrived_in(static_cast<std::size_t>(n)),
      failure_order(static_cast<std::size_t>(n), -1),
      returned(static_cast<std::size_t>(n), false),
      slots(static_cast<std::size_t>(n)),
      pointers(static_cast<std::size_t>(n), nullptr) {}

void ThreadWorld::State::barrier(int rank, std::string_view op, std::string_view phase, double timeout_s) {
  std::unique_lock lock(mutex);
  if (broken) raise(ErrorCode::unusable, "rank {}: thread group is unusable after an earlier fault ({})", rank, broken_reason);
  const std::uint64_t gen = generation.load(std::memory_order_relaxed);
  arrived[static_cast<std::size_t>(rank)] = true;
  std::string& mine = arrived_in[static_cast<std::size_t>(rank)];
  mine.assign(op);
  mine.append(" '").append(phase).append("'");
  if (++count == num_ranks) {
    // Named against rank 0, the lowest differing rank second: the same words whichever rank arrived last.
    const std::string& first = arrived_in[0];
    for (int r = 1; r < num_ranks; ++r)
      if (arrived_in[static_cast<std::size_t>(r)] != first) {
        broken = mismatch = true;
        broken_reason = fmt::format("ranks met in different collectives: rank 0 in {}, rank {} in {}", first, r,
                                    arrived_in[static_cast<std::size_t>(r)]);
        cv.notify_all();
        raise(ErrorCode::rank_mismatch, "rank {}: {}", rank, broken_reason);
      }
    count = 0;
    std::fill(arrived.begin(), arrived.end(), false);
    generation.fetch_add(1, std::memory_order_release);
    cv.notify_all();
    return;
  }
  const Deadline deadline(timeout_s);
  // Poll a while before sleeping: a condition variable wakes its waiters tens of microseconds after the last
  // arrival (measured on the GPU machine: a rank's GPU handshake waited ~20 us for its peer's thread), skew that
  // the ranks' next step pays (a GPU op with a handshake, a timed run). Yielding keeps an oversubscribed core
  // usable; with more ranks than hardware threads there is no polling at all.
  if (spin_before_sleep) {
    lock.unlock();
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (generation.load(std::memory_order_acquire) == gen && !aborted.load(std::memory_order_relaxed) &&
           !any_returned.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    lock.lock();
  }
  // The ranks missing here that returned from their function: they will never arrive.
  const auto gone = [&] {
    std::string list;
    for (int r = 0; r < num_ranks; ++r)
      if (returned[static_cast<std::size_t>(r)] && !arrived[static_cast<std::size_t>(r)])
        list += fmt::format("{}{}", list.empty() ? "" : ", ", r);
    return list;
  };
  const bool done =
      cv.wait_until(lock, deadline.time_point(), [&] { return generation != gen || broken || !gone().empty(); });
  if (done && generation != gen) return;
  if (done && mismatch) raise(ErrorCode::rank_mismatch, "rank {}: {}", rank, broken_reason);
  if (done && !broken) {
    // Leave the barrier as if never entered: the world stays usable for what does not need the ranks gone.
    arrived[static_cast<std::size_t>(rank)] = false;
    --count;
    raise(ErrorCode::unusable, "rank {}: gave up waiting in phase '{}': rank(s) {} returned from their function "
          "without reaching it", rank, phase, gone());
  }
  // Woken because a rank failed (ThreadWorld::abort): that failure is the cause, not the ranks still missing.
  if (done && aborted.load())
    raise(ErrorCode::unusable, "rank {}: thread group broke while waiting in phase '{}' ({})", rank, phase,
          broken_reason);
  // Timed out, or woken because another waiter of this barrier timed out first: either way the
  // ranks still missing are the cause, so every waiter reports the timeout naming them (semantics §11).
  std::string missing;
  int first = -1;
  for (int r = 0; r < num_ranks; ++r)
    if (!arrived[static_cast<std::size_t>(r)]) {
      missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      if (first < 0) first = r;
    }
  if (!done) {
    broken = true;
    broken_reason = fmt::format("rank(s) {} did not reach phase '{}'", missing, phase);
    cv.notify_all();
  }
  if (first >= 0) throw_timeout(rank, first, phase, timeout_s, fmt::format("rank(s) {} did not arrive", missing));
  raise(ErrorCode::unusable, "rank {}: thread group broke while waiting in phase '{}' ({})", rank, phase, broken_reason);
}

namespace {

class ThreadGroup final : public Group {
 public:
  ThreadGroup(std::shared_ptr<ThreadWorld::State> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->num_ranks; }
  std::string_view backend() const override { return "threads"; }
  int ranks_in_process() const override { return size(); }

  void barrier(std::string_view phase) override { s_->barrier(rank_, "barrier", phase, timeout_s()); }

  void all_gather(const void* send, void* recv, std::size_t bytes, std::string_view phase) override {
    // Publish a pointer, meet, read everyone's, meet again so the pointers stay valid while read.
    s_->pointers[static_cast<std::size_t>(rank_)] = send;
    meet(fmt::format("all_gather of {} bytes per rank", bytes), phase);
    for (int r = 0; r < size(); ++r)
      if (bytes) std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(r) * bytes, s_->pointers[static_cast<std::size_t>(r)], bytes);
    meet("all_gather", phase);
  }

  void broadcast(void* data, std::size_t bytes, int root, std::string_view phase) override {
    EPMOE_CHECK_ARG(root >= 0 && root < size(), "root", fmt::format("a rank in [0, {})", size()), root);
    s_->pointers[static_cast<std::size_t>(rank_)] = data;
    meet(fmt::format("broadcast from root {} of {} bytes", root, bytes), phase);
    if (rank_ != root && bytes) std::memcpy(data, s_->pointers[static_cast<std::size_t>(root)], bytes);
    meet("broadcast", phase);
  }

  void reduce_scatter_sum(const float* send, float* recv, std::size_t count, std::string_view phase) override {
    EPMOE_CHECK_ARG(count == 0 || (send != nullptr && recv != nullptr), "send/recv", "non-null pointers", "null");
    // Publish the send buffer, meet, sum this rank's block straight out of every peer's buffer (rank order),
    // meet again so no buffer is released while a peer reads it.
    s_->pointers[static_cast<std::size_t>(rank_)] = send;
    meet(fmt::format("reduce_scatter_sum of {} floats per rank", count), phase);
    const std::size_t R = static_cast<std::size_t>(size()), off = static_cast<std::size_t>(rank_) * count;
    // Over chunks of the block so the accumulator stays in L1 while R source rows stream through.
    constexpr std::size_t kChunk = 4096;
    for (std::size_t i0 = 0; i0 < count; i0 += kChunk) {
      const std::size_t len = std::min(kChunk, count - i0);
      float* acc = recv + i0;
      std::memcpy(acc, static_cast<const float*>(s_->pointers[0]) + off + i0, len * sizeof(float));
      for (std::size_t q = 1; q < R; ++q) {
        const float* src = static_cast<const float*>(s_->pointers[q]) + off + i0;
        for (std::size_t j = 0; j < len; ++j) acc[j] += src[j];
      }
    }
    meet("reduce_scatter_sum", phase);
  }

  const std::shared_ptr<ThreadWorld::State>& state() const { return s_; }

 private:
  void meet(std::string_view op, std::string_view phase) { s_->barrier(rank_, op, phase, timeout_s()); }

  std::shared_ptr<ThreadWorld::State> s_;
  int rank_;
};

}  // namespace

ThreadWorld::ThreadWorld(int num_ranks) {
  EPMOE_CHECK_ARG(num_ranks >= 1, "num_ranks", ">= 1", num_ranks);
  state_ = std::make_shared<State>(num_ranks);
}
ThreadWorld::~ThreadWorld() = default;
int ThreadWorld::size() const { return state_->num_ranks; }

std::shared_ptr<Group> ThreadWorld::group(int rank) {
  EPMOE_CHECK_ARG(rank >= 0 && rank < size(), "rank", fmt::format("in [0, {})", size()), rank);
  return std::make_shared<ThreadGroup>(state_, rank);
}

void ThreadWorld::abort(int rank, std::string_view reason) {
  EPMOE_CHECK_ARG(rank >= 0 && rank < size(), "rank", fmt::format("in [0, {})", size()), rank);
  // A failure's own message ("epmoe: ...") is quoted inside the peers' messages: without its prefix.
  if (constexpr std::string_view head = "epmoe: "; reason.substr(0, head.size()) == head) reason.remove_prefix(head.size());
  std::lock_guard lock(state_->mutex);
  if (int& order = state_->failure_order[static_cast<std::size_t>(rank)]; order < 0) order = state_->failures++;
  if (!state_->broken) {
    state_->broken = true;
    state_->broken_reason = fmt::format("rank {} failed: {}", rank, reason);
  }
  state_->aborted.store(true);
  state_->cv.notify_all();
}

std::vector<int> ThreadWorld::failure_order() const {
  std::lock_guard lock(state_->mutex);
  return state_->failure_order;
}

void ThreadWorld::mark_returned(int rank) {
  EPMOE_CHECK_ARG(rank >= 0 && rank < size(), "rank", fmt::format("in [0, {})", size()), rank);
  std::lock_guard lock(state_->mutex);
  state_->returned[static_cast<std::size_t>(rank)] = true;
  state_->any_returned.store(true);
  state_->cv.notify_all();
}

void ThreadWorld::run_threads(const std::function<void(int rank)>& body) {
  const int n = size();
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  std::string failure;
  int failed_rank = -1;
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::system_error& e) {  // EAGAIN: the thread limit, or memory for the stack
      failure = e.what();
      failed_rank = r;
      abort(r, "its thread could not be started");
      break;
    }
  }
  for (auto& t : threads) t.join();
  if (failed_rank >= 0)
    raise(ErrorCode::out_of_memory,
          "could not start the thread of rank {} of {} ({}): this machine runs fewer threads; use fewer ranks",
          failed_rank, n, failure);
}

std::exception_ptr first_root_cause(const std::vector<std::exception_ptr>& errors, const std::vector<int>& order,
                                    const std::function<int(const std::exception_ptr&)>& cause_class) {
  std::exception_ptr best;
  int best_class = 0, best_order = 0;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    const int cls = cause_class(errors[r]), when = r < order.size() ? order[r] : 0;
    if (!best || cls < best_class || (cls == best_class && when < best_order)) {
      best = errors[r];
      best_class = cls;
      best_order = when;
    }
  }
  return best;
}

namespace {
int error_cause_class(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return err.code() == ErrorCode::timeout ? 1 : err.code() == ErrorCode::unusable ? 2 : 0;
  } catch (...) {
    return 0;
  }
}
}  // namespace

std::exception_ptr first_root_cause(const std::vector<std::exception_ptr>& errors, const std::vector<int>& order) {
  return first_root_cause(errors, order, error_cause_class);
}

std::shared_ptr<ThreadWorld::State> thread_world_state(Group& g) {
  auto* tg = dynamic_cast<ThreadGroup*>(&g);
  return tg ? tg->state() : nullptr;
}

namespace {
// abort_on_failure: a rank that throws marks the world broken (ThreadWorld::abort, which records the order of the
// failures), and one that returns is marked so (ThreadWorld::mark_returned), so ranks waiting for it raise unusable
// naming it at once instead of waiting out their timeout.
struct RankErrors {
  std::vector<std::exception_ptr> errors;  // per rank (null: returned normally)
  std::vector<int> order;                  // per rank: the order in which the ranks failed (ThreadWorld::failure_order)
};
RankErrors run_ranks(int num_ranks, const std::function<void(Group&)>& fn, double timeout_s, bool abort_on_failure) {
  ThreadWorld world(num_ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_ranks));
  world.run_threads([&](int r) {
    try {
      auto g = world.group(r);
      g->set_timeout_s(timeout_s);
      fn(*g);
      if (abort_on_failure) world.mark_returned(r);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      // The rank's own message: when it failed for a peer's sake (one that returned), that cause is named too.
      if (abort_on_failure) world.abort(r, e.what());
    } catch (...) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      if (abort_on_failure) world.abort(r, "it threw");
    }
  });
  return {std::move(errors), world.failure_order()};
}
}  // namespace

std::string naming_rank(std::string_view message, int rank) {
  constexpr std::string_view head = "epmoe: ";
  const bool has_head = message.substr(0, head.size()) == head;
  const std::string_view rest = has_head ? message.substr(head.size()) : message;
  // "rank 0: ..." names a rank; "rank one fails" (a caller's own words) does not.
  if (rest.size() > 5 && rest.substr(0, 5) == "rank " && rest[5] >= '0' && rest[5] <= '9') return std::string(message);
  return fmt::format("{}rank {}: {}", has_head ? head : "", rank, rest);
}

void rethrow_naming_rank(const std::exception_ptr& e, int rank) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& error) {  // the same code, its message naming the rank that raised it
    throw Error(error.code(), naming_rank(error.what(), rank));
  } catch (const std::exception& other) {
    std::throw_with_nested(std::runtime_error(naming_rank(other.what(), rank)));
  }
}

std::vector<std::exception_ptr> run_thread_ranks_collect(int num_ranks, const std::function<void(Group&)>& fn,
                                                         double timeout_s) {
  // Each rank's own outcome is the point here (tests of what every rank sees, a rank that returns early standing
  // for one that never arrives): no early release.
  return run_ranks(num_ranks, fn, timeout_s, false).errors;
}

void run_thread_ranks(int num_ranks, const std::function<void(Group&)>& fn, double timeout_s) {
  // Only the root cause comes back, so the others need not wait out their timeout for it.
  const RankErrors failed = run_ranks(num_ranks, fn, timeout_s, true);
  const std::exception_ptr e = first_root_cause(failed.errors, failed.order);
  if (!e) return;
  rethrow_naming_rank(e, static_cast<int>(std::find(failed.errors.begin(), failed.errors.end(), e) -
                                          failed.errors.begin()));
}

}  // namespace epmoe
