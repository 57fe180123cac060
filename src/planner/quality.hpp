// Quality of an allocation (design §4's objectives 1-3) and its evaluation, on any executor.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "layout/layout.hpp"
#include "planner/executor.hpp"

namespace flatep::planner {

// Quality of an allocation: objectives 1-3 of design §4, compared lexicographically.
struct PlanQuality {
    int32_t makespan;        // P
    int32_t total_replicas;  // sum of replicas
    int64_t entries_moved;   // entries computed off their source rank (split rule of plan.hpp)
};

FLATEP_HD bool better_than(const PlanQuality& a, const PlanQuality& b) {
    if (a.makespan != b.makespan) return a.makespan < b.makespan;
    if (a.total_replicas != b.total_replicas) return a.total_replicas < b.total_replicas;
    return a.entries_moved < b.entries_moved;
}

// Expert e's share of the evaluation: its entries computed off their source rank (returned); its replicas added to
// num_in (per host) and num_out (its home) through x.add.
template <class X>
FLATEP_HD int64_t evaluate_expert(const X& x, const Layout& l, const int32_t* tpe_all, const int32_t* alloc,
                                  int32_t* num_in, int32_t* num_out, int e) {
    const int R = l.num_ranks, E = l.num_experts;
    const int h = l.home_rank(e);
    int32_t copies = 0;
    int64_t off = 0;
    for (int d = 0; d < R; ++d) {
        const int32_t a = alloc[d * E + e];
        const int32_t t = tpe_all[d * E + e];
        off += t - (t < a ? t : a);
        if (a > 0 && d != h) {
            x.add(&num_in[d], 1);
            ++copies;
        }
    }
    if (copies != 0) x.add(&num_out[h], copies);
    return off;
}

// The quality from every rank's replicas hosted and sent (num_in / num_out [R]) and the entries moved.
FLATEP_HD PlanQuality quality_of(const Layout& l, const int32_t* num_in, const int32_t* num_out, int64_t moved) {
    PlanQuality q{0, 0, moved};
    for (int r = 0; r < l.num_ranks; ++r) {
        q.total_replicas += num_in[r];
        q.makespan = max_of(q.makespan, max_of(num_in[r], num_out[r]));
    }
    return q;
}

// Uses num_in / num_out [R] as scratch (the replicas each rank hosts and sends).
template <class X>
FLATEP_HD PlanQuality evaluate_alloc(const X& x, const Layout& l, const int32_t* tpe_all, const int32_t* alloc,
                                     int32_t* num_in, int32_t* num_out) {
    x.for_each(l.num_ranks, [&](int r) { num_in[r] = num_out[r] = 0; });
    const int64_t moved =
        x.sum(l.num_experts, [&](int e) { return evaluate_expert(x, l, tpe_all, alloc, num_in, num_out, e); });
    x.sync();
    return quality_of(l, num_in, num_out, moved);
}

FLATEP_HD PlanQuality evaluate_alloc(const Layout& l, const int32_t* tpe_all, const int32_t* alloc, int32_t* num_in,
                                     int32_t* num_out) {
    return evaluate_alloc(SerialExec{}, l, tpe_all, alloc, num_in, num_out);
}

}  // namespace flatep::planner
