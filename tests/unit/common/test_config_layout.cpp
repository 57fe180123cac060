#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep {
namespace {

Config small() {
    Config c;
    c.num_ranks = 4;
    c.num_experts = 16;
    c.num_tokens = 32;
    c.topk = 2;
    c.hidden = 64;
    c.align = 8;
    return c;
}

std::string error_of(const Config& c, PlannerKind planner = PlannerKind::kBalanced) {
    try {
        c.validate(planner);
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument);
        return e.message();
    }
    return "";
}

// The error of make_layout with the view shape `v` (B and Q, which a Buffer takes from its ExpertPools), or "".
std::string view_error(const Config& c, const ViewShape& v) {
    try {
        make_layout(c, PlannerKind::kBalanced, v);
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument);
        return e.message();
    }
    return "";
}

TEST(Config, ValidConfigPasses) { EXPECT_EQ(error_of(small()), ""); }

TEST(Config, EachBadFieldIsNamedWithItsValue) {
    struct Case {
        void (*mutate)(Config&);
        const char* expect;
    };
    const Case cases[] = {
        {[](Config& c) { c.num_ranks = 0; }, "num_ranks (R) must be in [1, 64], got 0"},
        {[](Config& c) { c.num_ranks = 65; }, "num_ranks (R) must be in [1, 64], got 65"},
        {[](Config& c) { c.rank = 4; }, "rank must be in [0, num_ranks=4), got 4"},
        {[](Config& c) { c.rank = -1; }, "rank must be in [0, num_ranks=4), got -1"},
        {[](Config& c) { c.num_experts = 18; }, "num_experts (E) must be a multiple of num_ranks (R): E=18 R=4"},
        {[](Config& c) { c.num_experts = 0; }, "num_experts (E) must be positive, got 0"},
        {[](Config& c) { c.num_tokens = 0; }, "num_tokens (S) must be positive, got 0"},
        {[](Config& c) { c.topk = 0; }, "topk (K) must be in [1, 32], got 0"},
        {[](Config& c) { c.topk = 33; }, "topk (K) must be in [1, 32], got 33"},
        {[](Config& c) { c.topk = 17; }, "topk (K) must not exceed num_experts (E): K=17 E=16"},
        {[](Config& c) { c.hidden = 12; }, "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got 12"},
        {[](Config& c) { c.align = 0; }, "align must be in [1, 4096], got 0"},
        {[](Config& c) { c.capacity_factor = 0.9; }, "capacity_factor must be in [1, 4], got 0.9"},
        // The value as given (shortest round-trip form), not "4" (a stream's 6 significant digits).
        {[](Config& c) { c.capacity_factor = 4.0000001; }, "capacity_factor must be in [1, 4], got 4.0000001"},
        {[](Config& c) { c.capacity_factor = 0.99999999999; }, "capacity_factor must be in [1, 4], got 0.99999999999"},
        {[](Config& c) { c.num_tokens = 1 << 27, c.topk = 16; },
         "num_tokens*topk (S*K) must fit int32, got 2147483648"},
    };
    for (const Case& cs : cases) {
        Config c = small();
        cs.mutate(c);
        EXPECT_EQ(error_of(c), cs.expect);
    }
}

TEST(Config, EveryLimitItselfIsValid) {
    // The largest (or smallest) allowed value of each field passes; EachBadFieldIsNamedWithItsValue has the next one.
    const std::pair<const char*, void (*)(Config&)> cases[] = {
        {"R = 64", [](Config& c) { c.num_ranks = 64, c.num_experts = 64, c.rank = 63; }},
        {"R = 1", [](Config& c) { c.num_ranks = 1, c.rank = 0; }},
        {"K = 32", [](Config& c) { c.num_experts = 32, c.topk = 32; }},
        {"K = E", [](Config& c) { c.topk = 16; }},
        {"K = 1", [](Config& c) { c.topk = 1; }},
        {"H = 8", [](Config& c) { c.hidden = 8; }},
        {"align = 4096", [](Config& c) { c.align = 4096; }},
        {"align = 1", [](Config& c) { c.align = 1; }},
        {"capacity_factor = 4", [](Config& c) { c.capacity_factor = 4.0; }},
        {"S*K = 2^31 - 1",
         [](Config& c) {
             c.num_ranks = 1, c.num_experts = 1, c.num_tokens = INT32_MAX, c.topk = 1, c.hidden = 8, c.align = 1;
         }},
    };
    for (const auto& [what, mutate] : cases) {
        Config c = small();
        mutate(c);
        EXPECT_EQ(error_of(c), "") << what;
    }
    Config c = small();
    c.num_ranks = 1, c.num_experts = 1, c.num_tokens = INT32_MAX, c.topk = 1, c.align = 1;
    EXPECT_EQ(make_layout(c).capacity, INT32_MAX);
    EXPECT_EQ(make_layout(c).num_recv_rows, INT32_MAX);
}

