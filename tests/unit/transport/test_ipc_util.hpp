// Helpers for the multi-process tests: children cannot use gtest assertions (they _exit), so they check with
// CHILD_CHECK, print what failed to stderr and return a non-zero exit code that the parent asserts on.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "common/check.hpp"
#include "flatep/error.hpp"
#include "flatep/types.hpp"

#define CHILD_CHECK(cond, ...)                                                                                     \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            std::fprintf(stderr, "[pid %d] %s:%d: check failed: %s: %s\n", static_cast<int>(::getpid()), __FILE__, \
                         __LINE__, #cond, ::flatep::detail::concat(__VA_ARGS__).c_str());                          \
            return 1;                                                                                              \
        }                                                                                                          \
    } while (0)

namespace flatep::test {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline int count_open_fds() {
    int count = 0;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return -1;
    while (dirent* entry = ::readdir(dir))
        if (entry->d_name[0] != '.') ++count;
    ::closedir(dir);
    return count - 1;  // the directory stream's own descriptor
}

// Lines of /proc/self/maps containing `needle` (all lines when empty).
inline int count_mappings(const std::string& needle) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    int count = 0;
    while (std::getline(maps, line))
        if (needle.empty() || line.find(needle) != std::string::npos) ++count;
    return count;
}

// How the victim rank fails before a collective.
enum class Failure { kExit, kSigkill, kStall };

inline int victim(Failure failure) {
    if (failure == Failure::kExit) ::_exit(3);
    if (failure == Failure::kSigkill) ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    return 3;
}

// Survivors must fail with kTimeout naming the victim within the timeout (plus scheduling slack).
inline int expect_timeout_naming(int victim_rank, double timeout_s, const std::function<void()>& collective,
                                 int num_ranks = kMaxRanks) {
    const auto start = std::chrono::steady_clock::now();
    try {
        collective();
    } catch (const Error& e) {
        const double elapsed = seconds_since(start);
        if (std::getenv("FLATEP_TEST_VERBOSE") != nullptr) std::fprintf(stderr, "[pid %d] %s\n", ::getpid(), e.what());
        CHILD_CHECK(e.category() == ErrorCategory::kTimeout, "category ", category_name(e.category()), ": ", e.what());
        const std::string needle = detail::concat("rank ", victim_rank, " (pid");
        CHILD_CHECK(e.message().find(needle) != std::string::npos, "message does not name rank ", victim_rank, ": ",
                    e.what());
        // Only the victim is blamed: survivors that gave up first must not be named by the others.
        for (int r = 0; r < num_ranks; ++r)
            CHILD_CHECK(r == victim_rank || e.message().find(detail::concat("rank ", r, " (pid")) == std::string::npos,
                        "message names rank ", r, ": ", e.what());
        CHILD_CHECK(elapsed < timeout_s + 1.0, "took ", elapsed, " s, timeout ", timeout_s, " s");
        return 0;
    }
    CHILD_CHECK(false, "the collective succeeded without rank ", victim_rank);
    return 1;
}

}  // namespace flatep::test
