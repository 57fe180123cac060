// Host, plain C++ (no device code, so a test without a GPU includes it): how a launcher sizes its grid from the work
// and the op's SM budget. launch.cu applies these rules with the current device's multiprocessor count
// (grid_blocks, token_blocks in launch.cuh); tests/unit/kernels holds them to their contract in the CPU build.
#pragma once

#include <cstdint>

#include "common/math.hpp"

namespace flatep::kernels {

// Blocks for a launch of `work_blocks` blocks of work under the SM budget `num_sms` (the most thread blocks one
// launch uses; 0: blocks_per_sm blocks on each of the device's sm_count multiprocessors): min(work, cap), at least 1.
inline int grid_blocks_for(int num_sms, int64_t work_blocks, int blocks_per_sm, int sm_count) {
    const int64_t cap = num_sms > 0 ? num_sms : int64_t(sm_count) * blocks_per_sm;
    const int64_t n = work_blocks < cap ? work_blocks : cap;
    return n < 1 ? 1 : int(n);
}

// Blocks for a kernel that gives each of a call's tokens a warp: warps for the layout's S tokens, and at least one
// block a multiprocessor (so that a layout sized for decode spreads each row over several warps), four blocks an SM
// at most, under the budget num_sms.
inline int token_blocks_for(int num_sms, int layout_tokens, int warps_per_block, int sm_count) {
    return grid_blocks_for(num_sms, max_of<int64_t>(ceil_div<int64_t>(layout_tokens, warps_per_block), sm_count), 4,
                           sm_count);
}

}  // namespace flatep::kernels
