// Test helpers for the CPU backend: run R rank threads over a LocalHostWorld, random bf16 data.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "routing/routing.hpp"

namespace flatep::testing {

// The Config of a test: R ranks, E experts, S tokens a rank, top-K, H, align, the capacity factor, and this rank (the
// one helper of the host and GPU tests; the other fields at their defaults).
inline Config make_config(int R, int E, int S, int K, int H, int align, double capacity_factor = 1.0, int rank = 0) {
    return Config{.num_ranks = R,
                  .rank = rank,
                  .num_experts = E,
                  .num_tokens = S,
                  .topk = K,
                  .hidden = H,
                  .align = align,
                  .capacity_factor = capacity_factor};
}

// Runs fn(rank) on R threads; returns each rank's exception text ("" when it returned normally).
inline std::vector<std::string> run_ranks(int num_ranks, const std::function<void(int)>& fn) {
    std::vector<std::string> errors(num_ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < num_ranks; ++r) {
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (const std::exception& e) {
                errors[r] = e.what();
                if (errors[r].empty()) errors[r] = "(empty what())";
            }
        });
    }
    for (std::thread& t : threads) t.join();
    return errors;
}

// Joined "rank r: error" lines of the ranks that failed; "" when none did.
inline std::string failures(const std::vector<std::string>& errors) {
    std::string out;
    for (size_t r = 0; r < errors.size(); ++r) {
        if (!errors[r].empty()) out += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
    }
    return out;
}

// The message of the flatep::Error fn() throws, or "(no error)".
template <class F>
std::string error_message(F&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.message();
    }
    return "(no error)";
}

// What a call threw: the flatep::Error's message and category ("(no error)" and -1 when it returned).
struct Outcome {
    std::string message = "(no error)";
    int category = -1;
};

template <class F>
Outcome outcome_of(F&& fn) {
    Outcome o;
    try {
        fn();
    } catch (const Error& e) {
        o.message = e.message();
        o.category = int(e.category());
    }
    return o;
}

// Sets an environment variable (unsets it for a null value) for its lifetime, then restores the old value or unsets
// it.
class ScopedEnv {
  public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        const char* old = std::getenv(name);
        had_ = old != nullptr;
        if (had_) old_ = old;
        if (value != nullptr) {
            ::setenv(name, value, 1);
        } else {
            ::unsetenv(name);
        }
    }
    ~ScopedEnv() {
        if (had_) {
            ::setenv(name_, old_.c_str(), 1);
        } else {
            ::unsetenv(name_);
        }
    }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

  private:
    const char* name_;
    bool had_ = false;
    std::string old_;
};

// The bits of an fp32 value, and back.
inline uint32_t bits_of(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}
inline float float_of(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

// Deterministic uniform float in [lo, hi) from (stream, index).
inline float uniform_float(uint64_t stream, uint64_t index, float lo, float hi) {
    return lo + float(routing::uniform(stream, index)) * (hi - lo);
}

// n random finite bf16 values in [-4, 4).
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t stream) {
    std::vector<uint16_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = float_to_bf16(uniform_float(stream, i, -4.0f, 4.0f));
    return v;
}

// n random finite bf16 values of either sign with magnitudes spread over 2^-12 .. 2^12, so that fp32 sums of a few
// of them round and the order of the additions shows in the result.
inline std::vector<uint16_t> random_bf16_wide(size_t n, uint64_t stream) {
    std::vector<uint16_t> v(n);
    for (size_t i = 0; i < n; ++i) {
        const float mantissa = uniform_float(stream, 2 * i, 1.0f, 2.0f);
        const double u = routing::uniform(stream, 2 * i + 1);
        const int exponent = int(u * 25.0) - 12;
        const float sign = (uint64_t(u * 1e6) & 1) ? -1.0f : 1.0f;
        v[i] = float_to_bf16(sign * std::ldexp(mantissa, exponent));
    }
    return v;
}

inline std::vector<float> random_floats(size_t n, uint64_t stream, float lo, float hi) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = uniform_float(stream, i, lo, hi);
    return v;
}

}  // namespace flatep::testing
