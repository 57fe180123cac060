// The pieces every op's check_<op>_args (next to its Args) is made of. Each op's contract is checked once per call,
// by the runtime, before either backend runs: kernels' launchers and host twins trust checked Args.
#pragma once

#include <cstdint>

#include "common/check.hpp"

namespace flatep {

// True when `ptr` is a multiple of `bytes` (null is aligned: a pointer nothing reads).
inline bool is_aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// kInvalidArgument "<op>: rank must be in [0, R), got r".
inline void check_op_rank(const char* op, int rank, int num_ranks) {
    FLATEP_CHECK(rank >= 0 && rank < num_ranks, op, ": rank must be in [0, ", num_ranks, "), got ", rank);
}

// kInvalidArgument "<op>: <name> must be 16-byte aligned, got 0x..." (rows move as 16-byte vectors on the GPU; both
// backends refuse the same pointers).
inline void check_aligned16(const char* op, const char* name, const void* ptr) {
    FLATEP_CHECK(is_aligned(ptr, 16), op, ": ", name, " must be 16-byte aligned, got address ",
                 reinterpret_cast<uintptr_t>(ptr));
}

// kInvalidArgument "<op>: <name> is null" unless the step moves no row of it (`rows` == 0: e.g. a rank that passed
// no tokens may pass null token rows and outputs).
inline void check_given(const char* op, const char* name, const void* ptr, int64_t rows = 1) {
    FLATEP_CHECK(rows == 0 || ptr != nullptr, op, ": ", name, " is null");
}

}  // namespace flatep
