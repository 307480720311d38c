#include "core/check.hpp"
#include "transport/normal_mode.hpp"
namespace epmoe {
DispatchResult NormalMode::dispatch(const DispatchArgs&) { raise(ErrorCode::unsupported, "normal dispatch: not yet"); }
CombineResult NormalMode::combine(const CombineArgs&) { raise(ErrorCode::unsupported, "normal combine: not yet"); }
}  // namespace epmoe
