// Grid sizing of the launchers (kernels/common/grid.hpp, applied by launch.cu with the device's multiprocessor count),
// in the CPU build: a launch never exceeds its SM budget (or blocks_per_sm blocks an SM without one), never exceeds its
// work, has at least one block, and a token kernel has a warp for each of the layout's tokens whenever the budget
// allows it and at least one block a multiprocessor.
// Run: build/tests/flatep_kernels_tests --gtest_filter='GridBlocks.*:TokenBlocks.*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>

#include "kernels/common/grid.hpp"

namespace flatep::kernels {
namespace {

TEST(GridBlocks, MinOfWorkAndBudgetAtLeastOne) {
    std::mt19937_64 rng(62);
    for (int trial = 0; trial < 200000; ++trial) {
        const int num_sms = trial % 3 == 0 ? 0 : int(rng() % 300);
        const int64_t work = trial % 5 == 0 ? int64_t(rng() % 3) : int64_t(rng() % 100000);
        const int per_sm = 1 + int(rng() % 8);
        const int sms = 1 + int(rng() % 200);
        const int blocks = grid_blocks_for(num_sms, work, per_sm, sms);
        const int64_t cap = num_sms > 0 ? num_sms : int64_t(sms) * per_sm;
        ASSERT_EQ(blocks, std::max<int64_t>(1, std::min(work, cap)))
            << "num_sms " << num_sms << " work " << work << " per_sm " << per_sm << " sms " << sms;
    }
    // The budget is a cap, not a target; 0 means blocks_per_sm on every multiprocessor.
    EXPECT_EQ(grid_blocks_for(0, int64_t(1) << 40, 4, 132), 528);
    EXPECT_EQ(grid_blocks_for(16, int64_t(1) << 40, 4, 132), 16);
    EXPECT_EQ(grid_blocks_for(16, 3, 4, 132), 3);
    EXPECT_EQ(grid_blocks_for(0, 0, 4, 132), 1);
}

TEST(TokenBlocks, AWarpPerTokenAndABlockPerSmUnderTheBudget) {
    std::mt19937_64 rng(6202);
    for (int trial = 0; trial < 200000; ++trial) {
        const int num_sms = trial % 2 == 0 ? 0 : int(1 + rng() % 300);
        const int tokens = 1 + int(rng() % (trial % 3 == 0 ? 256 : 65536));
        const int warps = 1 << int(rng() % 6);
        const int sms = 1 + int(rng() % 200);
        const int blocks = token_blocks_for(num_sms, tokens, warps, sms);
        const int64_t cap = num_sms > 0 ? num_sms : int64_t(sms) * 4;
        ASSERT_GE(blocks, 1);
        ASSERT_LE(blocks, cap);
        // A warp for every token, unless the budget is smaller.
        const int64_t needed = (int64_t(tokens) + warps - 1) / warps;
        ASSERT_GE(blocks, std::min(needed, cap)) << tokens << " tokens, " << warps << " warps a block";
        // At least one block a multiprocessor, unless the budget is smaller.
        ASSERT_GE(blocks, std::min<int64_t>(sms, cap)) << tokens << " tokens on " << sms << " SMs";
        // Never more than the larger of the two needs.
        ASSERT_LE(blocks, std::max<int64_t>(needed, sms));
    }
    // Decode on an H100 (132 SMs): 128 tokens of 16 warps a block would be 8 blocks; the floor gives 132.
    EXPECT_EQ(token_blocks_for(0, 128, 16, 132), 132);
    EXPECT_EQ(token_blocks_for(0, 8192, 16, 132), 512);
    EXPECT_EQ(token_blocks_for(0, 65536, 16, 132), 528);
    EXPECT_EQ(token_blocks_for(24, 65536, 16, 132), 24);
}

}  // namespace
}  // namespace flatep::kernels
