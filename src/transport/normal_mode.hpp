// Normal (high-throughput) mode, written once over Transport::exchange (SPEC 4).
#pragma once

#include <epmoe/buffer.hpp>

#include "transport/transport.hpp"

namespace epmoe {

class NormalMode {
 public:
  NormalMode(Transport& transport, std::uint64_t buffer_id) : transport_(transport), buffer_id_(buffer_id) {}
  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);

 private:
  Transport& transport_;
  std::uint64_t buffer_id_;
};

}  // namespace epmoe
