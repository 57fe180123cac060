// Minimal leveled logging to stderr (FLATEP_LOG_LEVEL). Used by teardown paths that must not throw.
#pragma once

#include "common/check.hpp"

namespace flatep::detail {
void log_line(int level, const std::string& text);
}  // namespace flatep::detail

#define FLATEP_LOG_WARN(...) ::flatep::detail::log_line(1, ::flatep::detail::concat(__VA_ARGS__))
#define FLATEP_LOG_INFO(...) ::flatep::detail::log_line(2, ::flatep::detail::concat(__VA_ARGS__))
