// Byte-stream decoding shared by the libFuzzer targets: every read succeeds (zeros past the end), so any input
// decodes to some value and the fuzzer explores values rather than lengths. FUZZ_ASSERT aborts with a one-line
// description, which libFuzzer reports as a crash together with the input that caused it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define FUZZ_ASSERT(cond, ...)                                                                       \
    do {                                                                                             \
        if (!(cond)) {                                                                               \
            std::fprintf(stderr, "fuzz assertion failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                                                       \
            std::fprintf(stderr, "\n");                                                              \
            std::abort();                                                                            \
        }                                                                                            \
    } while (0)

namespace flatep::fuzz {

// True when `key` is listed in FLATEP_FUZZ_IGNORE (comma-separated): lets a run skip one known, reported violation
// to keep looking for others. Strict (nothing ignored) by default.
inline bool ignored(const char* key) {
    static const char* list = std::getenv("FLATEP_FUZZ_IGNORE");
    if (list == nullptr) return false;
    const size_t n = std::strlen(key);
    for (const char* p = list; (p = std::strstr(p, key)) != nullptr; p += n) {
        const bool starts = p == list || p[-1] == ',';
        const bool ends = p[n] == '\0' || p[n] == ',';
        if (starts && ends) return true;
    }
    return false;
}

class ByteReader {
  public:
    ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

    size_t remaining() const { return size_ - pos_; }

    uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
    uint16_t u16() { return uint16_t(u8() | (uint16_t(u8()) << 8)); }
    uint32_t u32() { return uint32_t(u16()) | (uint32_t(u16()) << 16); }
    uint64_t u64() { return uint64_t(u32()) | (uint64_t(u32()) << 32); }
    int32_t i32() { return int32_t(u32()); }
    double f64() {
        const uint64_t bits = u64();
        double d;
        std::memcpy(&d, &bits, sizeof(d));
        return d;
    }
    // Uniform-ish integer in [lo, hi] (hi - lo < 2^16).
    int range(int lo, int hi) { return lo + int(u16() % uint32_t(hi - lo + 1)); }

  private:
    const uint8_t* data_;
    size_t size_;
    size_t pos_ = 0;
};

}  // namespace flatep::fuzz
