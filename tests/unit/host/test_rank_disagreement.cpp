// Ranks that disagree fail loudly on every rank and never compute (design §8): every cross-rank barrier carries the
// op and the step (plan generation) it belongs to. Ranks in different ops, or passing plans of different steps, all
// throw kMismatch naming both sides; a rank that times out makes its peers fail too (its abort word); and after any
// such failure the Buffer / ExpertPools is poisoned on every rank: every later call throws, also a retry.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::failures;
using testing::Outcome;
using testing::outcome_of;
using testing::run_ranks;

constexpr int kR = 3, kE = 6, kS = 4, kK = 2, kH = 8;

Config config_of(int rank) {
    Config c;
    c.num_ranks = kR, c.rank = rank, c.num_experts = kE, c.num_tokens = kS, c.topk = kK, c.hidden = kH, c.align = 1;
    return c;
}

const int32_t kIdx[kS * kK] = {0, 1, 2, 3, 4, 5, 1, 2};

// One rank's data-plane state for one Buffer.
struct Step {
    explicit Step(Buffer& b)
        : x(kS * kH, 0x3f80),
          recv(size_t(b.num_recv_rows()) * kH),
          out(kS * kH),
          values(b.num_recv_rows(), 1.0f),
          per_entry(kS * kK) {}
    std::vector<uint16_t> x, recv, out;
    std::vector<float> values, per_entry;
};

const char* const kUnusable = " is unusable after an earlier cross-rank failure (";

std::string mismatch_text(const std::string& op, int rank, const std::string& my_op, int my_step, int peer,
                          const std::string& peer_op, int peer_step) {
    return op + ": rank " + std::to_string(rank) + " is in " + my_op + " of step " + std::to_string(my_step) +
           " but rank " + std::to_string(peer) + " in " + peer_op + " of step " + std::to_string(peer_step) +
           "; every rank must call the same ops in the same order, with plans of the same step";
}

// Rank 1 passes step 2's plan where the others pass step 1's: every rank throws kMismatch naming the other step,
// then the Buffer is poisoned (a later op of the right step throws kRuntime), and a rebuilt Buffer computes.
TEST(RankDisagreement, PlansOfDifferentStepsFailOnEveryRankAndPoisonTheBuffer) {
    const char* ops[] = {"dispatch", "combine", "entry_values"};
    for (int which = 0; which < 3; ++which) {
        LocalHostWorld world(kR, 10.0);
        std::vector<Outcome> first(kR), later(kR);
        std::vector<std::vector<uint16_t>> rebuilt(kR);
        const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
            {
                Buffer buffer(config_of(rank), world.transport(rank));
                const Plan step1 = buffer.plan(kIdx, 4, kS);
                const Plan step2 = buffer.plan(kIdx, 4, kS);
                Step st(buffer);
                const Plan& mine = rank == 1 ? step2 : step1;
                auto op = [&](const Plan& p) {
                    if (which == 0) buffer.dispatch(p, st.x.data(), nullptr, st.recv.data(), nullptr);
                    if (which == 1) buffer.combine(p, st.recv.data(), nullptr, st.out.data());
                    if (which == 2) buffer.entry_values(p, st.values.data(), st.per_entry.data());
                };
                first[rank] = outcome_of([&] { op(mine); });
                later[rank] = outcome_of([&] { op(step2); });  // the "retry": every rank the same step now
                EXPECT_TRUE(buffer.poisoned()) << "rank " << rank;
            }
            Buffer buffer(config_of(rank), world.transport(rank));  // rebuilt on every rank: works again
            const Plan plan = buffer.plan(kIdx, 4, kS);
            Step st(buffer);
            buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr);
            buffer.combine(plan, st.recv.data(), nullptr, st.out.data());
            rebuilt[rank] = st.out;
        });
        ASSERT_EQ(failures(errors), "") << ops[which];
        const std::string op = ops[which];
        for (int rank = 0; rank < kR; ++rank) {
            EXPECT_EQ(first[rank].category, int(ErrorCategory::kMismatch)) << op << " rank " << rank;
            const std::string want =
                rank == 1 ? mismatch_text(op, 1, op, 2, 0, op, 1) : mismatch_text(op, rank, op, 1, 1, op, 2);
            EXPECT_EQ(first[rank].message, want) << op << " rank " << rank;
            EXPECT_EQ(later[rank].category, int(ErrorCategory::kRuntime)) << op << " rank " << rank;
            EXPECT_EQ(later[rank].message, op + ": this Buffer" + kUnusable + first[rank].message +
                                               "); destroy it and build a new one on every rank")
                << op << " rank " << rank;
            // Each token's K = 2 rows are the same bf16 1.0 row: the rebuilt Buffer's combine sums them to 2.0.
            for (uint16_t v : rebuilt[rank]) ASSERT_EQ(v, 0x4000) << op << " rank " << rank;
        }
    }
}

