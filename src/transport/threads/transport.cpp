// The threads transport: ranks are threads of one process, so peers read each other's memory.
#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "transport/group/threads_world.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe {

std::shared_ptr<ThreadWorld::State> thread_world_state(Group& g);

namespace {

// Per-world registry of each rank's window and signals, kept beside the world's state.
struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
struct Window {
  std::unique_ptr<std::byte[], FreeDeleter> data;  // calloc: zeroed pages, touched only where used
  std::size_t bytes = 0;
  std::unique_ptr<std::atomic<std::uint64_t>[]> signals;
  int num_signals = 0;
};

class ThreadsTransport final : public Transport {
 public:
  explicit ThreadsTransport(std::shared_ptr<Group> group)
      : group_(std::move(group)), state_(thread_world_state(*group_)) {
    EPMOE_CHECK_ARG(state_ != nullptr, "group", "a group of a ThreadWorld", group_->backend());
  }
  Group& group() override { return *group_; }

  std::vector<RowBlock> exchange(std::span<const RowBlock> offered, int num_fields, std::string_view phase) override {
    const int R = group_->size(), me = group_->rank();
    EPMOE_ASSERT(offered.size() == static_cast<std::size_t>(R * num_fields));
    // Publish a pointer to our descriptors; after the barrier every peer reads its own entries
    // straight from our memory (no staging copy).
    state_->pointers[static_cast<std::size_t>(me)] = offered.data();
    group_->barrier(phase);
    std::vector<RowBlock> received(static_cast<std::size_t>(R * num_fields));
    for (int s = 0; s < R; ++s) {
      const auto* theirs = static_cast<const RowBlock*>(state_->pointers[static_cast<std::size_t>(s)]);
      for (int f = 0; f < num_fields; ++f)
        received[static_cast<std::size_t>(s * num_fields + f)] = theirs[me * num_fields + f];
    }
    return received;
  }

  void end_exchange(std::string_view phase) override { group_->barrier(phase); }

  void allocate_window(std::size_t bytes, int num_signals, std::string_view phase) override {
    group_->barrier(phase);  // nobody may still write into the old window
    auto w = std::make_shared<Window>();
    w->data.reset(static_cast<std::byte*>(std::calloc(bytes ? bytes : 1, 1)));
    if (!w->data)
      raise(ErrorCode::out_of_memory, "rank {}: allocating a window of {} bytes failed", group_->rank(), bytes);
    w->bytes = bytes;
    w->signals.reset(new std::atomic<std::uint64_t>[static_cast<std::size_t>(num_signals)]);
    for (int i = 0; i < num_signals; ++i) w->signals[static_cast<std::size_t>(i)].store(0);
    w->num_signals = num_signals;
    own_ = std::move(w);
    // Peers hold shared ownership: a late signal (e.g. a low-latency "consumed" flag sent after this
    // rank destroyed its Buffer) lands in memory that is still alive instead of freed memory.
    const std::shared_ptr<Window>* mine = &own_;
    std::vector<const std::shared_ptr<Window>*> all(static_cast<std::size_t>(group_->size()));
    group_->all_gather(&mine, all.data(), sizeof(mine), phase);
    std::vector<std::shared_ptr<const Window>> peers;
    peers.reserve(all.size());
    for (const auto* p : all) peers.push_back(*p);
    group_->barrier(phase);  // every rank has copied the others' pointers before any may change
    peers_ = std::move(peers);
  }
  std::byte* local_window() override { return own_ ? own_->data.get() : nullptr; }
  std::size_t window_bytes() const override { return own_ ? own_->bytes : 0; }

  void put(int dst, std::size_t offset, const void* src, std::size_t bytes) override {
    const Window* w = peers_[static_cast<std::size_t>(dst)].get();
    EPMOE_ASSERT(offset + bytes <= w->bytes);
    if (bytes) std::memcpy(w->data.get() + offset, src, bytes);
  }

  void signal(int dst, int slot, std::uint64_t value) override {
    const Window* w = peers_[static_cast<std::size_t>(dst)].get();
    EPMOE_ASSERT(slot >= 0 && slot < w->num_signals);
    w->signals[static_cast<std::size_t>(slot)].store(value, std::memory_order_release);  // publishes earlier puts
  }

  void wait_signal(int slot, std::uint64_t value, int peer, std::string_view phase) override {
    EPMOE_ASSERT(slot >= 0 && slot < own_->num_signals);
    auto& s = own_->signals[static_cast<std::size_t>(slot)];
    if (s.load(std::memory_order_acquire) >= value) return;
    const Deadline deadline(group_->timeout_s());
    for (int spins = 0;; ++spins) {
      if (s.load(std::memory_order_acquire) >= value) return;
      if (spins > 64) {
        if (state_->any_returned.load(std::memory_order_relaxed)) {
          std::lock_guard lock(state_->mutex);
          // The peer's signal happens before its return is recorded: read the slot again after seeing it.
          if (state_->has_returned(peer) && s.load(std::memory_order_acquire) < value)
            raise(ErrorCode::unusable, "rank {}: gave up waiting for peer {} in phase '{}': rank {} returned from "
                  "its function without sending it", group_->rank(), peer, phase, peer);
        }
        if (state_->aborted.load(std::memory_order_relaxed)) {
          std::lock_guard lock(state_->mutex);
          raise(ErrorCode::unusable, "rank {}: gave up waiting for peer {} in phase '{}': {}", group_->rank(), peer, phase,
                state_->broken_reason);
        }
        if (deadline.expired())
          throw_timeout(group_->rank(), peer, phase, group_->timeout_s(),
                        fmt::format("signal slot {} is {}, expected >= {}", slot, s.load(), value));
        std::this_thread::yield();
      }
    }
  }

 private:
  std::shared_ptr<Group> group_;
  std::shared_ptr<ThreadWorld::State> state_;
  std::shared_ptr<Window> own_;
  std::vector<std::shared_ptr<const Window>> peers_;
};

}  // namespace

std::unique_ptr<Transport> make_threads_transport(std::shared_ptr<Group> group) {
  return std::make_unique<ThreadsTransport>(std::move(group));
}

}  // namespace epmoe
