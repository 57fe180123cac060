// flatep::activate_rows and flatep::zero_rows_from_end (include/flatep/ffn.hpp): the argument checks, then the kernels
// of kernels/ffn_rows on the call's stream. Compiled in every build; without CUDA both throw after their checks.
#include "flatep/ffn.hpp"

#include "common/check.hpp"
#include "common/env.hpp"
#include "runtime/launch.hpp"

#if defined(FLATEP_WITH_CUDA)
#include <cuda_runtime.h>

#include "kernels/ffn_rows/ffn_rows.cuh"
#endif

namespace flatep {

namespace {

// The call's SM budget: -1 is FLATEP_NUM_SMS (there is no object whose num_sms() it could mean). No option is taken.
int resolve_num_sms(const char* op, const Launch& launch) {
    runtime::check_options(op, launch.options, runtime::Takes::kNoOption);
    return launch.num_sms == -1 ? env::num_sms() : env::check_num_sms(op, launch.num_sms);
}

void check_rows(const char* op, int64_t rows, const char* cols_name, int64_t cols, const int32_t* end) {
    FLATEP_CHECK(rows >= 0, op, ": rows must be >= 0, got ", rows);
    FLATEP_CHECK(cols >= 1, op, ": ", cols_name, " must be >= 1, got ", cols);
    FLATEP_CHECK(end != nullptr, op, ": end is null; pass the device address of the last group end (int32)");
}

#if !defined(FLATEP_WITH_CUDA)
[[noreturn]] void no_cuda(const char* op) {
    FLATEP_THROW(ErrorCategory::kRuntime, op,
                 ": this FlatEP build has no CUDA support (nvcc was not found at build time)");
}
#endif

}  // namespace

void activate_rows(const uint16_t* h, uint16_t* a, int64_t rows, int64_t ffn, FfnActivation activation,
                   const int32_t* end, PastEnd past_end, const Launch& launch) {
    const char* op = "activate_rows";
    check_rows(op, rows, "ffn", ffn, end);
    FLATEP_CHECK(activation == FfnActivation::kSwiglu || activation == FfnActivation::kSilu, op,
                 ": activation must be FfnActivation::kSwiglu (0) or kSilu (1), got ", int(activation));
    FLATEP_CHECK(past_end == PastEnd::kZero || past_end == PastEnd::kUntouched, op,
                 ": past_end must be PastEnd::kZero (0) or kUntouched (1), got ", int(past_end));
    FLATEP_CHECK(rows == 0 || (h != nullptr && a != nullptr), op, ": h and a must be set when rows > 0");
    const int num_sms = resolve_num_sms(op, launch);
#if defined(FLATEP_WITH_CUDA)
    kernels::launch_activate_rows(h, a, rows, ffn, activation, end, past_end == PastEnd::kZero,
                                  static_cast<cudaStream_t>(launch.stream), num_sms);
#else
    (void)num_sms;
    no_cuda(op);
#endif
}

void zero_rows_from_end(uint16_t* y, int64_t rows, int64_t cols, const int32_t* end, const Launch& launch) {
    const char* op = "zero_rows_from_end";
    check_rows(op, rows, "cols", cols, end);
    FLATEP_CHECK(rows == 0 || y != nullptr, op, ": y must be set when rows > 0");
    const int num_sms = resolve_num_sms(op, launch);
#if defined(FLATEP_WITH_CUDA)
    kernels::launch_zero_rows_from_end(y, rows, cols, end, static_cast<cudaStream_t>(launch.stream), num_sms);
#else
    (void)num_sms;
    no_cuda(op);
#endif
}

}  // namespace flatep
