// The ops' Args checks (src/ops/*_args.hpp) on the fields the runtime always fills valid, as a direct caller of the
// launchers and host twins would trip them: rank and num_ranks outside the world, slot counts, byte and element
// counts that the kernels cannot move, misaligned or null pointers, the static planner without a placement; and
// flatep::quantize_fp8_rows (public API) with a bad hidden, row count or null pointer. One kInvalidArgument line
// naming the field and the value each; the same Args with the field fixed pass.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flatep/error.hpp"
#include "flatep/ffn.hpp"
#include "flatep/fp8.hpp"
#include "layout/layout.hpp"
#include "ops/combine_grad_args.hpp"
#include "ops/dispatch_fp8_args.hpp"
#include "ops/grad_reduce_args.hpp"
#include "ops/plan_args.hpp"
#include "ops/prefetch_args.hpp"
#include "ops/write_grads_args.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::make_config;
using testing::Outcome;
using testing::outcome_of;

constexpr int kInvalid = int(ErrorCategory::kInvalidArgument);

// 16-byte aligned scratch that the checks only look at (never dereferenced).
alignas(16) uint8_t g_scratch[64];
uint8_t* aligned() { return g_scratch; }
uint8_t* off_by(int bytes) { return g_scratch + bytes; }
std::string address_of(const void* p) { return std::to_string(reinterpret_cast<uintptr_t>(p)); }

// Runs each (expected message, call) row: the exact message and kInvalidArgument; then `good` must pass.
void expect_rows(const std::vector<std::pair<std::string, std::function<void()>>>& rows,
                 const std::function<void()>& good) {
    for (const auto& [want, call] : rows) {
        const Outcome o = outcome_of(call);
        EXPECT_EQ(o.message, want);
        EXPECT_EQ(o.category, kInvalid) << want;
    }
    EXPECT_EQ(outcome_of(good).message, "(no error)");
}

// with(change): a call that checks a copy of `base` changed by `change` (base must outlive the calls).
template <class Args, class Check>
auto changed_args(const Args& base, Check check) {
    return [&base, check](const std::function<void(Args&)>& change) {
        return std::function<void()>([&base, check, change] {
            Args a = base;
            change(a);
            check(a);
        });
    };
}

TEST(OpArgsChecks, WriteGradsRefusesEmptyShapesAndNullArrays) {
    const int32_t slot_expert[2] = {-1, -1}, cu_seqlens[4] = {1, 2, 2, 2};
    float grads[32] = {};
    const WriteGradsArgs base{2, 8, slot_expert, cu_seqlens, aligned(), 2, grads, false};
    const auto with = changed_args(base, [](const WriteGradsArgs& a) { check_write_grads_args(a); });
    expect_rows(
        {
            {"write_grads: experts_per_rank must be positive, got 0", with([](auto& a) { a.experts_per_rank = 0; })},
            {"write_grads: expert_elems must be positive, got 0", with([](auto& a) { a.expert_elems = 0; })},
            {"write_grads: expert_elems must be positive, got -8", with([](auto& a) { a.expert_elems = -8; })},
            {"write_grads: grads is null", with([](auto& a) { a.grads = nullptr; })},
            {"write_grads: the plan arrays are null", with([](auto& a) { a.slot_expert = nullptr; })},
            {"write_grads: the plan arrays are null", with([](auto& a) { a.cu_seqlens = nullptr; })},
        },
        [&] { check_write_grads_args(base); });
}

TEST(OpArgsChecks, WriteGradsCopiesASlotGroupOnlyWhenTheSlotIsUsedAndHasRows) {
    // epn 2: groups 0, 1 own experts, 2, 3 slots; group 2 has a row (cu 1 -> 2), group 3 none.
    const int32_t cu_seqlens[4] = {0, 1, 2, 2};
    const int32_t unused[2] = {-1, -1}, used[2] = {5, 7};
    EXPECT_EQ(group_grad_action(2, unused, cu_seqlens, 2, false), kGradSkip);  // rows, but the slot is unused
    EXPECT_EQ(group_grad_action(2, used, cu_seqlens, 2, false), kGradCopy);
    EXPECT_EQ(group_grad_action(2, used, cu_seqlens, 3, false), kGradSkip);  // used, no rows
    EXPECT_EQ(group_grad_action(2, used, cu_seqlens, 0, false), kGradZero);  // own, no rows
    EXPECT_EQ(group_grad_action(2, used, cu_seqlens, 1, true), kGradAdd);    // own, rows, accumulate
}

