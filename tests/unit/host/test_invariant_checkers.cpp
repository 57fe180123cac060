// The layout invariant checkers (layout/invariants.hpp) fed the broken geometries they exist to catch, each named
// exactly: a serving chunk's own or slot memory not whole granules, a training pool allocation larger than its
// mapping, and check_invariant throwing kRuntime with the place and the violation (silent for none).
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "flatep/error.hpp"
#include "layout/invariants.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::Outcome;
using testing::outcome_of;

TEST(InvariantCheckers, ServingChunksOfPartGranulesAreNamed) {
    // R = 2 ranks of epn = 2 experts of 1024 bytes, Q = 4, one slot, 4096-byte granules: chunk r at r*4096.
    const size_t offset[] = {0, 4096, 8192}, data_at[] = {0, 0, 0};
    auto violation = [&](size_t own, size_t slot) {
        return serving_chunks_violation(2, 2, 1, 1024, 4096, 4, offset, data_at, own, slot, 3 * 4096);
    };
    EXPECT_EQ(violation(4096, 4096), "");
    EXPECT_EQ(violation(4000, 4096), "own_bytes 4000 or slot_bytes 4096 is not whole granules of 4096");
    EXPECT_EQ(violation(4096, 2048), "own_bytes 4096 or slot_bytes 2048 is not whole granules of 4096");
}

TEST(InvariantCheckers, ATrainingPoolLargerThanItsMappingIsNamed) {
    const int epn = 2, B = 2;
    const int64_t row = 4096;
    const size_t data = epn * row, own = data, pool = B * row, mapped = pool;
    EXPECT_EQ(training_view_violation(epn, B, row, data, own, pool, mapped, own + mapped), "");
    EXPECT_EQ(training_view_violation(epn, B, row, data, own, pool + 4096, mapped, own + mapped),
              "the pool's 2 rows of 4096 bytes do not fit its allocation of 12288 (mapped 8192)");
}

TEST(InvariantCheckers, CheckInvariantThrowsTheViolationWithItsPlace) {
    EXPECT_EQ(outcome_of([] { check_invariant("Buffer", ""); }).message, "(no error)");
    const Outcome o = outcome_of([] { check_invariant("Buffer", "total_bytes 9 exceeds the region's 8"); });
    EXPECT_EQ(o.message, "layout invariant broken (Buffer): total_bytes 9 exceeds the region's 8");
    EXPECT_EQ(o.category, int(ErrorCategory::kRuntime));
}

}  // namespace
}  // namespace flatep
