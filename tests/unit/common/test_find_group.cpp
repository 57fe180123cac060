// find_group (layout/plan.hpp): the group of a receive row, by binary search over a rank's inclusive group ends, as
// the CUDA kernels use it (kernels/common/groups.cuh) -- tested here against a plain scan, in the CPU build, over
// random group ends with empty groups and rows at every group's end and past the last. Found by issue 62's fresh
// mutants (M57: ">=" for ">" survived the suite, whose host code does not call it).
// Run: build/tests/flatep_common_tests --gtest_filter='FindGroup.*'
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "layout/plan.hpp"

namespace flatep {
namespace {

int scan(const std::vector<int32_t>& cu, int64_t r) {
    for (int g = 0; g < int(cu.size()); ++g)
        if (cu[g] > r) return g;
    return int(cu.size());
}

TEST(FindGroup, FirstEndAboveTheRowOverRandomGroups) {
    std::mt19937_64 rng(62);
    for (int trial = 0; trial < 3000; ++trial) {
        const int G = 1 + int(rng() % 64);
        std::vector<int32_t> cu(G);
        int32_t end = 0;
        for (int g = 0; g < G; ++g) cu[g] = end += rng() % 3 == 0 ? 0 : int32_t(1 + rng() % 9);  // empty groups too
        for (int64_t r = 0; r <= int64_t(end) + 2; ++r)
            ASSERT_EQ(find_group(cu.data(), G, r), scan(cu, r)) << "trial " << trial << ", row " << r;
    }
    // Row 4 is the first row of group 1 (ends 4, 9): not group 0, whose end it is.
    const int32_t cu[] = {4, 9, 9, 12};
    EXPECT_EQ(find_group(cu, 4, 3), 0);
    EXPECT_EQ(find_group(cu, 4, 4), 1);
    EXPECT_EQ(find_group(cu, 4, 9), 3);   // group 2 is empty
    EXPECT_EQ(find_group(cu, 4, 12), 4);  // past the last end
}

}  // namespace
}  // namespace flatep
