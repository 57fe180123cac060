// The environment variables the library reads on every call (common/env.cpp: each read calls getenv, so a test may
// set them in its own process), their fallbacks for unset and empty values and their exact refusals, and the log's
// level threshold (read once, at the first line logged: this binary logs nothing before the test below).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/env.hpp"
#include "common/log.hpp"
#include "flatep/error.hpp"

namespace flatep {
namespace {

// Sets `name` to `value` (nullptr: unset) for the scope, restoring what was there.
class EnvVar {
  public:
    EnvVar(const char* name, const char* value) : name_(name) {
        const char* old = std::getenv(name);
        had_ = old != nullptr;
        if (had_) old_ = old;
        set(value);
    }
    ~EnvVar() { set(had_ ? old_.c_str() : nullptr); }
    void set(const char* value) const {
        if (value == nullptr) {
            ::unsetenv(name_);
        } else {
            ::setenv(name_, value, 1);
        }
    }

  private:
    const char* name_;
    bool had_ = false;
    std::string old_;
};

template <class F>
std::string error_of(F&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.message();
    }
    return "(no error)";
}

TEST(Env, GetFallsBackOnUnsetAndEmpty) {
    EnvVar v("FLATEP_TEST_ENV_GET", nullptr);
    EXPECT_EQ(env::get("FLATEP_TEST_ENV_GET", "dflt"), "dflt");
    v.set("");
    EXPECT_EQ(env::get("FLATEP_TEST_ENV_GET", "dflt"), "dflt");
    v.set("x y");
    EXPECT_EQ(env::get("FLATEP_TEST_ENV_GET", "dflt"), "x y");
}

TEST(Env, TimeoutSecondsValuesAndRefusals) {
    EnvVar v("FLATEP_TIMEOUT_S", nullptr);
    EXPECT_EQ(env::timeout_seconds(), 100.0);
    v.set("");
    EXPECT_EQ(env::timeout_seconds(), 100.0);
    v.set("2.5");
    EXPECT_EQ(env::timeout_seconds(), 2.5);
    EXPECT_EQ(env::resolve_timeout("op", 0), 2.5);  // 0: the variable's
    EXPECT_EQ(env::resolve_timeout("op", 7), 7.0);
    v.set("86400");
    EXPECT_EQ(env::timeout_seconds(), 86400.0);
    for (const char* bad : {"abc", "1.5s", "0", "-3", "inf", "nan", "86401", " "}) {
        v.set(bad);
        EXPECT_EQ(error_of([] { env::timeout_seconds(); }),
                  std::string("FLATEP_TIMEOUT_S must be a number of seconds in (0, 86400], got '") + bad + "'")
            << bad;
    }
}

TEST(Env, NumSmsValuesAndRefusals) {
    EnvVar v("FLATEP_NUM_SMS", nullptr);
    EXPECT_EQ(env::num_sms(), 0);
    v.set("");
    EXPECT_EQ(env::num_sms(), 0);
    v.set("12");
    EXPECT_EQ(env::num_sms(), 12);
    const std::string max = std::to_string(env::kMaxNumSms);
    v.set(max.c_str());
    EXPECT_EQ(env::num_sms(), env::kMaxNumSms);
    const std::string above = std::to_string(env::kMaxNumSms + 1);
    for (const std::string& bad :
         {std::string("x"), std::string("12a"), std::string("-1"), above, std::string("1.0")}) {
        v.set(bad.c_str());
        EXPECT_EQ(error_of([] { env::num_sms(); }),
                  "FLATEP_NUM_SMS must be an integer in [0, " + max + "], got '" + bad + "'")
            << bad;
    }
}

// FLATEP_LOG_LEVEL=2 before the first line: levels 0 and 1 are warnings, 2 a plain line, 3 nothing.
TEST(Log, LevelThresholdAndPrefix) {
    EnvVar v("FLATEP_LOG_LEVEL", "2");
    testing::internal::CaptureStderr();
    detail::log_line(1, "one");
    detail::log_line(2, "two");
    detail::log_line(3, "three");
    detail::log_line(0, "zero");
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "[flatep warning] one\n[flatep] two\n[flatep warning] zero\n");
}

}  // namespace
}  // namespace flatep
