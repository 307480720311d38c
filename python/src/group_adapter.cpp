// epmoe._ext.Group.from_all_gather: an epmoe::Group whose collectives are one Python callable, so a
// torch.distributed ProcessGroup or an mpi4py communicator can bootstrap a Buffer (epmoe/_group.py makes
// the callable). Only small control data crosses it: the cuda_ipc backend's IPC handles at construction
// and its per-call settings check; the bulk data moves over NVLink.
//
// Every collective is built on all_gather (barrier: one byte each; broadcast: the root's slice). The
// C++ callers hold no GIL (the bindings release it around every Buffer call); the adapter takes it for
// the Python call and turns any Python exception into epmoe::Error naming the rank and the phase.
#include "ext.hpp"

#include <epmoe/error.hpp>

#include <nanobind/stl/string.h>

#include <cstring>

#include <fmt/format.h>

namespace epmoe::py {

namespace {

class CallbackGroup final : public Group {
 public:
  CallbackGroup(int rank, int size, std::string backend, nb::callable all_gather)
      : rank_(rank), size_(size), backend_(std::move(backend)), all_gather_(make_ref(all_gather)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return backend_; }

  void barrier(std::string_view phase) override {
    const char one = 1;
    std::vector<char> all(static_cast<std::size_t>(size_));
    all_gather(&one, all.data(), 1, phase);
  }

  void all_gather(const void* send, void* recv, std::size_t bytes, std::string_view phase) override {
    if (unusable_)
      throw Error(ErrorCode::unusable,
                  fmt::format("epmoe: rank {}: the '{}' group is unusable after an earlier failure", rank_, backend_));
    nb::gil_scoped_acquire gil;
    std::string why;
    try {
      nb::object out = (*all_gather_)(nb::bytes(static_cast<const char*>(send), bytes), std::string(phase));
      nb::bytes got = nb::cast<nb::bytes>(out);
      const std::size_t expected = bytes * static_cast<std::size_t>(size_);
      if (got.size() != expected) {
        why = fmt::format("the all_gather callable returned {} bytes, expected {} ({} ranks x {} bytes)", got.size(),
                          expected, size_, bytes);
      } else {
        if (expected) std::memcpy(recv, got.c_str(), expected);
        return;
      }
    } catch (nb::python_error& e) {
      why = e.what();
    } catch (nb::cast_error&) {
      why = "the all_gather callable did not return bytes";
    }
    // A failed collective leaves the ranks out of step: no later call may go on as if it had worked.
    unusable_ = true;
    throw Error(ErrorCode::internal, fmt::format("epmoe: rank {}: the '{}' group's all_gather in phase '{}' failed: {}",
                                                 rank_, backend_, phase, why));
  }

  void broadcast(void* data, std::size_t bytes, int root, std::string_view phase) override {
    check_root(root);
    std::vector<char> all(bytes * static_cast<std::size_t>(size_));
    all_gather(data, all.data(), bytes, phase);
    if (bytes) std::memcpy(data, all.data() + static_cast<std::size_t>(root) * bytes, bytes);
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= size_)
      throw_invalid_argument("root", fmt::format("a rank in [0, {})", size_), fmt::format("{}", root));
  }

  int rank_, size_;
  std::string backend_;
  PyRef all_gather_;
  bool unusable_ = false;
};

}  // namespace

std::shared_ptr<Group> make_callback_group(int rank, int size, std::string backend, nb::callable all_gather) {
  if (size < 1) throw_invalid_argument("size", ">= 1", fmt::format("{}", size));
  if (rank < 0 || rank >= size) throw_invalid_argument("rank", fmt::format("in [0, {})", size), fmt::format("{}", rank));
  if (backend == "threads" || backend == "mpi" || backend.empty())
    throw_invalid_argument("backend", "a name other than '', 'threads' and 'mpi' (those have native groups)",
                           fmt::format("'{}'", backend));
  return std::make_shared<CallbackGroup>(rank, size, std::move(backend), std::move(all_gather));
}

}  // namespace epmoe::py
