// Check macros. FLATEP_CHECK(cond, parts...) throws flatep::Error(kInvalidArgument) with the parts
// streamed together; the other macros pick a category or wrap an API's return code.
#pragma once

#include <charconv>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "flatep/error.hpp"

namespace flatep::detail {

// One part of a message. Floating-point values are written in their shortest round-trip form (std::to_chars), so a
// message shows the value the user passed (4.0000001, not the 6 significant digits of a stream's default).
template <typename Part>
void append_part(std::ostringstream& os, Part&& part) {
    if constexpr (std::is_floating_point_v<std::remove_cvref_t<Part>>) {
        char text[64];
        const std::to_chars_result written = std::to_chars(text, text + sizeof(text), part);
        os.write(text, written.ptr - text);
    } else {
        os << std::forward<Part>(part);
    }
}

template <typename... Parts>
std::string concat(Parts&&... parts) {
    std::ostringstream os;
    (append_part(os, std::forward<Parts>(parts)), ...);
    return os.str();
}

// Seconds as the user gave them (shortest round-trip form) with ".0" on whole numbers, for the timeout messages
// ("waited 0.5 s", "waited 1.0 s", "waited 0.05 s").
inline std::string seconds_text(double seconds) {
    std::string text = concat(seconds);
    if (text.find_first_of(".eni") == std::string::npos) text += ".0";  // not 1e+30, nan, inf
    return text;
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