TEST(Layout, CapacityRoundsUpInSlackMode) {
    // C = ceil(f*S*K): 1.1 * 32 * 3 = 105.6 -> 106; 1.25 * 32 * 2 = 80 exactly stays 80; 4 * 32 * 2 = 256.
    Config c = small();
    c.topk = 3, c.capacity_factor = 1.1;
    EXPECT_EQ(make_layout(c).capacity, 106);
    c.topk = 2, c.capacity_factor = 1.25;
    EXPECT_EQ(make_layout(c).capacity, 80);
    c.capacity_factor = 4.0;
    EXPECT_EQ(make_layout(c).capacity, 256);
    EXPECT_FALSE(make_layout(c).exact);
}

TEST(Config, HashIgnoresRankAndMismatchNamesField) {
    Config a = small(), b = small();
    b.rank = 3;
    EXPECT_EQ(a.hash(), b.hash());
    EXPECT_EQ(a.mismatch(b), "");
    b.topk = 3;
    EXPECT_NE(a.hash(), b.hash());
    EXPECT_EQ(a.mismatch(b), "topk: 2 vs 3");
    Config c = small(), d = small();
    c.capacity_factor = 1.25;
    d.capacity_factor = 1.2500001;
    EXPECT_EQ(c.mismatch(d), "capacity_factor: 1.25 vs 1.2500001");
}

TEST(Layout, DerivedSizes) {
    const Layout l = make_layout(small());
    EXPECT_EQ(l.experts_per_rank, 4);
    EXPECT_EQ(l.capacity, 64);
    // NvS = round_up(C + 2*epn*(align-1), align) = round_up(64 + 8*7, 8) = 120
    EXPECT_EQ(l.num_recv_rows, 120);
    EXPECT_TRUE(l.exact);
    EXPECT_EQ(l.home_rank(13), 3);
    EXPECT_EQ(l.local_expert(13), 1);
    EXPECT_EQ(home_rank(13, 4), 3);
    EXPECT_EQ(local_expert(13, 4), 1);
    // Group padding: align 8; an empty group stays empty.
    EXPECT_EQ(l.padded(0), 0);
    EXPECT_EQ(l.padded(1), 8);
    EXPECT_EQ(l.padded(8), 8);
    EXPECT_EQ(l.padded(9), 16);

    Config c = small();
    c.capacity_factor = 1.25;
    c.align = 128;
    const Layout s = make_layout(c);
    EXPECT_EQ(s.capacity, 80);
    EXPECT_EQ(s.num_recv_rows, 1152);  // round_up(80 + 8*127, 128)
    EXPECT_FALSE(s.exact);
}

TEST(Layout, GroupExpert) {
    const Layout l = make_layout(small());  // R = 4, epn = 4
    std::vector<int32_t> words(size_t(make_plan_sizes(l).total_words) + 64, 0);
    int32_t* base = words.data();
    while (reinterpret_cast<uintptr_t>(base) % 256 != 0) ++base;
    const PlanView p = make_plan_view(l, base);
    const int32_t slots_of_rank2[4] = {1, 7, -1, -1};
    std::copy(slots_of_rank2, slots_of_rank2 + 4, p.slot_expert + 2 * 4);
    const int want[8] = {8, 9, 10, 11, 1, 7, -1, -1};  // own experts 2*epn + g, then the slots
    for (int g = 0; g < 8; ++g) {
        EXPECT_EQ(group_expert(l, p, 2, g), want[g]) << "group " << g;
        EXPECT_EQ(group_expert(4, slots_of_rank2, 2, g), want[g]) << "group " << g;
    }
}

TEST(Layout, SymmetricRegionsAreAlignedAndDisjoint) {
    const Layout l = make_layout(small());
    const SymmetricLayout s = make_symmetric_layout(l);
    const int64_t offs[] = {s.barrier_offset,    s.status_offset,   s.tpe_all_offset,  s.recv_x_offset,
                            s.recv_w_offset,     s.row_head_offset, s.row_next_offset, s.partial_offset,
                            s.recv_marks_offset, s.total_bytes};
    const int64_t sizes[] = {64 * 8, 16, 4 * 16 * 4, 120 * 64 * 2, 120 * 4, 120 * 4, 120 * 4, 120 * 64 * 2, 120};
    for (int i = 0; i + 1 < int(std::size(offs)); ++i) {
        EXPECT_EQ(offs[i] % 256, 0) << i;
        EXPECT_GE(offs[i + 1] - offs[i], sizes[i]) << i;
    }
}

