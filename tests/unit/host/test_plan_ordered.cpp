// dispatch and combine with plan_ordered (no entry barrier) on the CPU backend: what orders them after the last
// step's readers is the step's plan op. A slow rank reads its receive region's rows (an FFN on zero-copy rows) long
// after its dispatch; the other ranks' next plan op must hold their next dispatch until it is done.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::failures;
using testing::run_ranks;

// A token row's element i at `step`: the thousands are the step (bf16 keeps them; the rest, rounded, only makes the
// rows of one step differ).
float row_value(int step, int rank, int token, int i) { return float(step * 1000 + rank * 100 + token * 8 + i % 8); }

// Every token of every rank goes to rank 1's experts (owner planner: all rows land in rank 1's region). Each step
// runs plan, dispatch and combine plan-ordered, and the combined rows must be exact; then rank 1 reads its zero-copy
// rows again 100 ms later, while the others have moved on to the next step: with the entry barrier gone, only the
// next plan op (which waits for rank 1) keeps their next rows out of the region rank 1 is still reading. (Checked:
// with steps 2 and 3 reusing step 1's plan, no plan op between, rank 1 reads the next step's rows and this fails.)
TEST(PlanOrderedOps, NextDispatchWaitsForASlowReaderThroughThePlanOp) {
    const int R = 4, epn = 2, E = R * epn, S = 6, K = 2, H = 8;
    transport::LocalHostWorld world(R, 20.0);
    std::vector<int> rows_read(R, 0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        const Config config{
            .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = H, .align = 1};
        Buffer buffer(config, world.transport(rank), PlannerKind::kOwner);
        std::vector<int32_t> idx(size_t(S) * K);
        for (int t = 0; t < S; ++t)
            for (int k = 0; k < K; ++k) idx[size_t(t) * K + k] = epn + k;  // experts 2, 3: rank 1's
        std::vector<uint16_t> x(size_t(S) * H), y, out(size_t(S) * H), want(size_t(S) * H);
        for (int step = 1; step <= 3; ++step) {
            for (int t = 0; t < S; ++t)
                for (int i = 0; i < H; ++i) x[size_t(t) * H + i] = float_to_bf16(row_value(step, rank, t, i));
            const Plan plan = buffer.plan(idx.data(), 4, S);
            buffer.dispatch(plan, x.data(), nullptr, buffer.symmetric_recv_x(), buffer.symmetric_recv_w(),
                            {.options = {.plan_ordered = true}});
            const uint16_t* rows = buffer.symmetric_recv_x();
            const int32_t end = plan.cu_seqlens(rank).back();
            // The expert: y = rows as they are. combine sums each token's K rows: 2 * x (exact in bf16).
            y.assign(rows, rows + int64_t(buffer.num_recv_rows()) * H);
            buffer.combine(plan, y.data(), nullptr, out.data(), {.options = {.plan_ordered = true}});
            for (size_t i = 0; i < want.size(); ++i) want[i] = float_to_bf16(2.0f * bf16_to_float(x[i]));
            ASSERT_EQ(out, want) << "rank " << rank << " step " << step;
            if (rank != 1) {
                ASSERT_EQ(end, 0) << "rank " << rank << " received rows: the routing puts every row on rank 1";
                continue;
            }
            // Rank 1 reads its zero-copy rows again, late (they stay valid until its next dispatch): every source's
            // S tokens, each row once per entry, must all still be this step's.
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            for (int32_t r = 0; r < end; ++r) {
                const float v = bf16_to_float(rows[int64_t(r) * H]);
                ASSERT_EQ(int(v) / 1000, step) << "row " << r << " holds step " << int(v) / 1000 << "'s token";
                ++rows_read[rank];
            }
        }
    });
    ASSERT_EQ(failures(errors), "");
    EXPECT_EQ(rows_read[1], 3 * R * S * K) << "rank 1 read fewer rows than were sent: the test checks less";
}

}  // namespace
}  // namespace flatep