TEST(OpArgsChecks, PlanRefusesARankOutsideTheWorldAndTheStaticPlannerWithoutPlacement) {
    const int32_t idx[2] = {0, 1};
    PlanArgs base{};
    base.layout = make_layout(make_config(2, 4, 2, 1, 8, 1));
    base.rank = 1;
    base.num_tokens = 2;
    base.topk_idx = idx;
    base.index_bytes = 4;
    base.planner = PlannerKind::kBalanced;
    const auto with = changed_args(base, [](const PlanArgs& a) { check_plan_args(a); });
    const int32_t placement[1] = {0};
    expect_rows(
        {
            {"plan: rank must be in [0, 2), got 2", with([](auto& a) { a.rank = 2; })},
            {"plan: rank must be in [0, 2), got -1", with([](auto& a) { a.rank = -1; })},
            {"plan: the static planner has no placement yet: call set_placement (collective) first",
             with([](auto& a) { a.planner = PlannerKind::kStatic; })},
        },
        with([&](auto& a) {
            a.planner = PlannerKind::kStatic;  // with a placement, the Args checks pass (the layout is the op's)
            a.placement = placement;
        }));
}

TEST(OpArgsChecks, PrefetchRefusesWorldSizesSlotCountsAndExpertSizesTheKernelsCannotMove) {
    const int32_t slot_expert[2] = {-1, -1};
    PrefetchArgs base{};
    base.rank = 0;
    base.num_ranks = 1;
    base.experts_per_rank = 2;
    base.num_slots = 2;
    base.slot_expert = slot_expert;
    base.num_projections = 1;
    base.projections[0].expert_bytes = 32;
    base.projections[0].weights = aligned();
    base.projections[0].slot_pools[0] = aligned();
    const auto with = changed_args(base, [](const PrefetchArgs& a) { check_prefetch_args(a); });
    expect_rows(
        {
            {"prefetch: num_ranks must be in [1, 64], got 0", with([](auto& a) { a.num_ranks = 0; })},
            {"prefetch: num_ranks must be in [1, 64], got 65", with([](auto& a) { a.num_ranks = 65; })},
            {"prefetch: rank must be in [0, 1), got 1", with([](auto& a) { a.rank = 1; })},
            {"prefetch: num_slots must be in [0, epn=2], got -1", with([](auto& a) { a.num_slots = -1; })},
            {"prefetch: num_slots must be in [0, epn=2], got 3", with([](auto& a) { a.num_slots = 3; })},
            {"prefetch: projection 0: expert_bytes must be a positive multiple of 16, got 0",
             with([](auto& a) { a.projections[0].expert_bytes = 0; })},
            {"prefetch: projection 0: expert_bytes must be a positive multiple of 16, got 24",
             with([](auto& a) { a.projections[0].expert_bytes = 24; })},
            {"prefetch: weights must be 16-byte aligned, got address " + address_of(off_by(8)),
             with([](auto& a) { a.projections[0].weights = off_by(8); })},
        },
        [&] { check_prefetch_args(base); });
}

TEST(OpArgsChecks, ReduceGradRefusesWorldSizesAndElementCountsOffFour) {
    alignas(16) float grads[16] = {};
    GradReduceArgs base{};
    const int32_t slot_expert[2] = {-1, -1};
    base.rank = 0;
    base.num_ranks = 1;
    base.experts_per_rank = 2;
    base.expert_elems = 8;
    base.slot_expert = slot_expert;
    base.grads = grads;
    base.reduce_pools[0] = grads;
    const auto with = changed_args(base, [](const GradReduceArgs& a) { check_grad_reduce_args(a); });
    expect_rows(
        {
            {"reduce_grad: num_ranks must be in [1, 64], got 0", with([](auto& a) { a.num_ranks = 0; })},
            {"reduce_grad: num_ranks must be in [1, 64], got 65", with([](auto& a) { a.num_ranks = 65; })},
            {"reduce_grad: rank must be in [0, 1), got -1", with([](auto& a) { a.rank = -1; })},
            {"reduce_grad: expert_elems must be a positive multiple of 4, got 0",
             with([](auto& a) { a.expert_elems = 0; })},
            {"reduce_grad: expert_elems must be a positive multiple of 4, got 6",
             with([](auto& a) { a.expert_elems = 6; })},
        },
        [&] { check_grad_reduce_args(base); });
}

TEST(OpArgsChecks, CombineGradRefusesARankOutsideTheWorld) {
    CombineGradArgs base{};
    base.layout = make_layout(make_config(2, 4, 2, 1, 8, 1));
    base.rank = 0;
    base.rows = reinterpret_cast<const uint16_t*>(aligned());
    base.grad_weights = reinterpret_cast<float*>(aligned());
    base.y = reinterpret_cast<const uint16_t*>(aligned());
    auto with = [&](int rank) {
        return [&, rank] {
            CombineGradArgs a = base;
            a.rank = rank;
            check_combine_grad_args(a);
        };
    };
    expect_rows({{"combine_grad: rank must be in [0, 2), got -1", with(-1)},
                 {"combine_grad: rank must be in [0, 2), got 2", with(2)}},
                with(1));
}