// ---- Serving layout (ViewShape: the pools' num_slots and view_stride) and the owner planner's capacity ----

TEST(ServingConfig, BadSlotsAndStrideAreNamedWithTheirValue) {
    Config c = small();
    EXPECT_EQ(view_error(c, {.num_slots = 5}), "num_slots (B) must be -1 (= epn) or in [0, epn=4], got 5");
    EXPECT_EQ(view_error(c, {.num_slots = -2}), "num_slots (B) must be -1 (= epn) or in [0, epn=4], got -2");
    EXPECT_EQ(view_error(c, {.view_stride = 3}), "view_stride (Q) must be 0 (= epn) or in [epn=4, 1048576], got 3");
    EXPECT_EQ(view_error(c, {.view_stride = (1 << 20) + 1}),
              "view_stride (Q) must be 0 (= epn) or in [epn=4, 1048576], got 1048577");
    EXPECT_EQ(view_error(c, {.view_stride = -1}), "view_stride (Q) must be 0 (= epn) or in [epn=4, 1048576], got -1");
    // cu_seqlens [R][R*Q + B] must be indexable in int32: 64 * (64*2^20 + 1) is not.
    c.num_ranks = 64, c.num_experts = 64;
    EXPECT_EQ(view_error(c, {.num_slots = 1, .view_stride = 1 << 20}),
              "view_stride (Q) too large: cu_seqlens' R*(R*Q + B) = 64*67108865 must fit int32 (Q=1048576)");
    c.num_ranks = 8, c.num_experts = 8;  // 8 * (8*2^20 + 1) fits
    EXPECT_EQ(view_error(c, {.num_slots = 1, .view_stride = 1 << 20}), "");
}

TEST(ServingConfig, LimitsAreValid) {
    for (int b : {-1, 0, 1, 4}) EXPECT_EQ(view_error(small(), {.num_slots = b}), "") << "num_slots " << b;
    for (int q : {0, 4, 5, 1 << 20}) EXPECT_EQ(view_error(small(), {.view_stride = q}), "") << "view_stride " << q;
}

TEST(ServingConfig, LayoutOfTheViewGroups) {
    Config c = small();
    const Layout training = make_layout(c);
    EXPECT_FALSE(training.serving);
    EXPECT_EQ(training.num_slots, 4);
    EXPECT_EQ(training.view_stride, 4);
    EXPECT_EQ(training.num_groups(), 8);
    EXPECT_EQ(training.first_slot_group(), 4);
    // B = epn spelled out: the training layout
    EXPECT_FALSE(make_layout(c, PlannerKind::kBalanced, {.num_slots = 4}).serving);

    const Layout l = make_layout(c, PlannerKind::kBalanced, {.num_slots = 2, .view_stride = 6});
    EXPECT_TRUE(l.serving);
    EXPECT_EQ(l.num_groups(), 4 * 6 + 2);
    EXPECT_EQ(l.first_slot_group(), 24);
    EXPECT_EQ(l.num_recv_rows, training.num_recv_rows);  // round_up(C + 2*epn*(align-1), align) whatever B
    EXPECT_EQ(l.capacity, 64);
    EXPECT_EQ(l.expert_view_row(0), 0);
    EXPECT_EQ(l.expert_view_row(5), 7);  // rank 1's local expert 1
    EXPECT_EQ(l.expert_view_row(15), 21);
    // group_expert over rank 2's view: rank h's experts at rows 6h..6h+3, pad rows 6h+4, 6h+5, then the 2 slots.
    const int32_t slots[4] = {3, 9, -1, -1};  // rank 2 may list only B of them; entries past B are never read
    std::vector<int> want;
    for (int h = 0; h < 4; ++h) {
        for (int i = 0; i < 4; ++i) want.push_back(h * 4 + i);
        want.push_back(-1);
        want.push_back(-1);
    }
    want.push_back(3);
    want.push_back(9);
    for (int g = 0; g < l.num_groups(); ++g) EXPECT_EQ(group_expert(l, slots, 2, g), want[size_t(g)]) << "group " << g;
    // The plan's cu_seqlens holds R rows of num_groups() ends.
    EXPECT_GE(make_plan_sizes(l).stats - make_plan_sizes(l).cu_seqlens, 4 * 26);
}

