// The one error type of epmoe.
//
// Every failure the library reports is an epmoe::Error. Argument errors name the argument, what was
// expected and what came; cross-rank faults (timeouts, mismatched settings) name rank, peer and phase.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace epmoe {

/// What kind of failure an Error reports.
enum class ErrorCode {
  invalid_argument,  ///< bad dtype, shape, stride, device, limit or value; raised before any exchange
  rank_mismatch,     ///< settings that must agree across ranks differ (raised on every rank)
  timeout,           ///< a wait between ranks exceeded the timeout (names rank, peer, phase)
  stale_handle,      ///< a handle or hook used out of its lifetime (two-buffer rule, hook twice)
  unusable,          ///< the buffer/group is broken by an earlier fault and must be re-created
  out_of_memory,     ///< a buffer is too small or an allocation failed (says how much is needed)
  unsupported,       ///< a valid request this build or backend does not implement
  internal,          ///< a broken invariant or a failed CUDA call: a bug in epmoe or the system
};

std::string_view error_code_name(ErrorCode code);

/// Exception thrown by every epmoe function. `what()` is a complete, human-readable sentence
/// starting with "epmoe: ".
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Throws ErrorCode::invalid_argument: "epmoe: invalid argument 'NAME': expected EXPECTED, got ACTUAL".
[[noreturn]] void throw_invalid_argument(std::string_view argument, std::string_view expected,
                                         std::string_view actual);
/// An invalid_argument's message `message` ("epmoe: invalid argument 'NAME': ...", as throw_invalid_argument writes it)
/// naming its argument `as` where it names `name`, or a part of `name` ('routing topk_idx', 'FILE:num_sms': `name` then
/// a blank or a colon); any other message as it is. For callers that know an argument by another name than the one
/// the library gives it: the command line's flag ('--routing'), a Python argument ('num_topk' for 'options.num_topk').
std::string naming_argument(std::string_view message, std::string_view name, std::string_view as);
/// Throws ErrorCode::invalid_argument for a tensor of a dtype the argument does not take, in the one wording every call
/// uses, whether epmoe holds that dtype or not: "epmoe: invalid argument 'NAME': expected dtype TAKES, got ACTUAL"
/// (takes: "int64 or int32"; actual: the tensor described, "int16[4, 2] cpu").
[[noreturn]] void throw_wrong_dtype(std::string_view argument, std::string_view takes, std::string_view actual);
/// Throws ErrorCode::internal for a failed invariant.
[[noreturn]] void throw_assertion(const char* condition, const char* file, int line);

}  // namespace epmoe

/// Checks an internal invariant (a failure is a bug in epmoe, not in the caller's input).
#define EPMOE_ASSERT(cond)                                                   \
  do {                                                                       \
    if (!(cond)) ::epmoe::throw_assertion(#cond, __FILE__, __LINE__);        \
  } while (0)
