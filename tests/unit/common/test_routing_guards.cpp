// The synthetic routing generator (src/routing) at its edges: the arguments it refuses (one kInvalidArgument line
// naming the value), ids outside [0, E) that the histogram skips, ties between experts (broken by expert id), an
// empty step (maxvio 0, and a target the bisection cannot reach), weights that underflow to zero (the remainder is
// spread one row at a time), and the direction of popularity (a more popular expert keeps every token it had).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flatep/error.hpp"
#include "routing/routing.hpp"

namespace flatep::routing {
namespace {

struct Refusal {
    std::string message;
    ErrorCategory category = ErrorCategory::kRuntime;
};

Refusal refusal_of(const std::function<void()>& call) {
    try {
        call();
    } catch (const Error& e) {
        return {e.message(), e.category()};
    }
    return {"(no error)", ErrorCategory::kRuntime};
}

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(RoutingGuards, RefusesBadExpertCountsSigmasTopkTokenCountsAndTargets) {
    const std::vector<double> four(4, 1.0);
    int32_t idx[8] = {};
    const std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"num_experts must be positive, got 0", [] { popularity(0, 1.0, 1); }},
        {"num_experts must be positive, got -2", [] { popularity(-2, 1.0, 1); }},
        {"sigma must be finite and >= 0, got -1", [] { popularity(4, -1.0, 1); }},
        {"sigma must be finite and >= 0, got nan", [] { popularity(4, kNan, 1); }},
        {"sigma must be finite and >= 0, got inf", [] { popularity(4, kInf, 1); }},
        {"topk must be in [1, num_experts=4], got 0", [&] { sample_topk(four, 1, 0, 1, 0, idx); }},
        {"topk must be in [1, num_experts=4], got 5", [&] { sample_topk(four, 1, 5, 1, 0, idx); }},
        {"num_tokens must be >= 0, got -1", [&] { sample_topk(four, -1, 2, 1, 0, idx); }},
        {"target maxvio must be finite, got nan", [] { sigma_for_maxvio(kNan, 2, 4, 8, 1, 1); }},
        {"target maxvio must be finite, got inf", [] { sigma_for_maxvio(kInf, 2, 4, 8, 1, 1); }},
        {"target maxvio must be finite, got -inf", [] { sigma_for_maxvio(-kInf, 2, 4, 8, 1, 1); }},
    };
    for (const auto& [want, call] : rows) {
        const Refusal r = refusal_of(call);
        EXPECT_EQ(r.message, want);
        EXPECT_EQ(r.category, ErrorCategory::kInvalidArgument) << want;
    }
    // Zero tokens are a valid (empty) step that writes nothing; sigma 0 is uniform popularity.
    EXPECT_EQ(generate_counts(2, 4, 0, 1, 0.0, 1), std::vector<int32_t>(8, 0));
    sample_topk(four, 0, 4, 1, 0, idx);
    EXPECT_EQ(idx[0], 0);
    EXPECT_EQ(popularity(3, 0.0, 9), std::vector<double>(3, 1.0));
}

TEST(RoutingGuards, EqualKeysAreBrokenByExpertId) {
    // Infinite popularity makes every key -log(u) / inf = 0: all experts tie, so each token takes the lowest ids.
    const std::vector<double> tied(5, kInf);
    std::vector<int32_t> idx(3 * 3, -1);
    sample_topk(tied, 3, 3, 11, 0, idx.data());
    EXPECT_EQ(idx, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
}

TEST(RoutingGuards, HistogramSkipsIdsOutsideTheExpertsAndAnEmptyStepHasNoImbalance) {
    const int32_t idx[7] = {-1, 0, 4, 3, 1 << 30, 3, std::numeric_limits<int32_t>::min()};
    EXPECT_EQ(histogram(idx, 7, 4), (std::vector<int32_t>{1, 0, 0, 2}));
    const std::vector<int32_t> none(2 * 4, 0);
    EXPECT_EQ(maxvio(none.data(), 2, 4), 0.0);
    const std::vector<int32_t> one = {0, 3, 0, 1};  // 1 rank: expert 1 holds 3 of 4 entries: 3 * 4 / 4 - 1
    EXPECT_EQ(maxvio(one.data(), 1, 4), 2.0);
}

TEST(RoutingGuards, ATargetNoSigmaReachesStopsTheSearchAtSigma64) {
    // No tokens: every sigma realises maxvio 0, so the upper bound doubles to its cap and the bisection keeps it.
    EXPECT_EQ(sigma_for_maxvio(0.5, 1, 4, 0, 1, 7), 64.0);
    EXPECT_EQ(sigma_for_maxvio(-1.0, 1, 4, 0, 1, 7), 0.0);  // no imbalance asked: uniform
}

TEST(RoutingGuards, SpreadCountsHandsOutOneRowAtATimeWhenEveryWeightUnderflows) {
    // sigma 1e4: an expert whose popularity draw is negative gets exp(-1e4 * |n|) = 0 exactly. Find a seed where both
    // of two experts do; then no expert has weight, and the rows are spread one per expert per round.
    const double sigma = 1e4;
    uint64_t seed = 0;
    bool found = false;
    for (uint64_t s = 0; s < 64 && !found; ++s) {
        const std::vector<double> pop = popularity(2, sigma, s);
        if (pop[0] == 0.0 && pop[1] == 0.0) seed = s, found = true;
    }
    ASSERT_TRUE(found) << "no seed in [0, 64) gives two zero weights";
    // 3 rows (S = 3, K = 1) over 2 experts: round 1 gives one each, round 2 one to expert 0 and stops.
    EXPECT_EQ(spread_counts(1, 2, 3, 1, sigma, seed), (std::vector<int32_t>{2, 1}));
    // A row is capped at S: with K = 2 of 2 experts every expert gets all S tokens.
    EXPECT_EQ(spread_counts(2, 2, 3, 2, sigma, seed), (std::vector<int32_t>{3, 3, 3, 3}));
}

TEST(RoutingGuards, AMorePopularExpertKeepsEveryTokenThatChoseItAndGainsSome) {
    // sample_topk races keys -log(u) / popularity[e], u fixed by (seed, rank, token, expert) whatever the popularity:
    // raising one expert's popularity shrinks only its own key, so every token that chose it still does; over 512
    // tokens (E = 6, K = 2) some token that did not choose it now does.
    const int E = 6, K = 2, S = 512;
    int lost = 0, not_gained = 0;
    for (uint64_t seed = 1; seed <= 4; ++seed) {
        const std::vector<double> pop = popularity(E, 1.0, seed);
        std::vector<int32_t> before(size_t(S) * K), after(size_t(S) * K);
        sample_topk(pop, S, K, seed, 1, before.data());
        for (int e = 0; e < E; ++e) {
            std::vector<double> hotter = pop;
            hotter[size_t(e)] *= 4.0;
            sample_topk(hotter, S, K, seed, 1, after.data());
            int had = 0, has = 0;
            for (int t = 0; t < S; ++t) {
                const auto chose = [&](const std::vector<int32_t>& idx) {
                    return std::count(idx.begin() + int64_t(t) * K, idx.begin() + int64_t(t + 1) * K, e) > 0;
                };
                had += chose(before);
                has += chose(after);
                lost += chose(before) && !chose(after);
            }
            not_gained += has <= had;
        }
    }
    EXPECT_EQ(lost, 0) << "tokens that dropped an expert when it became more popular";
    EXPECT_EQ(not_gained, 0) << "experts that gained no token when they became more popular";
}

}  // namespace
}  // namespace flatep::routing
