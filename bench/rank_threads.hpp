// What the thread-rank CPU benchmarks share (bench/threads_normal.cpp, bench/threads_all_gather.cpp): R persistent
// rank threads that run one job at a time, so a timed call does not pay thread start-up. Header-only, as
// bench_util.hpp.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace epmoe::bench {

/// R persistent rank threads (rank 0 is one of them too) that run one job at a time.
class RankThreads {
 public:
  explicit RankThreads(int R) : R_(R) {
    for (int r = 0; r < R; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  /// Runs job(rank) on every rank thread; returns the wall seconds until the last one finished.
  double run(const std::function<void(int)>& job) {
    std::unique_lock lock(m_);
    job_ = &job;
    pending_ = R_;
    error_ = nullptr;
    const auto start = std::chrono::steady_clock::now();
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (error_) std::rethrow_exception(error_);
    return s;
  }

 private:
  void loop(int r) {
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        job = job_;
      }
      std::exception_ptr err;
      try {
        (*job)(r);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard lock(m_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  int R_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace epmoe::bench
