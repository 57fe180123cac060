// The home allocation, the fixed targets and the one-donor greedy (design §4, constraint 3): the reference baseline
// and the balanced planner's starting point.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "layout/layout.hpp"
#include "planner/executor.hpp"

namespace flatep::planner {

// Home allocation (no replicas) into alloc; fills w.total and w.load (= group loads G_r). Returns N.
template <class X>
FLATEP_HD int64_t init_home(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    int64_t ready = 0;
    if (x.home_ready(alloc, &ready)) return ready;
    const int64_t n = x.sum(E, [&](int e) {
        int32_t t = 0;
        for (int s = 0; s < R; ++s) t += tpe_all[s * E + e];
        w.total[e] = t;
        const int h = l.home_rank(e);
        for (int d = 0; d < R; ++d) alloc[d * E + e] = d == h ? t : 0;
        return t;
    });
    x.sync();
    x.group_sum(R, epn, w.total, w.load);
    return n;
}

// Fixed per-rank targets (greedy). Requires w.load = group loads. Serial (O(R) words).
FLATEP_HD void fixed_targets(const Layout& l, int64_t n, const Workspace& w) {
    const int R = l.num_ranks;
    if (l.exact) {
        const int64_t base = n / R, rest = n % R;
        for (int r = 0; r < R; ++r) w.target[r] = int32_t(base + (r < rest ? 1 : 0));
        return;
    }
    const int32_t c = l.capacity;
    int64_t over = 0;
    for (int r = 0; r < R; ++r) {
        w.target[r] = w.load[r] < c ? w.load[r] : c;
        over += w.load[r] - w.target[r];
    }
    // Hand the excess to the ranks with the most room, filling each to C. N <= R*S*K <= R*C, so it always fits.
    while (over > 0) {
        int best = -1;
        for (int r = 0; r < R; ++r)
            if (w.target[r] < c && (best < 0 || c - w.target[r] > c - w.target[best])) best = r;
        if (best < 0) break;  // unreachable for valid counts
        const int64_t give = min_of<int64_t>(over, c - w.target[best]);
        w.target[best] += int32_t(give);
        over -= give;
    }
}

// Moves `m` entries of expert e from its home rank to rank d, d not the home rank (inside x.single). The four cells
// are distinct: all are read, then written, so that the loads overlap.
FLATEP_HD void move_entries(const Layout& l, int32_t* alloc, const Workspace& w, int e, int d, int32_t m) {
    const int E = l.num_experts, h = l.home_rank(e);
    const int32_t from = alloc[h * E + e], to = alloc[d * E + e], load_h = w.load[h], load_d = w.load[d];
    alloc[h * E + e] = from - m;
    alloc[d * E + e] = to + m;
    w.load[h] = load_h - m;
    w.load[d] = load_d + m;
}

// A donor's piece (inside x.single): `m` entries of dn's home expert e to rank rc != dn, as move_entries, then the
// donor's excess less m, the receiver's room less m (when m exceeds the room: the room 0 and the rest added to the
// receiver's excess, the tree's overshoot), and with new_replica one more copy sent by dn and hosted by rc. Every
// cell is read first, then written (they are distinct), so that the loads overlap.
FLATEP_HD void send_piece(const Layout& l, int32_t* alloc, const Workspace& w, int e, int dn, int rc, int32_t m,
                          bool new_replica) {
    const int E = l.num_experts;
    int32_t* const from = alloc + int64_t(dn) * E + e;
    int32_t* const to = alloc + int64_t(rc) * E + e;
    const int32_t a_from = *from, a_to = *to, load_dn = w.load[dn], load_rc = w.load[rc];
    const int32_t excess_dn = w.excess[dn], excess_rc = w.excess[rc], room = w.room[rc];
    const int32_t out = w.num_out[dn], in = w.num_in[rc];
    *from = a_from - m;
    *to = a_to + m;
    w.load[dn] = load_dn - m;
    w.load[rc] = load_rc + m;
    w.excess[dn] = excess_dn - m;
    if (m <= room) {
        w.room[rc] = room - m;
    } else {
        w.excess[rc] = excess_rc + (m - room);
        w.room[rc] = 0;
    }
    if (new_replica) {
        w.num_out[dn] = out + 1;
        w.num_in[rc] = in + 1;
    }
}

// The home expert of `dn` with the largest remaining allocation (ties to the lower id), -1 when none is left.
template <class X>
FLATEP_HD int largest_home_expert(const X& x, const Layout& l, const int32_t* alloc, int dn) {
    const int E = l.num_experts, epn = l.experts_per_rank;
    const int32_t* home = alloc + int64_t(dn) * E + int64_t(dn) * epn;
    const int i = x.arg_max(epn, [&](int j) { return key_larger(home[j]); });
    return i < 0 ? -1 : dn * epn + i;
}

// One-donor greedy (design §4, constraint 3), the reference baseline. Repeat: the most-deficient rank (largest
// target - load, ties to the lower rank) is filled completely from the most-overloaded rank (largest load - target,
// ties to the lower rank), taking that donor's home experts largest remaining allocation first (ties to the lower
// expert id), each as far as still needed. A donor may give more than its excess; it then becomes deficient and is
// filled later from another donor (a cascade).
//
// Feasibility (every rank hosts at most epn replicas; the loop ends after at most R fills):
//  * A filled rank has load == target and is never a donor afterwards (donors have load > target), so its load never
//    changes again: every rank is filled at most once, from exactly one donor, i.e. with at most epn distinct
//    experts (the donor has epn home experts): at most epn replicas. At most R fills happen.
//  * A donor was never filled (a filled rank is never overloaded), so its whole load is its own home allocation,
//    and it can always cover the deficit D of the receiver: exact mode: D <= target_rc <= target_dn + 1 <=
//    target_dn + excess_dn = load_dn (targets differ by at most one). Slack mode: only ranks above C are donors
//    and their target is C, so D <= target_rc <= C < load_dn.
//  * Sum of targets == N == sum of loads, so when no rank is deficient no rank is overloaded: the plan balances.
template <class X>
FLATEP_HD void greedy_alloc(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    const int64_t n = init_home(x, l, tpe_all, alloc, w);
    if (!x.targets_ready()) x.single([&] { fixed_targets(l, n, w); });
    for (int fill = 0; fill < R; ++fill) {
        int sel[3];  // receiver (largest deficit), donor (largest surplus)
        x.arg_max3(
            R,
            [&](int r) {
                return Keys3{{key_larger(w.target[r] - w.load[r]), key_larger(w.load[r] - w.target[r]), 0}};
            },
            sel);
        const int rc = sel[0], dn = sel[1];
        if (rc < 0 || dn < 0) break;
        int32_t need = w.target[rc] - w.load[rc];
        for (int taken = 0; need > 0 && taken < epn; ++taken) {
            const int best = largest_home_expert(x, l, alloc, dn);
            if (best < 0) break;  // unreachable (see the feasibility argument)
            const int32_t m = min_of(need, alloc[dn * E + best]);
            x.single([&] { move_entries(l, alloc, w, best, rc, m); });
            need -= m;
        }
    }
}

FLATEP_HD void greedy_alloc(const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w) {
    greedy_alloc(SerialExec{}, l, tpe_all, alloc, w);
}

}  // namespace flatep::planner