// Ranks calling different ops on one Buffer (same step): every rank throws kMismatch naming both ops, none returns
// an output. Pairs with different numbers of barriers (plan against dispatch) included.
TEST(RankDisagreement, DifferentOpsFailOnEveryRank) {
    struct Pair {
        const char* even;  // ranks 0 and 2
        const char* odd;   // rank 1
    };
    // Rank 1 plan-ordered (no entry barrier) where the others are not: the barrier a plan-ordered op keeps carries its
    // own tag, so rank 1 never takes the others' entry barrier for its exit barrier and reads rows yet to land.
    const Pair pairs[] = {{"dispatch", "combine"},
                          {"combine", "entry_values"},
                          {"plan", "dispatch"},
                          {"dispatch", "dispatch (plan_ordered)"},
                          {"combine", "combine (plan_ordered)"}};
    for (const Pair& pair : pairs) {
        LocalHostWorld world(kR, 10.0);
        std::vector<Outcome> got(kR);
        const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
            Buffer buffer(config_of(rank), world.transport(rank));
            const Plan plan = buffer.plan(kIdx, 4, kS);
            Step st(buffer);
            buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr);  // a good step first
            const std::string op = rank == 1 ? pair.odd : pair.even;
            got[rank] = outcome_of([&] {
                if (op == "plan") buffer.plan(kIdx, 4, kS);
                if (op == "dispatch") buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr);
                if (op == "combine") buffer.combine(plan, st.recv.data(), nullptr, st.out.data());
                if (op == "entry_values") buffer.entry_values(plan, st.values.data(), st.per_entry.data());
                if (op == "dispatch (plan_ordered)")
                    buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr,
                                    {.options = {.plan_ordered = true}});
                if (op == "combine (plan_ordered)")
                    buffer.combine(plan, st.recv.data(), nullptr, st.out.data(), {.options = {.plan_ordered = true}});
            });
        });
        ASSERT_EQ(failures(errors), "");
        for (int rank = 0; rank < kR; ++rank) {
            const std::string mine = rank == 1 ? pair.odd : pair.even;
            const std::string theirs = rank == 1 ? pair.even : pair.odd;
            const int peer = rank == 1 ? 0 : 1;
            // plan() is the step after the plan it follows: its barriers carry generation 2, the others' 1.
            const int my_step = mine == "plan" ? 2 : 1, their_step = theirs == "plan" ? 2 : 1;
            EXPECT_EQ(got[rank].category, int(ErrorCategory::kMismatch)) << mine << " rank " << rank;
            EXPECT_EQ(got[rank].message, mismatch_text(mine, rank, mine, my_step, peer, theirs, their_step))
                << "rank " << rank;
        }
    }
}

// A rank late by more than the timeout: the punctual ranks time out, and the late one, arriving after that, must
// not compute with stale flags: it fails at once (its peers gave up), and a retry on every rank fails too.
TEST(RankDisagreement, RetryAfterATimeoutNeverComputes) {
    const double kTimeout = 0.5;
    LocalHostWorld world(kR, kTimeout);
    std::vector<Outcome> first(kR), retry(kR);
    std::vector<double> late_seconds(kR, 0);
    const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
        Buffer buffer(config_of(rank), world.transport(rank));
        const Plan plan = buffer.plan(kIdx, 4, kS);
        Step st(buffer);
        if (rank == 2) std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout + 0.4));
        const auto t0 = std::chrono::steady_clock::now();
        first[rank] = outcome_of([&] { buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr); });
        late_seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        retry[rank] = outcome_of([&] { buffer.dispatch(plan, st.x.data(), nullptr, st.recv.data(), nullptr); });
    });
    ASSERT_EQ(failures(errors), "");
    for (int rank = 0; rank < 2; ++rank) {
        EXPECT_EQ(first[rank].category, int(ErrorCategory::kTimeout)) << "rank " << rank;
        EXPECT_EQ(first[rank].message.rfind("timeout in dispatch: rank " + std::to_string(rank) +
                                                " waited 0.5 s for "
                                                "peer 2 (flag ",
                                            0),
                  0u)
            << first[rank].message;
        EXPECT_LT(late_seconds[rank], kTimeout + 1.0) << "rank " << rank;  // the wait is bounded by the timeout
    }
    EXPECT_EQ(first[2].category, int(ErrorCategory::kRuntime)) << first[2].message;
    EXPECT_EQ(first[2].message.rfind("dispatch: rank 2 gives up: peer ", 0), 0u) << first[2].message;
    EXPECT_LT(late_seconds[2], 0.2);  // at once: no second timeout
    for (int rank = 0; rank < kR; ++rank) {
        EXPECT_EQ(retry[rank].category, int(ErrorCategory::kRuntime)) << "rank " << rank;
        EXPECT_NE(retry[rank].message.find(std::string("dispatch: this Buffer") + kUnusable), std::string::npos)
            << retry[rank].message;
    }
}

