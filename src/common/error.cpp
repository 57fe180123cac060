#include <cerrno>
#include <cstring>

#include "common/check.hpp"

namespace flatep {

const char* category_name(ErrorCategory category) {
    switch (category) {
        case ErrorCategory::kInvalidArgument:
            return "invalid argument";
        case ErrorCategory::kRuntime:
            return "runtime error";
        case ErrorCategory::kTimeout:
            return "timeout";
        case ErrorCategory::kMismatch:
            return "mismatch";
    }
    return "error";
}

namespace {
std::string format_what(ErrorCategory category, const char* file, int line, const std::string& message) {
    const char* base = std::strrchr(file, '/');
    return detail::concat("flatep ", category_name(category), ": ", message, " [", base ? base + 1 : file, ":", line,
                          "]");
}
}  // namespace

Error::Error(ErrorCategory category, const char* file, int line, const std::string& message)
    : std::runtime_error(format_what(category, file, line, message)),
      category_(category),
      file_(file),
      line_(line),
      message_(message) {}

namespace detail {

void throw_error(ErrorCategory category, const char* file, int line, const std::string& message) {
    throw Error(category, file, line, message);
}

std::string errno_text() {
    const int err = errno;
    return concat(std::strerror(err), " (errno ", err, ")");
}

}  // namespace detail
}  // namespace flatep
