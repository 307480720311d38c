#include "core/check.hpp"
#include "transport/low_latency_mode.hpp"
namespace epmoe {
std::int64_t LowLatencyMode::size_hint(int, std::int64_t, int, int) { return 0; }
LowLatencyDispatchResult LowLatencyMode::dispatch(const LowLatencyDispatchArgs&) { raise(ErrorCode::unsupported, "not yet"); }
LowLatencyCombineResult LowLatencyMode::combine(const LowLatencyCombineArgs&) { raise(ErrorCode::unsupported, "not yet"); }
void LowLatencyMode::clean(int, std::int64_t, int) {}
}  // namespace epmoe
