// flatep::Error's text (public API: include/flatep/error.hpp) for what a caller may build itself: a category value
// outside the enum names itself "error", and a file name without a directory is kept whole in the "[file:line]" tail
// (the library's own errors carry __FILE__, a path, of which only the last component is shown).
#include <gtest/gtest.h>

#include <string>

#include "flatep/error.hpp"

namespace flatep {
namespace {

TEST(ErrorText, EveryCategoryHasANameAndAValueOutsideTheEnumIsError) {
    EXPECT_STREQ(category_name(ErrorCategory::kInvalidArgument), "invalid argument");
    EXPECT_STREQ(category_name(ErrorCategory::kRuntime), "runtime error");
    EXPECT_STREQ(category_name(ErrorCategory::kTimeout), "timeout");
    EXPECT_STREQ(category_name(ErrorCategory::kMismatch), "mismatch");
    EXPECT_STREQ(category_name(static_cast<ErrorCategory>(42)), "error");
    const Error e(static_cast<ErrorCategory>(-1), "dir/sub/file.cpp", 7, "odd");
    EXPECT_STREQ(e.what(), "flatep error: odd [file.cpp:7]");
}

TEST(ErrorText, AFileWithoutADirectoryIsShownWhole) {
    const Error plain(ErrorCategory::kTimeout, "plain.cpp", 12, "peer 1 did not arrive");
    EXPECT_STREQ(plain.what(), "flatep timeout: peer 1 did not arrive [plain.cpp:12]");
    EXPECT_EQ(plain.message(), "peer 1 did not arrive");
    EXPECT_EQ(plain.category(), ErrorCategory::kTimeout);
    const Error rooted(ErrorCategory::kMismatch, "/abs.cpp", 3, "m");
    EXPECT_STREQ(rooted.what(), "flatep mismatch: m [abs.cpp:3]");
}

}  // namespace
}  // namespace flatep
