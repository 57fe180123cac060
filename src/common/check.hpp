// Check macros. FLATEP_CHECK(cond, parts...) throws flatep::Error(kInvalidArgument) with the parts
// streamed together; the other macros pick a category or wrap an API's return code.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "flatep/error.hpp"

namespace flatep::detail {

template <typename... Parts>
std::string concat(Parts&&... parts) {
    std::ostringstream os;
    (os << ... << std::forward<Parts>(parts));
    return os.str();
}

[[noreturn]] void throw_error(ErrorCategory category, const char* file, int line, const std::string& message);

}  // namespace flatep::detail

#define FLATEP_THROW(category, ...) \
    ::flatep::detail::throw_error((category), __FILE__, __LINE__, ::flatep::detail::concat(__VA_ARGS__))

#define FLATEP_CHECK(cond, ...)                                                            \
    do {                                                                                   \
        if (!(cond)) FLATEP_THROW(::flatep::ErrorCategory::kInvalidArgument, __VA_ARGS__); \
    } while (0)

#define FLATEP_CHECK_RUNTIME(cond, ...)                                            \
    do {                                                                           \
        if (!(cond)) FLATEP_THROW(::flatep::ErrorCategory::kRuntime, __VA_ARGS__); \
    } while (0)

// errno-style system calls: FLATEP_SYS_CHECK(close(fd) == 0, "close") appends strerror(errno).
#define FLATEP_SYS_CHECK(cond, what)                                                                            \
    do {                                                                                                        \
        if (!(cond))                                                                                            \
            FLATEP_THROW(::flatep::ErrorCategory::kRuntime, what, " failed: ", ::flatep::detail::errno_text()); \
    } while (0)

namespace flatep::detail {
std::string errno_text();
}  // namespace flatep::detail
