// flatep::Buffer through the local host transport: exact numerics of combine, dedup counters, plan ownership
// and every error path (config mismatch, foreign plan, bad arguments, bad expert ids, timeouts).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "host/op_stats.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::failures;
using testing::run_ranks;

// Runs fn(rank, error) where fn is expected to throw; returns the caught Error's category and message per rank.
struct Caught {
    bool thrown = false;
    ErrorCategory category = ErrorCategory::kRuntime;
    std::string message;
};

template <typename Fn>
Caught catch_error(Fn&& fn) {
    Caught c;
    try {
        fn();
    } catch (const Error& e) {
        c.thrown = true;
        c.category = e.category();
        c.message = e.message();
    }
    return c;
}

TEST(BufferNumerics, WeightedCombineUsesOneRoundingPerFusedMultiplyAdd) {
    // One rank, one token, two experts in one chain: acc = fma(w, y1, fma(w, y0, 0)). With w = 1 + 2^-23 and
    // y1 = -y0 = 1 + 2^-7 the exact product's 2^-30 term survives only with a fused multiply-add.
    LocalHostWorld world(1, 10.0);
    Buffer buffer(testing::make_config(1, 2, 1, 2, 8, 1, 1.0, 0), world.transport(0));
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 1);
    const int nvs = buffer.num_recv_rows();
    const int row0 = plan.entry_rows()[0], row1 = plan.entry_rows()[1];
    ASSERT_EQ(plan.row_heads()[row1], row0);
    ASSERT_EQ(plan.row_nexts()[row0], row1);
    std::vector<uint16_t> y(size_t(nvs) * 8, 0);
    std::vector<float> w(nvs, 0.0f);
    const float one_plus = 1.0f + std::ldexp(1.0f, -7);
    for (int i = 0; i < 8; ++i) {
        y[row0 * 8 + i] = float_to_bf16(-one_plus);
        y[row1 * 8 + i] = float_to_bf16(one_plus);
    }
    w[row0] = w[row1] = 1.0f + std::ldexp(1.0f, -23);
    std::vector<uint16_t> out(8, 0xffff);
    buffer.combine(plan, y.data(), w.data(), out.data());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], float_to_bf16(std::ldexp(1.0f, -30))) << "elem " << i;
    // Unweighted: the two rows cancel exactly.
    buffer.combine(plan, y.data(), nullptr, out.data());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], 0) << "elem " << i;
}

TEST(BufferNumerics, PartialsAreRoundedToBf16BeforeTheCrossRankSum) {
    // Rank 0's one token goes to expert 0 (rank 0, y = 2^-8) and experts 2, 3 (rank 1, y = 1 and 2^-8). Rank 1's
    // partial 1 + 2^-8 rounds (ties to even) to 1 in bf16, so out = bf16(2^-8 + 1) = 1. Summing all three in fp32
    // without rounding the partial would give 1 + 2^-7.
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    std::vector<uint16_t> out(8, 0xffff);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Config c = testing::make_config(R, 4, 1, 3, 8, 1, 1.0, rank);
        c.capacity_factor = 4.0;  // slack: every entry stays on its home rank
        Buffer buffer(c, world.transport(rank));
        const int32_t idx[3] = {2, 0, 3};
        const Plan plan = buffer.plan(idx, 4, rank == 0 ? 1 : 0);
        const int nvs = buffer.num_recv_rows();
        std::vector<uint16_t> y(size_t(nvs) * 8, 0);
        const float tiny = std::ldexp(1.0f, -8);
        for (int i = 0; i < 8; ++i) {
            if (rank == 0) y[i] = float_to_bf16(tiny);
            if (rank == 1) y[i] = float_to_bf16(1.0f), y[8 + i] = float_to_bf16(tiny);
        }
        buffer.combine(plan, y.data(), nullptr, rank == 0 ? out.data() : nullptr);
    });
    ASSERT_EQ(failures(errors), "");
    for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], float_to_bf16(1.0f)) << "elem " << i;
    EXPECT_NE(float_to_bf16(1.0f), float_to_bf16(1.0f + std::ldexp(1.0f, -7)));
}

