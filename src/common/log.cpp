#include "common/log.hpp"

#include <cstdio>
#include <mutex>

#include "common/env.hpp"

namespace flatep::detail {

void log_line(int level, const std::string& text) {
    static const int threshold = env::log_level();
    if (level > threshold) return;
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    std::fprintf(stderr, "[flatep%s] %s\n", level <= 1 ? " warning" : "", text.c_str());
}

}  // namespace flatep::detail
