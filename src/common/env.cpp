#include "common/env.hpp"

#include <cmath>
#include <cstdlib>

#include "common/check.hpp"

namespace flatep::env {

std::string get(const char* name, const std::string& fallback) {
    const char* value = std::getenv(name);
    return (value == nullptr || *value == '\0') ? fallback : std::string(value);
}

namespace {
bool valid_timeout(double seconds) { return std::isfinite(seconds) && seconds > 0 && seconds <= kMaxTimeoutSeconds; }
}  // namespace

double timeout_seconds() {
    const std::string text = get("FLATEP_TIMEOUT_S", "100");
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    FLATEP_CHECK(end != text.c_str() && *end == '\0' && valid_timeout(value),
                 "FLATEP_TIMEOUT_S must be a number of seconds in (0, ", kMaxTimeoutSeconds, "], got '", text, "'");
    return value;
}

double check_timeout(const std::string& what, const char* name, double seconds) {
    FLATEP_CHECK(valid_timeout(seconds), what, ": ", name, " must be a finite number of seconds in (0, ",
                 kMaxTimeoutSeconds, "], got ", seconds);
    return seconds;
}

double resolve_timeout(const std::string& what, double seconds) {
    return seconds == 0 ? timeout_seconds() : check_timeout(what, "timeout_s", seconds);
}

int num_sms() {
    const std::string text = get("FLATEP_NUM_SMS", "0");
    char* end = nullptr;
    const long value = std::strtol(text.c_str(), &end, 10);
    FLATEP_CHECK(end != text.c_str() && *end == '\0' && value >= 0 && value <= kMaxNumSms,
                 "FLATEP_NUM_SMS must be an integer in [0, ", kMaxNumSms, "], got '", text, "'");
    return int(value);
}

int check_num_sms(const char* what, long long num_sms) {
    FLATEP_CHECK(num_sms >= 0 && num_sms <= kMaxNumSms, what,
                 ": num_sms (the most thread blocks one launch uses, 0 = no cap) must be in [0, ", kMaxNumSms,
                 "], got ", num_sms);
    return int(num_sms);
}

bool debug() { return get("FLATEP_DEBUG", "0") != "0"; }

int log_level() {
    const std::string text = get("FLATEP_LOG_LEVEL", "1");
    return std::atoi(text.c_str());
}

std::string job_id() { return get("FLATEP_JOB_ID", ""); }
std::string rank_text() { return get("FLATEP_RANK", ""); }
std::string num_ranks_text() { return get("FLATEP_NUM_RANKS", ""); }

}  // namespace flatep::env