TEST(BufferPlan, PlanStaysValidAfterLaterPlans) {
    // Backward reuses the forward's plan after other plans were made: dispatch with the older plan must still
    // place the rows of the older routing.
    const int R = 3, E = 6, S = 8, K = 2, H = 8;
    LocalHostWorld world(R, 10.0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(testing::make_config(R, E, S, K, H, 4, 1.0, rank), world.transport(rank));
        std::vector<int32_t> idx_a(S * K), idx_b(S * K);
        for (int t = 0; t < S; ++t) {
            idx_a[t * K] = (t + rank) % E;
            idx_a[t * K + 1] = (t + rank + 1) % E;
            idx_b[t * K] = 0;
            idx_b[t * K + 1] = 1 + (t % (E - 1));
        }
        const Plan a = buffer.plan(idx_a.data(), 4, S);
        const Plan b = buffer.plan(idx_b.data(), 4, S);
        EXPECT_EQ(b.generation(), a.generation() + 1);
        std::vector<uint16_t> x(S * H);
        for (int t = 0; t < S; ++t)
            for (int i = 0; i < H; ++i) x[t * H + i] = uint16_t(0x3f80 + rank * 64 + t);  // distinct finite bf16
        const int nvs = buffer.num_recv_rows();
        std::vector<uint16_t> recv(size_t(nvs) * H), out(S * H);
        buffer.dispatch(a, x.data(), nullptr, recv.data(), nullptr);
        // Combine of the dispatched rows with weights 1 gives back K * x (exact: small integers times powers of 2).
        buffer.combine(a, recv.data(), nullptr, out.data());
        for (int t = 0; t < S; ++t) {
            ASSERT_EQ(out[t * H], float_to_bf16(2.0f * bf16_to_float(x[t * H]))) << "rank " << rank << " token " << t;
        }
    });
    EXPECT_EQ(failures(errors), "");
}

TEST(BufferPlan, PlanFromAnotherBufferIsRejected) {
    LocalHostWorld world(1, 10.0);
    Buffer first(testing::make_config(1, 2, 4, 1, 8, 1, 1.0, 0), world.transport(0));
    Buffer second(testing::make_config(1, 2, 4, 1, 8, 1, 1.0, 0), world.transport(0));
    const int32_t idx[4] = {0, 1, 0, 1};
    const Plan plan = first.plan(idx, 4, 4);
    std::vector<uint16_t> x(32), recv(size_t(second.num_recv_rows()) * 8);
    const Caught c = catch_error([&] { second.dispatch(plan, x.data(), nullptr, recv.data(), nullptr); });
    ASSERT_TRUE(c.thrown);
    EXPECT_EQ(c.category, ErrorCategory::kMismatch);
    EXPECT_EQ(c.message, "dispatch: plan was made by buffer " + std::to_string(first.id()) + ", not by this buffer (" +
                             std::to_string(second.id()) + ")");
    const Caught empty = catch_error([&] { second.combine(Plan(), recv.data(), nullptr, x.data()); });
    EXPECT_TRUE(empty.thrown);
    EXPECT_EQ(empty.message, "combine: plan is empty (default-constructed); get one from Buffer::plan()");
}

TEST(BufferErrors, ConfigMismatchIsReportedOnEveryRank) {
    const int R = 4;
    LocalHostWorld world(R, 10.0);
    std::vector<Caught> caught(R);
    run_ranks(R, [&](int rank) {
        Config c = testing::make_config(R, 8, 16, rank == 2 ? 4 : 8, 16, 4, 1.0, rank);
        caught[rank] = catch_error([&] { Buffer buffer(c, world.transport(rank)); });
    });
    for (int r = 0; r < R; ++r) {
        ASSERT_TRUE(caught[r].thrown) << "rank " << r;
        EXPECT_EQ(caught[r].category, ErrorCategory::kMismatch);
    }
    EXPECT_EQ(caught[0].message, "config mismatch with rank 2: topk: 8 vs 4");
    EXPECT_EQ(caught[2].message, "config mismatch with rank 0: topk: 4 vs 8");
}

TEST(BufferErrors, InvalidConfigIsRejectedBeforeAnyCollective) {
    LocalHostWorld world(2, 0.5);
    // Rank 0 alone: an invalid config must throw at once (no all_gather, so no timeout).
    const auto start = std::chrono::steady_clock::now();
    const Caught c =
        catch_error([&] { Buffer buffer(testing::make_config(2, 3, 4, 1, 8, 1, 1.0, 0), world.transport(0)); });
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.4);
    ASSERT_TRUE(c.thrown);
    EXPECT_EQ(c.category, ErrorCategory::kInvalidArgument);
    EXPECT_EQ(c.message, "num_experts (E) must be a multiple of num_ranks (R): E=3 R=2");
    const Caught rank =
        catch_error([&] { Buffer buffer(testing::make_config(2, 4, 4, 1, 8, 1, 1.0, 1), world.transport(0)); });
    EXPECT_EQ(rank.message, "Buffer: config.rank (1) differs from the transport's rank (0)");
}

