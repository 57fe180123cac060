// select_candidate's rule on one warp (the GPU planner's select_derive_kernel): the same index as
// select_candidate for the same qualities.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "planner/candidates.hpp"
#include "planner/quality.hpp"
#include "planner/warp_exec.cuh"

namespace flatep::planner {

// select_candidate's rule evaluated by one warp (every lane returns the same index). select_candidate keeps, in
// index order, every acceptable candidate strictly better than the best so far; so it returns the first index of
// the best acceptable quality among the candidates it scans when that quality beats the greedy's, else -1. It scans
// the path candidates, then the candidates of the lowest budget in [1, best path (or greedy) makespan] that has an
// acceptable one (it stops after that budget). This function finds that budget with a warp minimum and the best
// candidate in it with a warp reduction under a total order (quality, then index), so the result is the same.
// Setting kWarpSelect to false restores select_candidate on one thread.
constexpr bool kWarpSelect = true;
// Its first two phases: the path candidates (every lane scans them as select_candidate does: *best and *kept, -1 when
// none beats the greedy), then the lowest budget in [1, best->makespan] with an acceptable candidate among [0, count),
// kNoBudget when none (every lane gets the same values).
constexpr int kNoBudget = 0x7fffffff;
FLATEP_DEVICE int lowest_acceptable_budget(const PlanQuality& greedy, const PlanQuality* quality, int count, int lane,
                                           PlanQuality* best, int* kept) {
    *best = greedy;
    *kept = -1;
    for (int i = 0; i < kNumPathVariants && i < count; ++i) {
        if (!acceptable(greedy, quality[i]) || !better_than(quality[i], *best)) continue;
        *best = quality[i];
        *kept = i;
    }
    int budget = kNoBudget;
    for (int i = kNumPathVariants + lane; i < count; i += 32) {
        const int b = (i - kNumPathVariants) / kVariantsPerBudget + 1;
        if (b <= best->makespan && b < budget && acceptable(greedy, quality[i])) budget = b;
    }
    return int(__reduce_min_sync(kFull, unsigned(budget)));
}

// The candidates select_candidate reads, when those of [0, built) are known (built: whole budgets, or every
// candidate): the path candidates and every budget up to the lowest one with an acceptable candidate, or, when none
// of the known ones has one, every budget up to the best path (or greedy) makespan. At most count. One warp.
FLATEP_DEVICE int candidates_read(const PlanQuality& greedy, const PlanQuality* quality, int built, int count,
                                  int lane) {
    PlanQuality best{};
    int kept = -1;
    const int budget = lowest_acceptable_budget(greedy, quality, min_of(built, count), lane, &best, &kept);
    return min_of(count, num_candidates(budget != kNoBudget ? budget : best.makespan));
}

// trace (profile, null = off): clock64 after each of its four phases (lane 0; the first two together).
FLATEP_DEVICE int select_candidate_warp(const PlanQuality& greedy, const PlanQuality* quality, int count, int lane,
                                        long long* trace = nullptr) {
    auto mark = [&](int at) {
        if (trace != nullptr && lane == 0) trace[at] = clock64();
    };
    PlanQuality best{};
    int kept = -1;
    const int budget = lowest_acceptable_budget(greedy, quality, count, lane, &best, &kept);
    mark(0);
    mark(1);
    if (budget == kNoBudget) return kept;
    // Its best candidate strictly better than `best`: per lane in index order (strict improvement keeps the first),
    // then a butterfly under the total order (found first, quality, lower index).
    const int lo = kNumPathVariants + (budget - 1) * kVariantsPerBudget;
    const int hi = min_of(lo + kVariantsPerBudget, count);
    PlanQuality mine = best;
    int at = -1;
    for (int i = lo + lane; i < hi; i += 32) {
        const PlanQuality q = quality[i];
        if (acceptable(greedy, q) && better_than(q, mine)) {
            mine = q;
            at = i;
        }
    }
    mark(2);
    for (int o = 16; o > 0; o >>= 1) {
        PlanQuality other;
        other.makespan = __shfl_xor_sync(kFull, mine.makespan, o);
        other.total_replicas = __shfl_xor_sync(kFull, mine.total_replicas, o);
        other.entries_moved = __shfl_xor_sync(kFull, (long long)mine.entries_moved, o);
        const int other_at = __shfl_xor_sync(kFull, at, o);
        const bool take =
            other_at >= 0 && (at < 0 || better_than(other, mine) || (!better_than(mine, other) && other_at < at));
        if (take) {
            mine = other;
            at = other_at;
        }
    }
    mark(3);
    return at >= 0 ? at : kept;
}

// select_candidate_warp with each quality as one 64-bit key, (P, total replicas, entries moved) in bits 56+, 40+ and
// 0-39, so better_than(a, b) is key(a) < key(b): valid when the greedy's P < 256 and total replicas < 2^16 (an
// acceptable candidate is at most that on both; entries moved <= N < 2^37 always). Every selection is then one warp
// minimum of (key, index): the path candidates one per lane, the lowest acceptable budget, that budget's candidates
// one per lane (kVariantsPerBudget <= 32). The same index as select_candidate_warp.
static_assert(kVariantsPerBudget <= 32 && kNumPathVariants <= 32, "one per lane");
FLATEP_DEVICE bool quality_keys_fit(const PlanQuality& greedy) {
    return greedy.makespan >= 0 && greedy.makespan < 256 && greedy.total_replicas >= 0 && greedy.total_replicas < 65536;
}
FLATEP_DEVICE uint64_t quality_key(const PlanQuality& q) {
    return (uint64_t(q.makespan) << 56) | (uint64_t(q.total_replicas) << 40) | uint64_t(q.entries_moved);
}
// The lowest lane holding the smallest key among the lanes with `has` (-1 when none); *best = that key.
FLATEP_DEVICE int warp_min_key(bool has, uint64_t key, uint64_t* best) {
    const unsigned hi = __reduce_min_sync(kFull, has ? unsigned(key >> 32) : 0xffffffffu);
    const unsigned lo = __reduce_min_sync(kFull, has && unsigned(key >> 32) == hi ? unsigned(key) : 0xffffffffu);
    const uint64_t k = (uint64_t(hi) << 32) | lo;
    const unsigned at = __ballot_sync(kFull, has && key == k);
    if (at == 0) return -1;
    *best = k;
    return __ffs(at) - 1;
}
FLATEP_DEVICE int select_candidate_keys(const PlanQuality& greedy, const PlanQuality* quality, int count, int lane) {
    constexpr int kPath = kNumPathVariants, kPerBudget = kVariantsPerBudget;
    uint64_t best = quality_key(greedy);
    int best_p = greedy.makespan;
    PlanQuality q{};
    if (lane < kPath && lane < count) q = quality[lane];
    const uint64_t path_key = quality_key(q);
    const int kept =
        warp_min_key(lane < kPath && lane < count && acceptable(greedy, q) && path_key < best, path_key, &best);
    if (kept >= 0) best_p = int(best >> 56);
    constexpr int kNone = 0x7fffffff;
    int budget = kNone;
    for (int i = kPath + lane; i < count; i += 32) {
        const int b = (i - kPath) / kPerBudget + 1;
        if (b <= best_p && b < budget && acceptable(greedy, quality[i])) budget = b;
    }
    budget = int(__reduce_min_sync(kFull, unsigned(budget)));
    if (budget == kNone) return kept;
    const int i = kPath + (budget - 1) * kPerBudget + lane;
    const bool mine = lane < kPerBudget && i < count;
    if (mine) q = quality[i];
    const uint64_t key = quality_key(q);
    const int at = warp_min_key(mine && acceptable(greedy, q) && key < best, key, &best);
    return at >= 0 ? i - lane + at : kept;
}

}  // namespace flatep::planner
