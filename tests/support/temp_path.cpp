#include "support/temp_path.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

namespace epmoe::test {

std::string temp_path(std::string_view prefix, std::string_view leaf) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = info != nullptr ? info->name() : "none";
  return ::testing::TempDir() + std::string(prefix) + "_" + std::to_string(::getpid()) + "_" + test + "_" +
         std::string(leaf);
}

}  // namespace epmoe::test