TEST(BufferErrors, BadCallArgumentsNameTheArgument) {
    LocalHostWorld world(1, 10.0);
    Buffer buffer(testing::make_config(1, 2, 4, 1, 8, 1, 1.0, 0), world.transport(0));
    const int32_t idx[4] = {0, 1, 0, 1};
    EXPECT_EQ(catch_error([&] { buffer.plan(idx, 2, 4); }).message,
              "plan: index_bytes must be 4 (int32) or 8 (int64), got 2");
    EXPECT_EQ(catch_error([&] { buffer.plan(idx, 4, 5); }).message, "plan: num_tokens must be in [0, S=4], got 5");
    EXPECT_EQ(catch_error([&] { buffer.plan(idx, 4, -1); }).message, "plan: num_tokens must be in [0, S=4], got -1");
    EXPECT_EQ(catch_error([&] { buffer.plan(nullptr, 4, 4); }).message, "plan: topk_idx is null");
    const Plan plan = buffer.plan(idx, 4, 4);
    std::vector<uint16_t> x(32), recv(size_t(buffer.num_recv_rows()) * 8);
    EXPECT_EQ(catch_error([&] { buffer.dispatch(plan, nullptr, nullptr, recv.data(), nullptr); }).message,
              "dispatch: x is null");
    EXPECT_EQ(catch_error([&] { buffer.dispatch(plan, x.data(), nullptr, nullptr, nullptr); }).message,
              "dispatch: recv_x is null");
    EXPECT_EQ(catch_error([&] { buffer.combine(plan, nullptr, nullptr, x.data()); }).message, "combine: y is null");
    EXPECT_EQ(catch_error([&] { buffer.combine(plan, recv.data(), nullptr, nullptr); }).message,
              "combine: out is null");
    // Zero tokens: null inputs are fine.
    const Plan none = buffer.plan(nullptr, 4, 0);
    buffer.dispatch(none, nullptr, nullptr, recv.data(), nullptr);
    buffer.combine(none, recv.data(), nullptr, nullptr);
    EXPECT_EQ(none.num_tokens(), 0);
}

TEST(BufferErrors, BadExpertIdsAreSkippedRecordedAndReportedWithTheirIndex) {
    const int R = 2, E = 4, S = 4, K = 2, H = 8;
    LocalHostWorld world(R, 10.0);
    std::vector<Caught> caught(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(testing::make_config(R, E, S, K, H, 4, 1.0, rank), world.transport(rank));
        host::OpStats stats;
        internal::set_op_stats(buffer, &stats);
        // Rank 1: token 1 has an id of E, token 3 of -1 (first bad flat index 3); int64 with a huge id too.
        std::vector<int64_t> idx = {0, 1, 2, 3, 0, 2, 1, 3};
        if (rank == 1) {
            idx[3] = E;
            idx[6] = -1;
            idx[7] = int64_t(1) << 40;
        }
        const Plan plan = buffer.plan(idx.data(), 8, S);
        const int nvs = buffer.num_recv_rows();
        const int canary = 2;
        std::vector<uint16_t> x(S * H, 0x3f80), recv((nvs + 2 * canary) * H, 0xa5a5), out((S + 2 * canary) * H, 0xa5a5);
        std::vector<float> w(nvs + 2 * canary, -7.0f);
        buffer.dispatch(plan, x.data(), nullptr, recv.data() + canary * H, w.data() + canary);
        buffer.combine(plan, recv.data() + canary * H, nullptr, out.data() + canary * H);
        for (int i = 0; i < canary * H; ++i) {
            ASSERT_EQ(recv[i], 0xa5a5);
            ASSERT_EQ(recv[recv.size() - 1 - i], 0xa5a5);
            ASSERT_EQ(out[i], 0xa5a5);
            ASSERT_EQ(out[out.size() - 1 - i], 0xa5a5);
        }
        // Valid entries still arrive and combine: token t's output = (number of valid entries) * 1.0.
        const int valid[2][4] = {{2, 2, 2, 2}, {2, 1, 2, 0}};
        for (int t = 0; t < S; ++t) {
            ASSERT_EQ(out[(canary + t) * H], float_to_bf16(float(valid[rank][t]))) << "rank " << rank << " t " << t;
        }
        EXPECT_EQ(plan.entry_ranks()[3], rank == 1 ? -1 : plan.entry_ranks()[3]);
        caught[rank] = catch_error([&] { buffer.check_status(); });
        // Reported once, then cleared.
        EXPECT_FALSE(catch_error([&] { buffer.check_status(); }).thrown);
    });
    EXPECT_EQ(failures(errors), "");
    EXPECT_FALSE(caught[0].thrown);
    ASSERT_TRUE(caught[1].thrown);
    EXPECT_EQ(caught[1].category, ErrorCategory::kInvalidArgument);
    EXPECT_EQ(caught[1].message,
              "rank 1: invalid expert id 4 at topk_idx flat index 3 (token 1, k 1); ids must be in [0, E=4); the entry "
              "was skipped");
}