TEST(ServingConfig, OwnerCapacityIsTheWorstCase) {
    Config c = small();
    const Layout l = make_layout(c, PlannerKind::kOwner);
    EXPECT_TRUE(l.owner);
    EXPECT_FALSE(l.exact);
    EXPECT_EQ(l.capacity, 4 * 32 * 2);  // R*S*K
    EXPECT_EQ(l.num_recv_rows, 288);    // round_up(C + epn*(align-1), align) = round_up(284, 8)
    EXPECT_EQ(l.num_groups(), 8);       // the training group layout (B = epn)
    EXPECT_FALSE(make_layout(c, PlannerKind::kBalanced).owner);
    EXPECT_EQ(make_layout(c, PlannerKind::kGreedy).capacity, 64);
    EXPECT_EQ(make_layout(c, PlannerKind::kOwner, {.num_slots = 1}).num_groups(), 17);  // the serving view's (B < epn)

    // What it costs, in one line, when it does not fit.
    c = small();
    c.num_ranks = 64, c.num_experts = 64, c.num_tokens = 1 << 22, c.topk = 16;  // R*S*K = 2^32
    EXPECT_EQ(error_of(c, PlannerKind::kOwner),
              "owner planner: its receive capacity R*S*K = 64*4194304*16 = 4294967296 rows must fit int32 (it is "
              "meant for decode-sized S)");
    EXPECT_EQ(error_of(c, PlannerKind::kBalanced).find("owner"), std::string::npos);      // R*NvS there, not owner's
    c.num_ranks = 2, c.num_experts = 2, c.num_tokens = 1 << 29, c.topk = 1, c.align = 1;  // C = 2^30, R*NvS = 2^31
    EXPECT_EQ(error_of(c, PlannerKind::kOwner),
              "owner planner: receive rows NvS = 1073741824 (capacity R*S*K = 1073741824) times R = 2 must fit int32 "
              "(it is meant for decode-sized S)");
    EXPECT_EQ(error_of(small(), PlannerKind(7)),
              "planner kind must be greedy (0), balanced (1), owner (2) or static (3), got 7");
}

// The static planner: the worst-case capacity of the owner planner, with room for the padding of the own groups and
// the B placed slots.
TEST(ServingConfig, StaticCapacityIsTheWorstCaseWithSlotGroups) {
    Config c = small();
    const Layout l = make_layout(c, PlannerKind::kStatic);
    EXPECT_TRUE(l.placed);
    EXPECT_FALSE(l.owner);
    EXPECT_FALSE(l.exact);
    EXPECT_EQ(l.capacity, 4 * 32 * 2);  // R*S*K
    EXPECT_EQ(l.num_recv_rows, 312);    // round_up(C + (epn + B)*(align-1), align) = round_up(256 + 8*7, 8)
    EXPECT_TRUE(layout_fits(l, PlannerKind::kStatic));
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced, PlannerKind::kOwner})
        EXPECT_FALSE(layout_fits(l, kind)) << int(kind);
    EXPECT_FALSE(layout_fits(make_layout(c, PlannerKind::kOwner), PlannerKind::kStatic));
    const Layout s = make_layout(c, PlannerKind::kStatic, {.num_slots = 1});
    EXPECT_EQ(s.num_groups(), 17);    // the serving view's
    EXPECT_EQ(s.num_recv_rows, 296);  // round_up(256 + (4 + 1)*7, 8)
    c = small();
    c.num_ranks = 64, c.num_experts = 64, c.num_tokens = 1 << 22, c.topk = 16;  // R*S*K = 2^32
    EXPECT_EQ(error_of(c, PlannerKind::kStatic),
              "static planner: its receive capacity R*S*K = 64*4194304*16 = 4294967296 rows must fit int32 (the "
              "worst case of any placement)");
}

TEST(ServingConfig, TheViewIsNotPartOfTheConfig) {
    // B and Q belong to the pools (a Buffer made from them takes both): the config's hash, mismatch and text, which
    // every rank's Buffer compares, are those of its own fields.
    const Config a = small();
    EXPECT_EQ(a.to_string(), "Config(R=4, rank=0, E=16, S=32, K=2, H=64, align=8, capacity_factor=1)");
    EXPECT_EQ(make_layout(a, PlannerKind::kBalanced, {.num_slots = 2}).num_slots, 2);
    EXPECT_EQ(make_layout(a).num_slots, 4);
}

}  // namespace
}  // namespace flatep
