// Error type and messages: argument errors name argument / expected / actual; codes have names.
#include <gtest/gtest.h>

#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/timeout.hpp>

#include <string>

namespace epmoe {
namespace {

TEST(Error, CheckArgNamesArgumentExpectedAndActual) {
  const int k = 40;
  try {
    EPMOE_CHECK_ARG(k <= 32, "num_topk", "in [1, 32]", k);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_STREQ(e.what(), "epmoe: invalid argument 'num_topk': expected in [1, 32], got 40");
  }
}

TEST(Error, CheckArgFormatsShapesAndEvaluatesLazily) {
  int evaluated = 0;
  auto expensive = [&] {
    ++evaluated;
    return std::string("x");
  };
  EPMOE_CHECK_ARG(true, "a", expensive(), expensive());
  EXPECT_EQ(evaluated, 0);
  try {
    EPMOE_CHECK_ARG(false, "x", Shape({4, 7168}), describe(TensorView(nullptr, DType::bf16, {4, 7000})));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "epmoe: invalid argument 'x': expected [4, 7168], got bfloat16[4, 7000] cpu");
  }
}

// One wording for a tensor of a dtype the argument does not take, whichever check finds it (the bindings' check of a
// dtype epmoe cannot hold uses it too).
TEST(Error, AWrongDtypeIsSaidInOneWording) {
  try {
    throw_wrong_dtype("topk_idx", "int64 or int32", describe(TensorView(nullptr, DType::int16, {4, 2})));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_STREQ(e.what(), "epmoe: invalid argument 'topk_idx': expected dtype int64 or int32, got int16[4, 2] cpu");
  }
  try {
    check_topk_idx_dtype(TensorView(nullptr, DType::fp32, {4, 2}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "epmoe: invalid argument 'topk_idx': expected dtype int64 or int32, got float32[4, 2] cpu");
  }
}

// The argument a message names, said as a caller knows it: the whole name, or a part of it followed by a blank or a
// colon; another argument whose name starts alike, a name elsewhere in the message, and other messages are left alone.
TEST(Error, NamingArgumentRenamesTheArgumentTheMessageNames) {
  const std::string bias = "epmoe: invalid argument 'options.e_score_correction_bias': expected stride 1, got 2";
  EXPECT_EQ(naming_argument(bias, "options.e_score_correction_bias", "e_score_correction_bias"),
            "epmoe: invalid argument 'e_score_correction_bias': expected stride 1, got 2");
  EXPECT_EQ(naming_argument("epmoe: invalid argument 'routing topk_idx': expected ids in [-1, 64), got 70", "routing",
                            "--routing"),
            "epmoe: invalid argument '--routing topk_idx': expected ids in [-1, 64), got 70");
  EXPECT_EQ(naming_argument("epmoe: invalid argument 'a.json:num_sms': expected 0..64, got 99", "a.json",
                            "--config a.json"),
            "epmoe: invalid argument '--config a.json:num_sms': expected 0..64, got 99");
  const std::string x_scales =
      "epmoe: invalid argument 'x_scales': expected None with bfloat16 x, got float32[2, 1] cpu";
  EXPECT_EQ(naming_argument(x_scales, "x", "y"), x_scales);
  EXPECT_EQ(naming_argument(x_scales, "bfloat16", "y"), x_scales);
  EXPECT_EQ(naming_argument("epmoe: timed out: 'x_scales'", "x_scales", "y"), "epmoe: timed out: 'x_scales'");
  EXPECT_EQ(naming_argument("epmoe: invalid argument 'x", "x", "y"), "epmoe: invalid argument 'x");
}

TEST(Error, RaiseAndAssert) {
  try {
    raise(ErrorCode::out_of_memory, "buffer too small: need {} bytes, have {}", 4096, 1024);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory);
    EXPECT_STREQ(e.what(), "epmoe: buffer too small: need 4096 bytes, have 1024");
  }
  try {
    EPMOE_ASSERT(1 + 1 == 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::internal);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("1 + 1 == 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("error_test.cpp"), std::string::npos) << msg;
  }
}

TEST(Error, EveryCodeHasAName) {
  EXPECT_EQ(error_code_name(ErrorCode::invalid_argument), "invalid_argument");
  EXPECT_EQ(error_code_name(ErrorCode::rank_mismatch), "rank_mismatch");
  EXPECT_EQ(error_code_name(ErrorCode::timeout), "timeout");
  EXPECT_EQ(error_code_name(ErrorCode::stale_handle), "stale_handle");
  EXPECT_EQ(error_code_name(ErrorCode::unusable), "unusable");
  EXPECT_EQ(error_code_name(ErrorCode::out_of_memory), "out_of_memory");
  EXPECT_EQ(error_code_name(ErrorCode::unsupported), "unsupported");
  EXPECT_EQ(error_code_name(ErrorCode::internal), "internal");
}

TEST(Error, TimeoutMessageNamesRankPeerPhase) {
  try {
    throw_timeout(2, 5, "dispatch_recv", 1.5, "received 3 of 8 tokens");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_STREQ(
        e.what(),
        "epmoe: rank 2 timed out after 1.5 s waiting for peer 5 in phase 'dispatch_recv': received 3 of 8 tokens");
  }
}

TEST(Timeout, DefaultAndDeadline) {
  EXPECT_GT(default_timeout_s(), 0.0);
  EXPECT_TRUE(Deadline(0.0).expired());
  EXPECT_FALSE(Deadline(1000.0).expired());
}

}  // namespace
}  // namespace epmoe
