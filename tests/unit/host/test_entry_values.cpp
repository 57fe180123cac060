// entry_values on the CPU backend: every entry gets the value of its own row on its own destination rank, checked
// as a round trip through dispatch (independent of the plan's row arithmetic) and against the plan's (rank, row);
// and expert ids at the boundary: -1 and E are invalid (skipped, reported with their index), E-1 is valid.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::bits_of;
using testing::error_message;
using testing::failures;
using testing::run_ranks;

constexpr int kH = 8;

Config config(int R, int rank, int E, int S, int K, int align) {
    return Config{
        .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = kH, .align = align};
}

TEST(EntryValues, EachEntryReadsItsRowOnItsDestinationRank) {
    // R = 3, E = 6, S = 6, K = 2, exact, align 4: every token routes to expert 0 (rank 0) and one more, so rank 0 is
    // overloaded and replicas of its experts sit on the other ranks; rank 1 has an id of -1, rank 2 one of E and only
    // s = 4 tokens. Routing weights are distinct integers (exact in fp32): dispatch carries each to its entry's row,
    // and entry_values(recv_w) must give every valid entry its own weight back, an invalid one +0.
    const int R = 3, E = 6, S = 6, K = 2;
    LocalHostWorld world(R, 10.0);
    std::vector<std::string> mismatch(R);
    std::vector<int> remote(R, 0), replicas(R, 0);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Buffer buffer(config(R, rank, E, S, K, 4), world.transport(rank));
        const int s = rank == 2 ? 4 : S;
        std::vector<int32_t> idx(size_t(s) * K);
        std::vector<float> w(idx.size());
        for (int t = 0; t < s; ++t) {
            idx[t * K] = 0;
            idx[t * K + 1] = 1 + (t + rank) % (E - 1);
        }
        if (rank == 1) idx[1] = -1;
        if (rank == 2) idx[2] = E;
        for (size_t i = 0; i < idx.size(); ++i) w[i] = float(1000 * rank + int(i) + 1);
        const Plan plan = buffer.plan(idx.data(), 4, s);
        const int nvs = buffer.num_recv_rows();
        std::vector<uint16_t> x(size_t(s) * kH, float_to_bf16(1.0f)), recv_x(size_t(nvs) * kH);
        std::vector<float> recv_w(nvs, -3.0f), back(idx.size(), -5.0f), by_place(idx.size(), -5.0f);
        buffer.dispatch(plan, x.data(), w.data(), recv_x.data(), recv_w.data());
        buffer.entry_values(plan, recv_w.data(), back.data());
        // Second pass: row value = 100000 * rank + row, so every entry sees where it was read from.
        std::vector<float> row_values(nvs);
        for (int r = 0; r < nvs; ++r) row_values[r] = float(100000 * rank + r);
        buffer.entry_values(plan, row_values.data(), by_place.data());
        std::string& bad = mismatch[rank];
        for (size_t i = 0; i < idx.size() && bad.empty(); ++i) {
            const bool valid = idx[i] >= 0 && idx[i] < E;
            const int d = plan.entry_ranks()[i], row = plan.entry_rows()[i];
            const float want_back = valid ? w[i] : 0.0f;
            const float want_place = valid ? float(100000 * d + row) : 0.0f;
            if (bits_of(back[i]) != bits_of(want_back) || bits_of(by_place[i]) != bits_of(want_place)) {
                bad = "entry " + std::to_string(i) + " (destination " + std::to_string(d) + ", row " +
                      std::to_string(row) + "): got " + std::to_string(back[i]) + " / " + std::to_string(by_place[i]) +
                      ", expected " + std::to_string(want_back) + " / " + std::to_string(want_place);
            }
            if (valid && d != rank) ++remote[rank];
        }
        for (int32_t e : plan.slot_expert(rank)) replicas[rank] += e >= 0;
        (void)error_message([&] { buffer.check_status(); });  // clear the recorded bad id
    });
    ASSERT_EQ(failures(errors), "");
    for (int r = 0; r < R; ++r) {
        EXPECT_EQ(mismatch[r], "") << "rank " << r;
        EXPECT_GT(remote[r], 0) << "rank " << r << " has no entry on another rank";
    }
    EXPECT_GT(replicas[1] + replicas[2], 0);
}

TEST(ExpertIdBoundary, MinusOneAndEAreInvalidEMinusOneIsValid) {
    // R = 2, E = 4, S = 4, K = 2, both index widths. Rank 1 routes [3,-1] [4,0] [1,2] [0,3]: the first bad id is -1 at
    // flat index 1, then E = 4 at index 2; E-1 = 3 is a valid id. The same rows with -1 replaced by 2 report E.
    // An unweighted combine of the dispatched rows (x = 1) gives each token the count of its valid entries.
    const int R = 2, E = 4, S = 4, K = 2;
    for (const int index_bytes : {4, 8}) {
        SCOPED_TRACE("index_bytes " + std::to_string(index_bytes));
        LocalHostWorld world(R, 10.0);
        std::vector<std::string> first(R), second(R);
        std::vector<std::vector<uint16_t>> outs(R);
        const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
            Buffer buffer(config(R, rank, E, S, K, 1), world.transport(rank));
            const std::vector<int64_t> mine = rank == 1 ? std::vector<int64_t>{3, -1, 4, 0, 1, 2, 0, 3}
                                                        : std::vector<int64_t>{0, 1, 2, 3, 3, 2, 1, 0};
            auto plan_of = [&](std::vector<int64_t> ids) {
                const std::vector<int32_t> ids32(ids.begin(), ids.end());
                return index_bytes == 4 ? buffer.plan(ids32.data(), 4, S) : buffer.plan(ids.data(), 8, S);
            };
            const Plan plan = plan_of(mine);
            const int nvs = buffer.num_recv_rows();
            std::vector<uint16_t> x(S * kH, float_to_bf16(1.0f)), recv(size_t(nvs) * kH);
            outs[rank].assign(S * kH, 0xffff);
            buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr);
            buffer.combine(plan, recv.data(), nullptr, outs[rank].data());
            first[rank] = error_message([&] { buffer.check_status(); });
            std::vector<int64_t> only_e = mine;
            if (rank == 1) only_e[1] = 2;
            (void)plan_of(only_e);
            second[rank] = error_message([&] { buffer.check_status(); });
        });
        ASSERT_EQ(failures(errors), "");
        EXPECT_EQ(first[0], "(no error)");
        EXPECT_EQ(first[1],
                  "rank 1: invalid expert id -1 at topk_idx flat index 1 (token 0, k 1); ids must be in [0, E=4); the "
                  "entry was skipped");
        EXPECT_EQ(second[1],
                  "rank 1: invalid expert id 4 at topk_idx flat index 2 (token 1, k 0); ids must be in [0, E=4); the "
                  "entry was skipped");
        const int valid[2][S] = {{2, 2, 2, 2}, {1, 1, 2, 2}};
        for (int r = 0; r < R; ++r) {
            for (int t = 0; t < S; ++t) {
                EXPECT_EQ(outs[r][t * kH], float_to_bf16(float(valid[r][t]))) << "rank " << r << " token " << t;
            }
        }
    }
}

}  // namespace
}  // namespace flatep