TEST(OpArgsChecks, DispatchFp8RefusesScalesOffFourBytes) {
    DispatchFp8Args base{};
    base.layout = make_layout(make_config(1, 2, 2, 1, 128, 1));
    base.rank = 0;
    base.x_fp8 = aligned();
    base.x_scales = reinterpret_cast<const float*>(aligned());
    base.scale_mode = Fp8Scale::kFloat;
    base.recv_x = aligned();
    base.recv_scales = reinterpret_cast<float*>(aligned());
    const auto with = changed_args(base, [](const DispatchFp8Args& a) { check_dispatch_fp8_args(a, 2); });
    const std::string want = "dispatch_fp8: x_scales and recv_scales must be 4-byte aligned";
    expect_rows(
        {
            {want, with([](auto& a) { a.x_scales = reinterpret_cast<const float*>(off_by(2)); })},
            {want, with([](auto& a) { a.recv_scales = reinterpret_cast<float*>(off_by(6)); })},
            {"dispatch_fp8: rank must be in [0, 1), got 1", with([](auto& a) { a.rank = 1; })},
            {"dispatch_fp8: recv_x must be 16-byte aligned, got address " + address_of(off_by(4)),
             with([](auto& a) { a.recv_x = off_by(4); })},
        },
        with([](auto& a) { a.recv_scales = reinterpret_cast<float*>(off_by(4)); }));  // 4 bytes is enough
}

TEST(OpArgsChecks, QuantizeFp8RowsRefusesABadHiddenRowCountOrNullPointers) {
    std::vector<uint16_t> x(2 * 128, 0x3f80);  // bf16 1.0
    std::vector<uint8_t> q(2 * 128);
    std::vector<float> scales(2);
    const std::string hidden =
        "quantize_fp8_rows: hidden (H) must be a positive multiple of 128 (one scale per 128 "
        "channels), got H=";
    const std::string unset = "quantize_fp8_rows: x, q and scales must be set";
    auto call = [&](const uint16_t* xp, int64_t rows, int h, uint8_t* qp, float* sp) {
        return [=] { quantize_fp8_rows(xp, rows, h, Fp8Scale::kFloat, qp, sp); };
    };
    expect_rows(
        {
            {hidden + "0", call(x.data(), 2, 0, q.data(), scales.data())},
            {hidden + "-128", call(x.data(), 2, -128, q.data(), scales.data())},
            {hidden + "100", call(x.data(), 2, 100, q.data(), scales.data())},
            {"quantize_fp8_rows: rows must be >= 0, got -1", call(x.data(), -1, 128, q.data(), scales.data())},
            {unset, call(nullptr, 2, 128, q.data(), scales.data())},
            {unset, call(x.data(), 2, 128, nullptr, scales.data())},
            {unset, call(x.data(), 2, 128, q.data(), nullptr)},
        },
        call(nullptr, 0, 128, nullptr, nullptr));  // no rows: nothing is read or written
    // Good arguments: every 1.0 of a block quantises to e4m3 448 (0x7e) with scale 1/448.
    quantize_fp8_rows(x.data(), 2, 128, Fp8Scale::kFloat, q.data(), scales.data());
    EXPECT_EQ(q[0], 0x7e);
    EXPECT_EQ(q[255], 0x7e);
    EXPECT_EQ(scales[1], 1.0f / 448.0f);
}

TEST(OpArgsChecks, FfnRowsPassTheirChecksWithNoRowsSiluAndUntouchedRowsPastTheEnd) {
    // Valid arguments reach the launch: a build without CUDA says so (kRuntime); the checks before it let through
    // rows = 0 with null rows, the silu activation and PastEnd::kUntouched.
#if defined(FLATEP_WITH_CUDA)
    GTEST_SKIP() << "a CUDA build launches the kernels; the GPU tests run them";
#else
    static const int32_t end = 0;
    const std::string no_cuda = ": this FlatEP build has no CUDA support (nvcc was not found at build time)";
    const Outcome act =
        outcome_of([] { activate_rows(nullptr, nullptr, 0, 8, FfnActivation::kSilu, &end, PastEnd::kUntouched); });
    EXPECT_EQ(act.message, "activate_rows" + no_cuda);
    EXPECT_EQ(act.category, int(ErrorCategory::kRuntime));
    const Outcome zero = outcome_of([] { zero_rows_from_end(nullptr, 0, 8, &end); });
    EXPECT_EQ(zero.message, "zero_rows_from_end" + no_cuda);
    EXPECT_EQ(zero.category, int(ErrorCategory::kRuntime));
#endif
}

}  // namespace
}  // namespace flatep
