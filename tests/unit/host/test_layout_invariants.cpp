// The layout invariants of src/layout/invariants.hpp over random shapes, called directly (the runtime checks them under
// FLATEP_DEBUG and in the sanitizer build): a Buffer's symmetric region and plan arrays, the serving view's chunks
// (runtime/serving_view.hpp's geometry at the stride serving_stride picks) and the training view, each holding every
// byte it places inside its allocation; and each check fails on a layout one byte or one granule short, naming it.
// Run: build/tests/flatep_host_tests --gtest_filter='LayoutInvariants.*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "layout/invariants.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "runtime/serving_view.hpp"

namespace flatep {
namespace {

// A random valid config and view: R in [1, 16], epn in [1, 12], every field in range, sometimes serving or slack.
struct RandomShape {
    Config config;
    ViewShape view;
};

RandomShape random_config(std::mt19937_64& rng) {
    Config c;
    ViewShape v;
    c.num_ranks = 1 + int(rng() % 16);
    const int epn = 1 + int(rng() % 12);
    c.num_experts = c.num_ranks * epn;
    c.num_tokens = 1 + int(rng() % 300);
    c.topk = 1 + int(rng() % std::min(8, c.num_experts));
    c.hidden = 8 * (1 + int(rng() % 40));
    const int aligns[] = {1, 2, 8, 16, 128, 4096};
    c.align = aligns[rng() % 6];
    c.capacity_factor = rng() % 3 == 0 ? 1.0 + double(rng() % 100) / 50.0 : 1.0;
    if (rng() % 3 == 0) {
        v.num_slots = int(rng() % epn);
        v.view_stride = epn + int(rng() % 3);
    }
    return {c, v};
}

TEST(LayoutInvariants, SymmetricRegionAndPlanArraysOfRandomConfigs) {
    std::mt19937_64 rng(62);
    for (int trial = 0; trial < 1500; ++trial) {
        const RandomShape shape = random_config(rng);
        const PlannerKind kind = trial % 4 == 0 ? PlannerKind::kOwner : PlannerKind::kBalanced;
        const Layout l = make_layout(shape.config, kind, shape.view);
        const SymmetricLayout s = make_symmetric_layout(l);
        ASSERT_EQ(symmetric_layout_violation(l, s.total_bytes), "") << "trial " << trial;
        const int64_t words = make_plan_sizes(l).total_words;
        ASSERT_EQ(plan_sizes_violation(l, words), "") << "trial " << trial;
        // One byte, one word short: named.
        EXPECT_NE(symmetric_layout_violation(l, s.total_bytes - 1).find("exceeds the region's"), std::string::npos);
        EXPECT_NE(plan_sizes_violation(l, words - 1).find("exceeds the allocation's"), std::string::npos);
    }
}

TEST(LayoutInvariants, ServingChunksOfRandomShapesHoldTheirExperts) {
    std::mt19937_64 rng(6204);
    for (int trial = 0; trial < 250; ++trial) {
        const int R = 1 + int(rng() % 8), epn = 1 + int(rng() % 12), B = int(rng() % (epn + 1));
        const size_t g = size_t(4096) << (rng() % 3 == 0 ? 9 : 0);  // a page, or CUDA's 2 MiB
        std::vector<int64_t> expert_bytes;
        for (int p = 0, n = 1 + int(rng() % 3); p < n; ++p)
            expert_bytes.push_back(16 * (1 + int64_t(rng() % (rng() % 2 ? 300 : 200000))));
        const int64_t Q = runtime::serving_stride(R, epn, B, expert_bytes, g);
        ASSERT_GE(Q, epn);
        for (int64_t eb : expert_bytes) {
            bool ok = false;
            const runtime::ServingGeometry geo = runtime::serving_geometry(R, epn, B, eb, g, Q, &ok);
            ASSERT_TRUE(ok);
            const std::string where = "R=" + std::to_string(R) + " epn=" + std::to_string(epn) +
                                      " B=" + std::to_string(B) + " eb=" + std::to_string(eb) +
                                      " Q=" + std::to_string(Q) + " G=" + std::to_string(g);
            ASSERT_EQ(serving_chunks_violation(R, epn, B, eb, g, Q, geo.offset.data(), geo.data_at.data(),
                                               geo.own_bytes, geo.slot_bytes, geo.view_bytes),
                      "")
                << where;
            // A granule less of every rank's memory (own_bytes is the least whole granules that hold the rank with
            // its data furthest into its first granule), or a byte less of the view: named.
            EXPECT_NE(serving_chunks_violation(R, epn, B, eb, g, Q, geo.offset.data(), geo.data_at.data(),
                                               geo.own_bytes - g, geo.slot_bytes, geo.view_bytes)
                          .find("past its allocation"),
                      std::string::npos)
                << where;
            EXPECT_NE(serving_chunks_violation(R, epn, B, eb, g, Q, geo.offset.data(), geo.data_at.data(),
                                               geo.own_bytes, geo.slot_bytes, (size_t(R) * Q + B) * eb - 1),
                      "")
                << where;
        }
    }
}

TEST(LayoutInvariants, PiecesOutOfLineAreNamed) {
    EXPECT_EQ(pieces_violation(64, 256, {{"a", 0, 64}, {"b", 64, 100}, {"c", 192, 64}}), "");
    EXPECT_EQ(pieces_violation(64, 256, {{"a", 0, 64}, {"b", 65, 10}}), "b at 65 is not 64-aligned");
    EXPECT_EQ(pieces_violation(64, 256, {{"a", 0, 100}, {"b", 64, 10}}),
              "b at 64 overlaps the piece before it, which ends at 100");
    EXPECT_EQ(pieces_violation(64, 256, {{"a", 0, 64}, {"b", 192, 65}}), "b [192, 257) ends past 256");
    EXPECT_EQ(pieces_violation(64, 256, {{"a", 0, -1}}), "a [0, -1) ends past 256");
}

TEST(LayoutInvariants, ServingChunksOutOfPlaceAreNamed) {
    // R = 2 ranks of epn = 2 experts of 1024 bytes, Q = 4, one slot, a 4096-byte granule: chunk r maps at r*4096.
    const size_t g = 4096, own = 4096, slot = 4096, view = 3 * 4096;
    const size_t offset[] = {0, 4096, 8192}, data_at[] = {0, 0, 0};
    auto violation = [&](const size_t* o, const size_t* d, size_t own_bytes, size_t view_bytes, size_t granule = 4096) {
        return serving_chunks_violation(2, 2, 1, 1024, granule, 4, o, d, own_bytes, slot, view_bytes);
    };
    EXPECT_EQ(violation(offset, data_at, own, view), "");
    const size_t unaligned[] = {0, 4000, 8192}, shifted[] = {0, 4096, 4096}, data_off[] = {0, 16, 0};
    EXPECT_NE(violation(unaligned, data_at, own, view).find("maps at 4000, not a granule"), std::string::npos);
    EXPECT_NE(violation(offset, data_off, own, view).find("is not view row 4"), std::string::npos);
    EXPECT_NE(violation(shifted, data_at, own, view).find("is not view row 8"), std::string::npos);
    EXPECT_NE(violation(offset, data_at, own, view - 4096).find("view of 8192 bytes"), std::string::npos);
    EXPECT_NE(violation(offset, data_at, own, view, 0).find("not whole granules"), std::string::npos);
    EXPECT_NE(violation(offset, data_at, own + 4096, view + 4096).find("overlaps chunk 0"), std::string::npos);
}

TEST(LayoutInvariants, TrainingViewHoldsItsRowsAndEachShortfallIsNamed) {
    const int epn = 3, B = 3;
    const int64_t row = 4096 + 16;  // one expert, not a whole page
    const size_t data = epn * row, own = (data + 4095) / 4096 * 4096, pool = B * row,
                 mapped = (pool + 4095) / 4096 * 4096;
    EXPECT_EQ(training_view_violation(epn, B, row, data, own, pool, mapped, own + mapped), "");
    EXPECT_NE(training_view_violation(epn, B, row, data, data - 16, pool, mapped, data - 16 + mapped), "");
    EXPECT_NE(training_view_violation(epn, B, row, data, own, pool - 16, mapped, own + mapped), "");
    EXPECT_NE(training_view_violation(epn, B, row, data, own, pool, mapped, own + mapped - 4096), "");
    EXPECT_NE(training_view_violation(epn, B, row, data - row, own, pool, mapped, own + mapped), "");
}

TEST(LayoutInvariants, SlotTables) {
    Layout l{};
    l.num_ranks = 2;
    l.num_experts = 8;
    l.experts_per_rank = 4;
    l.num_slots = 3;
    const std::vector<int32_t> good = {4, 6, -1, -1, 0, 1, 3, -1};
    EXPECT_EQ(slot_table_violation(l, good.data()), "");
    EXPECT_EQ(slot_table_violation(l, nullptr), "");
    const std::vector<std::pair<std::vector<int32_t>, std::string>> bad = {
        {{4, 6, -1, -1, 0, 1, 3, 2}, "past the rank's B slots"},
        {{4, 6, -1, -1, 0, 1, 5, -1}, "a replica of the rank's own expert"},
        {{4, -1, 6, -1, 0, 1, 3, -1}, "a used slot after an unused one"},
        {{6, 4, -1, -1, 0, 1, 3, -1}, "not above the slot before it"},
        {{4, 8, -1, -1, 0, 1, 3, -1}, "not -1 or an expert id"},
        {{4, -2, -1, -1, 0, 1, 3, -1}, "not -1 or an expert id"},
    };
    for (const auto& [table, why] : bad)
        EXPECT_NE(slot_table_violation(l, table.data()).find(why), std::string::npos) << why;
    // A static placement keeps the user's order and gaps; every other rule still holds, and an expert is placed at
    // most once a rank.
    l.placed = true;
    EXPECT_EQ(slot_table_violation(l, good.data()), "");
    EXPECT_EQ(slot_table_violation(l, std::vector<int32_t>{6, 4, -1, -1, -1, 1, 0, -1}.data()), "");
    const std::vector<std::pair<std::vector<int32_t>, std::string>> bad_placed = {
        {{6, 6, -1, -1, 0, 1, 3, -1}, "an expert repeated on the rank"},
        {{4, 6, -1, -1, 0, 1, 3, 2}, "past the rank's B slots"},
        {{4, 6, -1, -1, -1, 5, 3, -1}, "a replica of the rank's own expert"},
        {{4, 9, -1, -1, 0, 1, 3, -1}, "not -1 or an expert id"},
    };
    for (const auto& [table, why] : bad_placed)
        EXPECT_NE(slot_table_violation(l, table.data()).find(why), std::string::npos) << why;
}

}  // namespace
}  // namespace flatep
