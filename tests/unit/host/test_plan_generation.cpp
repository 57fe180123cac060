// Every rank must pass its plan of the same step to a collective op (design §8): a rank passing another step's plan
// makes every rank raise a kMismatch error naming both steps, and the buffer keeps working afterwards.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::failures;
using testing::run_ranks;

TEST(PlanGeneration, RanksPassingPlansOfDifferentStepsAllFailAndTheBufferRecovers) {
    const int R = 3, E = 6, S = 4, K = 2, H = 8;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> messages(R * 3);
    std::vector<int> categories(R * 3, -1);
    std::vector<std::vector<uint16_t>> outputs(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Config c;
        c.num_ranks = R, c.rank = rank, c.num_experts = E, c.num_tokens = S, c.topk = K, c.hidden = H, c.align = 1;
        Buffer buffer(c, world.transport(rank));
        const int32_t idx[S * K] = {0, 1, 2, 3, 4, 5, 1, 2};
        const Plan step1 = buffer.plan(idx, 4, S);
        const Plan step2 = buffer.plan(idx, 4, S);
        std::vector<uint16_t> x(S * H, 0x3f80), recv(size_t(buffer.layout().num_recv_rows) * H);
        std::vector<uint16_t> out(S * H);
        std::vector<float> values(buffer.layout().num_recv_rows, 1.0f), per_entry(S * K);
        // Rank 1 passes step 2's plan where the others pass step 1's, to each op in turn.
        const Plan& mine = rank == 1 ? step2 : step1;
        auto record = [&](int slot, auto&& fn) {
            try {
                fn();
            } catch (const Error& e) {
                messages[rank * 3 + slot] = e.message();
                categories[rank * 3 + slot] = int(e.category());
            }
        };
        record(0, [&] { buffer.dispatch(mine, x.data(), nullptr, recv.data(), nullptr); });
        record(1, [&] { buffer.combine(mine, recv.data(), nullptr, out.data()); });
        record(2, [&] { buffer.entry_values(mine, values.data(), per_entry.data()); });
        // Every rank skipped the same barriers: the buffer still works with plans of one step.
        buffer.dispatch(step2, x.data(), nullptr, recv.data(), nullptr);
        buffer.combine(step2, recv.data(), nullptr, out.data());
        outputs[rank] = out;
    });
    ASSERT_EQ(failures(errors), "");
    const char* ops[] = {"dispatch", "combine", "entry_values"};
    for (int rank = 0; rank < R; ++rank) {
        for (int slot = 0; slot < 3; ++slot) {
            EXPECT_EQ(categories[rank * 3 + slot], int(ErrorCategory::kMismatch))
                << "rank " << rank << " " << ops[slot];
            const std::string want = rank == 1
                                         ? std::string(ops[slot]) +
                                               ": rank 1 passed the plan of step 2 but rank 0 the plan of step 1; "
                                               "every rank must pass its plan of the same step"
                                         : std::string(ops[slot]) + ": rank " + std::to_string(rank) +
                                               " passed the plan of step 1 but rank 1 the plan of step 2; "
                                               "every rank must pass its plan of the same step";
            EXPECT_EQ(messages[rank * 3 + slot], want) << "rank " << rank;
        }
        // Each token's K = 2 rows are the same bf16 1.0 row: the combine after the failures sums them to 2.0.
        for (uint16_t v : outputs[rank]) ASSERT_EQ(v, 0x4000) << "rank " << rank;
    }
}

}  // namespace
}  // namespace flatep