TEST(BufferErrors, DebugModeReportsBadIdsAfterThePlan) {
    setenv("FLATEP_DEBUG", "1", 1);
    LocalHostWorld world(1, 10.0);
    Buffer buffer(testing::make_config(1, 2, 2, 1, 8, 1, 1.0, 0), world.transport(0));
    unsetenv("FLATEP_DEBUG");
    const int32_t idx[2] = {1, 7};
    const Caught c = catch_error([&] { buffer.plan(idx, 4, 2); });
    ASSERT_TRUE(c.thrown);
    EXPECT_EQ(c.message,
              "rank 0: invalid expert id 7 at topk_idx flat index 1 (token 1, k 0); ids must be in [0, E=2); the entry "
              "was skipped");
}

TEST(BufferErrors, MissingRankMakesTheOthersTimeOutNamingIt) {
    const int R = 4;
    const double timeout = 0.5;
    LocalHostWorld world(R, timeout);
    std::vector<Caught> caught(R);
    std::vector<double> seconds(R, 0.0);
    std::vector<Caught> status(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(testing::make_config(R, 8, 4, 2, 8, 1, 1.0, rank), world.transport(rank));
        const int32_t idx[8] = {0, 1, 2, 3, 4, 5, 6, 7};
        const Plan plan = buffer.plan(idx, 4, 4);
        std::vector<uint16_t> x(32), recv(size_t(buffer.num_recv_rows()) * 8);
        if (rank == 3) return;  // rank 3 never calls dispatch
        const auto start = std::chrono::steady_clock::now();
        caught[rank] = catch_error([&] { buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr); });
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        status[rank] = catch_error([&] { buffer.check_status(); });
    });
    EXPECT_EQ(failures(errors), "");
    for (int r = 0; r < 3; ++r) {
        ASSERT_TRUE(caught[r].thrown) << "rank " << r;
        EXPECT_EQ(caught[r].category, ErrorCategory::kTimeout);
        EXPECT_EQ(caught[r].message,
                  "timeout in dispatch: rank " + std::to_string(r) + " waited 0.5 s for peer 3 (flag 3 < expected 4)")
            << "rank " << r;
        EXPECT_GE(seconds[r], timeout);
        EXPECT_LT(seconds[r], timeout + 1.5);
        EXPECT_EQ(status[r].message, "rank " + std::to_string(r) + ": dispatch timed out waiting for peer 3 (flag 3)");
    }
}

TEST(BufferDedup, OneRowCrossingPerTokenAndDestination) {
    // Every token of every rank routes its K = 4 entries to experts 0..3, all on rank 0 (epn = 4): one row per
    // token crosses, the other three are fanned out locally.
    const int R = 2, E = 8, S = 6, K = 4, H = 8;
    LocalHostWorld world(R, 10.0);
    std::vector<host::OpStats> stats(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Config c = testing::make_config(R, E, S, K, H, 1, 1.0, rank);
        c.capacity_factor = 4.0;  // slack: no replicas needed, every entry stays on rank 0
        Buffer buffer(c, world.transport(rank));
        internal::set_op_stats(buffer, &stats[rank]);
        std::vector<int32_t> idx(S * K);
        for (int i = 0; i < S * K; ++i) idx[i] = i % K;
        const Plan plan = buffer.plan(idx.data(), 4, S);
        std::vector<uint16_t> x(S * H, 0x4000), recv(size_t(buffer.num_recv_rows()) * H), out(S * H);
        buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr);
        buffer.combine(plan, recv.data(), nullptr, out.data());
        for (int t = 0; t < S; ++t) ASSERT_EQ(out[t * H], float_to_bf16(8.0f));
    });
    ASSERT_EQ(failures(errors), "");
    EXPECT_EQ(stats[0].rows_pushed, S);
    EXPECT_EQ(stats[0].rows_pushed_remote, 0);
    EXPECT_EQ(stats[1].rows_pushed, S);
    EXPECT_EQ(stats[1].rows_pushed_remote, S);
    EXPECT_EQ(stats[0].rows_fanned_out, 2 * S * K);  // rank 0 receives every entry
    EXPECT_EQ(stats[0].partials_written, 2 * S);
    EXPECT_EQ(stats[1].partials_pulled_remote, S);
}

}  // namespace
}  // namespace flatep