// The pools' collectives carry op and step too: prefetch against reduce_grad, and prefetch with plans of different
// steps (the CPU backend used to return from both without an error, leaving slots of the wrong expert).
TEST(RankDisagreement, PoolsOpsAndStepsMustAgree) {
    const int epn = kE / kR;
    for (int variant = 0; variant < 2; ++variant) {
        LocalHostWorld world(kR, 10.0);
        std::vector<Outcome> got(kR), later(kR);
        const std::vector<std::string> errors = run_ranks(kR, [&](int rank) {
            Buffer buffer(config_of(rank), world.transport(rank));
            ExpertPools pools(world.transport(rank), epn, {{2, 4}});
            ExpertLayer layer = pools.register_layer();
            const Plan step1 = buffer.plan(kIdx, 4, kS);
            const Plan step2 = buffer.plan(kIdx, 4, kS);
            got[rank] = outcome_of([&] {
                if (variant == 0) {
                    if (rank == 1) {
                        pools.reduce_grad(step2, layer);
                    } else {
                        pools.prefetch(step2, layer);
                    }
                } else {
                    pools.prefetch(rank == 1 ? step1 : step2, layer);
                }
            });
            later[rank] = outcome_of([&] { pools.prefetch(step2, layer); });
            EXPECT_TRUE(pools.poisoned()) << "rank " << rank;
        });
        ASSERT_EQ(failures(errors), "");
        for (int rank = 0; rank < kR; ++rank) {
            const int peer = rank == 1 ? 0 : 1;
            std::string want;
            if (variant == 0) {
                want = rank == 1 ? mismatch_text("reduce_grad", 1, "reduce_grad", 2, 0, "prefetch", 2)
                                 : mismatch_text("prefetch", rank, "prefetch", 2, peer, "reduce_grad", 2);
            } else {
                want = rank == 1 ? mismatch_text("prefetch", 1, "prefetch", 1, 0, "prefetch", 2)
                                 : mismatch_text("prefetch", rank, "prefetch", 2, peer, "prefetch", 1);
            }
            EXPECT_EQ(got[rank].category, int(ErrorCategory::kMismatch)) << "variant " << variant << " rank " << rank;
            EXPECT_EQ(got[rank].message, want) << "variant " << variant << " rank " << rank;
            EXPECT_EQ(later[rank].category, int(ErrorCategory::kRuntime));
            EXPECT_NE(later[rank].message.find(std::string("prefetch: this ExpertPools") + kUnusable),
                      std::string::npos)
                << later[rank].message;
        }
    }
}

// Ranks calling different Buffers (same transport): both time out, and each names what the other is doing there.
TEST(RankDisagreement, DifferentBuffersNameWhatThePeerIsDoing) {
    const int R = 2;
    const double kTimeout = 0.5;
    LocalHostWorld world(R, kTimeout);
    std::vector<Outcome> got(R);
    std::vector<double> seconds(R);
    const std::vector<std::string> errors = run_ranks(R, [&](int rank) {
        Config c = config_of(rank);
        c.num_ranks = R, c.num_experts = 4;
        Buffer a(c, world.transport(rank));
        Buffer b(c, world.transport(rank));
        const int32_t idx[kS * kK] = {0, 1, 2, 3, 0, 2, 1, 3};
        const auto t0 = std::chrono::steady_clock::now();
        got[rank] = outcome_of([&] { (rank == 0 ? a : b).plan(idx, 4, kS); });
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    ASSERT_EQ(failures(errors), "");
    for (int rank = 0; rank < R; ++rank) {
        EXPECT_EQ(got[rank].category, int(ErrorCategory::kTimeout)) << got[rank].message;
        const std::string want = "; peer " + std::to_string(1 - rank) +
                                 " was in plan of another Buffer on this transport (step 1 mod 2^16): every rank must "
                                 "call the same objects in the same order";
        EXPECT_EQ(got[rank].message.rfind("timeout in plan: rank " + std::to_string(rank) + " waited 0.5 s for peer " +
                                              std::to_string(1 - rank),
                                          0),
                  0u)
            << got[rank].message;
        EXPECT_NE(got[rank].message.find(want), std::string::npos) << got[rank].message;
        EXPECT_LT(seconds[rank], kTimeout + 1.0);
    }
}

}  // namespace
}  // namespace flatep
