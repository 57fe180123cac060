// The balanced planner's candidates (transport, pack, path and tree, design §4), the rule that selects among them,
// and plan_alloc, which runs that rule serially. Every function is written against the executor contract of
// planner/executor.hpp, so the GPU planner (planner/gpu_planner.cu) builds the same candidates in parallel.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "flatep/types.hpp"
#include "layout/layout.hpp"
#include "planner/executor.hpp"
#include "planner/greedy.hpp"
#include "planner/quality.hpp"

namespace flatep::planner {

// Number of transport variants tried per makespan budget (see transport_candidate).
inline constexpr int kNumTransportVariants = 6;
// Number of packing variants tried per makespan budget (see pack_candidate).
inline constexpr int kNumPackVariants = 4;
// Number of path (cascade) variants (see path_candidate).
inline constexpr int kNumPathVariants = 4;
// Number of tree (cascade transport) variants tried per makespan budget (see tree_candidate).
inline constexpr int kNumTreeVariants = 8;

// Home allocation plus the donors' excess and every rank's room (exact: fixed targets; slack: C).
template <class X>
FLATEP_HD void init_donors(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w) {
    const int64_t n = init_home(x, l, tpe_all, alloc, w);
    if (l.exact && !x.targets_ready()) x.single([&] { fixed_targets(l, n, w); });
    x.for_each(l.num_ranks, [&](int r) {
        const int32_t cap = l.exact ? w.target[r] : l.capacity;
        w.excess[r] = w.load[r] > cap ? w.load[r] - cap : 0;
        w.room[r] = w.load[r] < cap ? cap - w.load[r] : 0;
        w.num_in[r] = w.num_out[r] = 0;
    });
}

// A home expert of donor `dn` with entries still at home, to cut the next piece from. prefer_covering: the smallest
// one holding at least `need` entries, else the largest; otherwise the largest. Ties to the lower expert id; -1 when
// the donor has nothing left at home.
template <class X>
FLATEP_HD int pick_home_expert(const X& x, const Layout& l, const int32_t* alloc, int dn, int32_t need,
                               bool prefer_covering) {
    if (!prefer_covering) return largest_home_expert(x, l, alloc, dn);
    const int E = l.num_experts, epn = l.experts_per_rank;
    const int32_t* home = alloc + int64_t(dn) * E + int64_t(dn) * epn;
    const int i = x.arg_max(epn, [&](int j) {
        const int32_t a = home[j];
        if (a <= 0) return uint64_t(0);
        return a >= need ? (uint64_t(1) << 32) | key_smaller(a) : uint64_t(a);
    });
    return i < 0 ? -1 : dn * epn + i;
}

// Transport candidate of the balanced planner for a makespan budget: every rank sends at most `budget` replica
// copies and hosts at most min(budget, epn) replicas. Donors are the ranks above their target (exact) or above C
// (slack); each must shed its excess; any other rank may take up to its room (exact: target - G_r; slack:
// C - G_r). Repeat: the donor with the largest remaining excess (ties to the lower rank) picks one of its home
// experts and sends a piece of it to one receiver:
//   expert  (variant % 2): 0 = largest remaining home allocation; 1 = the smallest one that covers the whole remaining
//           excess, else the largest (a single piece finishes the donor when it can). Ties to the lower expert id.
//   receiver (variant / 2): a receiver already hosting that expert costs nothing and is taken first; else among
//           ranks with room and a free in-budget: 0 = best fit (smallest room that takes the whole piece, else the
//           largest room); 1 = locality (among those that take the whole piece, most entries of that expert from
//           the receiver itself, then smallest room; else the largest room); 2 = largest room. Ties to lower rank.
// The piece is min(expert remaining, excess, receiver room). Returns false when a budget would be exceeded.
// Donors and receivers are disjoint, so no rank both sends and takes, and no replica is ever moved again.
template <class X>
FLATEP_HD bool transport_candidate(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc,
                                   const Workspace& w, int budget, int variant) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    init_donors(x, l, tpe_all, alloc, w);
    const int in_budget = min_of(budget, epn);
    const int expert_rule = variant % 2, receiver_rule = variant / 2;
    // Each step either finishes a donor, an expert's home allocation or a receiver's room, or adds a replica; the
    // bound below is only a guard against an inconsistent input.
    const int max_steps = 4 * R * (epn + 1) + 4 * R;
    for (int step = 0; step < max_steps; ++step) {
        const int dn = x.arg_max(R, [&](int r) { return key_larger(w.excess[r]); });
        if (dn < 0) return true;
        const int32_t xs = w.excess[dn];
        const int e = pick_home_expert(x, l, alloc, dn, xs, expert_rule == 1);
        if (e < 0) return false;  // the donor has nothing left at home (cannot happen: load_dn > its target >= 0)
        const int32_t piece = min_of(xs, alloc[dn * E + e]);
        // Receivers, selected at once: a rank that already hosts e (no new replica); else the best fit, or the
        // largest open room (see the rules above).
        int sel[3];  // hosting, largest room, fit
        x.arg_max3(
            R,
            [&](int r) {
                // Every value read first, then the keys without branches (the same keys as the rules above).
                const int32_t room = w.room[r], hosted = alloc[r * E + e], in = w.num_in[r];
                const uint64_t local = receiver_rule == 1 ? uint64_t(tpe_all[r * E + e]) : 0;
                const bool other = r != dn && room > 0;
                const bool open = other && in < in_budget;  // with room and a free in-budget
                const bool fit = open && receiver_rule != 2 && room >= piece;
                const uint64_t smaller = key_smaller(room);
                return Keys3{{uint64_t(other && hosted > 0), open ? key_larger(room) : 0,
                              fit ? (receiver_rule == 1 ? (local << 32) | smaller : smaller) : 0}};
            },
            sel);
        int rc = sel[0];
        const bool new_replica = rc < 0;
        if (new_replica) {
            if (w.num_out[dn] >= budget) return false;
            rc = sel[2] < 0 ? sel[1] : sel[2];
            if (rc < 0) return false;
        }
        const int32_t m = min_of(piece, w.room[rc]);
        x.single([&] { send_piece(l, alloc, w, e, dn, rc, m, new_replica); });  // m <= the room
    }
    return false;
}

// Packing candidate of the balanced planner for a makespan budget (same budgets as transport_candidate). Each donor
// cuts its excess into items: its home experts, largest remaining allocation first (ties to the lower id), each
// whole except the last, which is the remainder. Items are then packed into the receivers' rooms:
//   pass 1 (variant bit 0 set): items in descending size (ties to the lower item index) go whole into the receiver
//          with the smallest room that holds them (ties to the lower rank), when one exists within the budgets;
//   pass 2: the remaining items, in descending size (variant bit 1 clear) or in donor order (bit 1 set), are poured
//          into the receivers with the largest room first (ties to the lower rank), split where a room fills up.
// Every piece of an item on one receiver is one replica. Returns false when a budget would be exceeded.
template <class X>
FLATEP_HD bool pack_candidate(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w,
                              int budget, int variant) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    init_donors(x, l, tpe_all, alloc, w);
    const int in_budget = min_of(budget, epn);
    int num_items = 0;
    x.for_each(E, [&](int e) { w.itemized[e] = 0; });
    for (int dn = 0; dn < R; ++dn) {
        int32_t xs = w.excess[dn];
        const int32_t* home = alloc + int64_t(dn) * E + int64_t(dn) * epn;
        while (xs > 0) {
            const int i = x.arg_max(epn, [&](int j) { return w.itemized[dn * epn + j] ? 0 : key_larger(home[j]); });
            if (i < 0) return false;  // unreachable: a donor's home allocation exceeds its excess
            const int best = dn * epn + i;
            const int32_t size = min_of(xs, home[i]);
            x.single([&] {
                w.itemized[best] = 1;
                w.item_expert[num_items] = best;
                w.item_size[num_items] = size;
                w.item_state[num_items] = 0;
            });
            xs -= size;
            ++num_items;
        }
    }
    if (variant & 1) {
        for (int pass = 0; pass < num_items; ++pass) {
            const int it =
                x.arg_max(num_items, [&](int i) { return w.item_state[i] == 0 ? key_larger(w.item_size[i]) : 0; });
            if (it < 0) break;
            x.single([&] { w.item_state[it] = 1; });
            const int e = w.item_expert[it], dn = l.home_rank(e);
            const int32_t size = w.item_size[it];
            if (w.num_out[dn] >= budget) continue;
            const int rc = x.arg_max(R, [&](int r) {
                return r != dn && w.num_in[r] < in_budget && w.room[r] >= size ? key_smaller(w.room[r]) : 0;
            });
            if (rc < 0) continue;
            x.single([&] {
                move_entries(l, alloc, w, e, rc, size);
                w.room[rc] -= size;
                ++w.num_in[rc];
                ++w.num_out[dn];
                w.item_state[it] = 2;
            });
        }
    }
    for (int pass = 0; pass < num_items; ++pass) {
        const int it = x.arg_max(num_items, [&](int i) {
            if (w.item_state[i] == 2) return uint64_t(0);
            return (variant & 2) ? uint64_t(1) : key_larger(w.item_size[i]);
        });
        if (it < 0) break;
        x.single([&] { w.item_state[it] = 2; });
        const int e = w.item_expert[it], dn = l.home_rank(e);
        int32_t left = w.item_size[it];
        while (left > 0) {
            const int rc =
                x.arg_max(R, [&](int r) { return r != dn && w.num_in[r] < in_budget ? key_larger(w.room[r]) : 0; });
            if (rc < 0 || w.num_out[dn] >= budget) return false;
            const int32_t m = min_of(left, w.room[rc]);
            x.single([&] {
                move_entries(l, alloc, w, e, rc, m);
                w.room[rc] -= m;
                ++w.num_in[rc];
                ++w.num_out[dn];
            });
            left -= m;
        }
    }
    return true;
}

// Key of rank r for the next place of the path (see path_candidate for the rules), after m ranks with running sum
// `prefix`; 0 when r is placed already or has no surplus. Larger keys first, ties to the lower rank, so the path order
// is one arg_max per place.
FLATEP_HD uint64_t path_key(const Workspace& w, const int32_t* used, int variant, int m, int64_t prefix, int r) {
    if (used[r] || w.excess[r] == 0) return 0;
    const int64_t a = prefix + w.excess[r];                             // running sum after r; |a| <= 2N < 2^32 - 1
    const uint64_t closer = uint64_t(0xffffffffll - (a < 0 ? -a : a));  // smaller |a| first
    const uint64_t surplus = uint64_t(uint32_t(w.excess[r]) ^ 0x80000000u);  // larger (signed) surplus first
    if (variant >= 2) {
        // Feasible forward (0 <= a <= r's largest home expert) first; among them the smallest (2) or largest (3) a;
        // else the smallest |a|.
        if (a >= 0 && a <= w.room[r]) {
            return (uint64_t(1) << 62) | (variant == 2 ? uint64_t(0xffffffffll - a) : uint64_t(a));
        }
        return (uint64_t(1) << 61) | closer;
    }
    if (variant == 0 || m == 0) return surplus + 1;
    return (closer << 32) | surplus;  // closer >= 1
}

// Path order of path_candidate: writes order[0, m) and returns m. used: [R] scratch.
template <class X>
FLATEP_HD int path_order(const X& x, const Layout& l, const Workspace& w, int variant, int32_t* order, int32_t* used) {
    const int R = l.num_ranks;
    int m = 0;
    int64_t prefix = 0;
    for (int step = 0; step < R; ++step) {
        const int pick = x.arg_max(R, [&](int r) { return path_key(w, used, variant, m, prefix, r); });
        if (pick < 0) break;
        x.single([&] {
            used[pick] = 1;
            order[m] = pick;
        });
        ++m;
        prefix += w.excess[pick];
    }
    return m;
}

// Pieces send_largest_first takes one selection at a time before it computes the rest at once. At K3 (E=896, R=8) a
// second send of a rank (no home_ahead order then) had computed every piece at once, 5 us for ahead_sums' sort alone;
// one at a time, the GPU planner took 28.5-30.2 us instead of 33.3-41.5 (H200, maxvio 1/5/20, K 8/16, same run).
inline constexpr int kLoopPieces = 8;

// Sends `need` entries from src's home experts to dst, largest remaining allocation first (ties to the lower expert
// id), each expert whole except the last, one replica per expert. As a loop that takes one expert at a time: so it
// runs without the executor's home_ahead order, up to kLoopPieces pieces; the rest, and with that order every piece,
// computed at once: expert j goes (min(a_j, need - ahead_j) of its a_j entries) when the experts ahead of it in that
// order hold ahead_j < need entries (the same pieces). False (alloc and loads then unspecified) when src's home
// allocation cannot cover need or dst would host more than epn replicas.
// Precondition: src's home allocation has changed only through its own sends (w.num_out[src] counts them), so before
// its first send it is the home allocation and the executor's home_ahead(src), when it has one, gives the order.
template <class X>
FLATEP_HD bool send_largest_first(const X& x, const Layout& l, int32_t* alloc, const Workspace& w, int src, int dst,
                                  int32_t need) {
    const int E = l.num_experts, epn = l.experts_per_rank;
    int32_t* const home = alloc + int64_t(src) * E + int64_t(src) * epn;
    int32_t* const to = alloc + int64_t(dst) * E + int64_t(src) * epn;
    // Entries ahead of each home expert (positive allocations before it in the order), or -1 when it holds none.
    const int32_t* ahead = w.num_out[src] == 0 ? x.home_ahead(src) : nullptr;
    if (ahead == nullptr) {
        // The usual case: a few pieces, one selection each; past kLoopPieces, the rest from ahead_sums over what is
        // left.
        for (int k = 0; k < kLoopPieces; ++k) {
            const int top = largest_home_expert(x, l, alloc, src);
            if (top < 0 || w.num_in[dst] >= epn) return false;
            const int32_t m = min_of(need, alloc[int64_t(src) * E + top]);
            x.single([&] {
                move_entries(l, alloc, w, top, dst, m);
                ++w.num_in[dst];
                ++w.num_out[src];
            });
            need -= m;
            if (need == 0) return true;
        }
        x.ahead_sums(epn, home, w.itemized);  // [epn] (E >= epn)
        ahead = w.itemized;
    }
    // One pass moves the pieces and sums them: pieces (<= epn) above bit 40, the home allocation (< 2^31) below.
    const int64_t both = x.sum(epn, [&](int j) {
        const int32_t s = ahead[j], a = home[j];
        const int32_t piece = s >= 0 && s < need ? min_of(a, need - s) : 0;
        home[j] = a - piece;
        to[j] += piece;
        return (piece > 0 ? int64_t(1) << 40 : 0) + (a > 0 ? a : 0);
    });
    const int64_t pieces = both >> 40, available = both & ((int64_t(1) << 40) - 1);
    if (available < need || pieces > epn - w.num_in[dst]) return false;
    x.single([&] {
        w.load[src] -= need;
        w.load[dst] += need;
        w.num_in[dst] += int32_t(pieces);
        w.num_out[src] += int32_t(pieces);
    });
    return true;
}

// Path (cascade) candidate of the balanced planner. The ranks whose load differs from their fixed target (as for
// the greedy) are put on a path; the flow between neighbours is the running sum of surplus (load - target) along
// it, sent by whichever neighbour is upstream, as pieces of its home experts, largest remaining allocation first.
// At low skew every flow is smaller than one expert, so each rank sends and receives at most one replica (P = 1).
// Path order: variant 0 = descending surplus (all flows go forward); variant 1 = start at the largest surplus, then
// always append the rank that brings the running sum closest to zero (ties to the larger surplus, then the lower
// rank); variants 2 and 3 = always append a rank that keeps the running sum p' >= 0 and within its largest home
// expert, so every flow goes forward as one piece (P = 1 when such an order is found), taking the smallest (2) or
// largest (3) such p', else the smallest |p'|. Ties to the lower rank. Returns false when a rank would exceed epn
// replicas or run out of home entries.
template <class X>
FLATEP_HD bool path_candidate(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w,
                              int variant) {
    const int R = l.num_ranks, epn = l.experts_per_rank;
    const int64_t n = init_home(x, l, tpe_all, alloc, w);
    if (!x.targets_ready()) x.single([&] { fixed_targets(l, n, w); });
    int32_t* order = w.item_expert;  // [R] path order (E >= R)
    int32_t* used = w.item_state;
    x.for_each(R, [&](int r) {
        used[r] = 0;
        w.excess[r] = w.load[r] - w.target[r];  // signed surplus
        w.num_in[r] = w.num_out[r] = 0;
    });
    x.group_max(R, epn, w.total, w.room);  // largest home expert (variants 2 and 3)
    const int m = path_order(x, l, w, variant, order, used);
    int64_t prefix = 0;
    for (int i = 0; i + 1 < m; ++i) {
        prefix += w.excess[order[i]];
        if (prefix == 0) continue;
        const int src = prefix > 0 ? order[i] : order[i + 1];
        const int dst = prefix > 0 ? order[i + 1] : order[i];
        if (!send_largest_first(x, l, alloc, w, src, dst, int32_t(prefix > 0 ? prefix : -prefix))) return false;
    }
    return true;
}

// Tree (cascade transport) candidate of the balanced planner for a makespan budget: every rank sends at most
// `budget` replica copies and hosts at most min(budget, epn) replicas. Like transport_candidate, donors (ranks above
// their cap: the fixed target in exact mode, C in slack mode) shed their excess as pieces of their home experts into
// the rooms of the other ranks, largest excess first (ties to the lower rank). Unlike it, a donor's last permitted
// copy carries its whole remaining excess even when no room is that large: the receiver then overshoots its cap and
// becomes a donor itself, passing the overshoot on as pieces of its own home experts (a cascade). So a hot rank can
// hand its excess to as few as `budget` receivers and every rank is a receiver first and a donor after, never both
// at once: the replicas form a forest on the ranks, and a move either finishes a donor, fills a receiver's room or
// exhausts a home expert, so there are at most R - 1 replicas plus one per exhausted expert.
// Each step, for donor dn with excess x and copies left b = budget - sent:
//   receiver (variant % 2) among ranks with room, hosting fewer than min(budget, epn) replicas (and, when the piece
//       may overshoot, sending fewer than `budget` copies): 0 = largest room; 1 = smallest room that takes all of x,
//       else the largest room. When b == 1 the smallest room that takes all of x, else the largest room (overshoot).
//       Ties to the lower rank.
//   amount: min(x, room) while b > 1, x when b == 1.
//   expert (variant / 2 % 2): 0 = the smallest home allocation that covers the amount, else the largest; 1 = the
//       largest. Ties to the lower expert id. The piece is min(amount, that allocation).
//   relay (variant / 4): 1 = when b == 1 and no room takes all of x, the overshoot goes to the rank that has not sent
//       yet (any load: a donor that has not sent yet may relay), has a free slot, and whose forward amount
//       x - (cap - load) is smallest among those with a home allocation covering it (so it can pass the overshoot on
//       as one piece); else as above. Every copy goes to a rank that has not sent yet, so the replicas stay acyclic.
// A receiver already hosting the chosen expert costs no new replica. Returns false when a budget would be exceeded.
template <class X>
FLATEP_HD bool tree_candidate(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* alloc, const Workspace& w,
                              int budget, int variant) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    init_donors(x, l, tpe_all, alloc, w);
    const int in_budget = min_of(budget, epn);
    const int receiver_rule = variant % 2, expert_rule = (variant / 2) % 2, relay_rule = variant / 4;
    // Guard only: each step finishes a donor, fills a room or exhausts a home expert (see above).
    const int max_steps = 3 * R + E + 4;
    for (int step = 0; step < max_steps; ++step) {
        const int dn = x.arg_max(R, [&](int r) { return key_larger(w.excess[r]); });
        if (dn < 0) return true;
        const int32_t xs = w.excess[dn];
        const int left = budget - w.num_out[dn];
        if (left <= 0) return false;
        const bool last = left == 1;
        // Selected at once: the smallest fitting room, the largest non-fitting one, the largest fitting one (ranks
        // other than dn with room and a free in-budget slot). Every value read first, then the keys without branches.
        int sel[3];
        x.arg_max3(
            R,
            [&](int r) {
                const int32_t room = w.room[r], in = w.num_in[r], out = w.num_out[r];
                const bool open = r != dn && room > 0 && in < in_budget;
                const bool fit = open && room >= xs;
                const bool big = open && !fit && (!last || out < budget);
                return Keys3{{fit ? key_smaller(room) : 0, big ? key_larger(room) : 0, fit ? key_larger(room) : 0}};
            },
            sel);
        const int fit = sel[0], big = sel[1];
        int rc;
        if (last || receiver_rule == 1) {
            rc = fit >= 0 ? fit : big;
        } else if (fit >= 0) {
            rc = sel[2];  // largest room overall: the largest fitting room (it is above every non-fitting one)
        } else {
            rc = big;
        }
        if (last && fit < 0 && relay_rule == 1) {
            // Overshoot target by forward fit: the rank (other than dn, not having sent yet, with a free slot) whose
            // forward amount f = x - (cap - load) is smallest among those with a home allocation covering f; ranks
            // at or above their cap (donors that have not sent yet) may relay. Ties to the lower rank.
            const int best = x.arg_max(R, [&](int r) {
                if (r == dn || w.num_out[r] != 0 || w.num_in[r] >= in_budget) return uint64_t(0);
                const int32_t f = xs - w.room[r] + w.excess[r];
                int32_t biggest = 0;
                for (int i = r * epn; i < (r + 1) * epn; ++i) biggest = max_of(biggest, alloc[r * E + i]);
                return f > biggest ? uint64_t(0) : uint64_t((int64_t(1) << 33) - int64_t(f));
            });
            if (best >= 0) rc = best;
        }
        if (rc < 0) return false;
        const int32_t amount = last ? xs : min_of(xs, w.room[rc]);
        const int e = pick_home_expert(x, l, alloc, dn, amount, expert_rule == 0);
        if (e < 0) return false;  // cannot happen: a donor's home allocation exceeds its excess
        const int32_t piece = min_of(amount, alloc[dn * E + e]);
        const bool new_replica = alloc[rc * E + e] == 0;
        x.single([&] { send_piece(l, alloc, w, e, dn, rc, piece, new_replica); });
    }
    return false;
}

// Candidates of the balanced planner in the order plan_alloc considers them: indices [0, kNumPathVariants) are the
// path variants; then, for budget b = 1, 2, ..., kVariantsPerBudget indices each: the transport, pack and tree
// variants of that budget. Budgets never exceed the greedy's makespan, so num_candidates(P_greedy) covers all.
inline constexpr int kVariantsPerBudget = kNumTransportVariants + kNumPackVariants + kNumTreeVariants;

FLATEP_HD int num_candidates(int greedy_makespan) { return kNumPathVariants + kVariantsPerBudget * greedy_makespan; }

// Builds candidate `index` into `cand` ([R*E]) using workspace `w`; false when that candidate yields no plan. A
// candidate reads only tpe_all and writes only cand and w, so candidates may be built in any order or in parallel,
// each with its own workspace.
template <class X>
FLATEP_HD bool build_candidate(const X& x, const Layout& l, const int32_t* tpe_all, int32_t* cand, const Workspace& w,
                               int index) {
    if (index < kNumPathVariants) return path_candidate(x, l, tpe_all, cand, w, index);
    const int budget = (index - kNumPathVariants) / kVariantsPerBudget + 1;
    const int variant = (index - kNumPathVariants) % kVariantsPerBudget;
    const int v = variant - kNumTransportVariants;
    return variant < kNumTransportVariants ? transport_candidate(x, l, tpe_all, cand, w, budget, variant)
           : v < kNumPackVariants          ? pack_candidate(x, l, tpe_all, cand, w, budget, v)
                                           : tree_candidate(x, l, tpe_all, cand, w, budget, v - kNumPackVariants);
}

FLATEP_HD bool build_candidate(const Layout& l, const int32_t* tpe_all, int32_t* cand, const Workspace& w, int index) {
    return build_candidate(SerialExec{}, l, tpe_all, cand, w, index);
}

// Marks a candidate that yielded no plan in a quality list.
inline constexpr int32_t kNoCandidate = -1;

// Whether a candidate of quality q may replace the greedy's plan: it yielded a plan and is no worse than the greedy on
// P and on total replicas (each on its own). Every selection (serial, warp, keyed) and ops_bench's estimate use it.
FLATEP_HD bool acceptable(const PlanQuality& greedy, const PlanQuality& q) {
    return q.makespan != kNoCandidate && q.makespan <= greedy.makespan && q.total_replicas <= greedy.total_replicas;
}

// The balanced planner's choice given the greedy's quality and the quality of candidates [0, count) (makespan
// kNoCandidate where a candidate yielded no plan; count >= num_candidates(greedy.makespan)). A candidate is
// acceptable when it is no worse than the greedy on P and on total replicas (each on its own); the kept plan is the
// best acceptable one by (P, total replicas, entries moved), earlier candidates winning ties. Path candidates are
// always considered; budgets are then tried in increasing order up to the best makespan found so far, stopping after
// the first budget with an acceptable candidate. Returns the kept index, or -1 when the greedy stays.
FLATEP_HD int select_candidate(const PlanQuality& greedy, const PlanQuality* quality, int count) {
    PlanQuality best = greedy;
    int kept = -1;
    for (int i = 0; i < kNumPathVariants && i < count; ++i) {
        if (!acceptable(greedy, quality[i]) || !better_than(quality[i], best)) continue;
        best = quality[i];
        kept = i;
    }
    for (int budget = 1; budget <= best.makespan; ++budget) {
        bool found = false;
        for (int variant = 0; variant < kVariantsPerBudget; ++variant) {
            const int i = kNumPathVariants + (budget - 1) * kVariantsPerBudget + variant;
            if (i >= count || !acceptable(greedy, quality[i])) continue;
            found = true;
            if (better_than(quality[i], best)) {
                best = quality[i];
                kept = i;
            }
        }
        if (found) break;
    }
    return kept;
}

// Computes alloc[R][E] for `kind`: the greedy, or (balanced) the greedy plus the candidates above, selected by
// select_candidate's rule (which this serial loop follows step by step, building each candidate only when the rule
// reaches it). So the balanced plan is never worse than the greedy on P or on total replicas.
// Every candidate reads only tpe_all and writes only its own allocation and scratch, so a GPU may build them in
// parallel (one warp each) and apply select_candidate to their qualities. Cost: O(R*E) per candidate (reset and
// evaluation) plus O(R*epn^2) for cutting experts and O(E) per tree step; at most num_candidates(P_greedy).
// The owner planner: the home allocation alone (no replicas).
FLATEP_HD void plan_alloc(const Layout& l, PlannerKind kind, const int32_t* tpe_all, int32_t* alloc, int32_t* ws) {
    const SerialExec x{};
    const Workspace w = make_workspace(l, ws);
    if (kind == PlannerKind::kOwner) {
        init_home(x, l, tpe_all, alloc, w);
        return;
    }
    greedy_alloc(x, l, tpe_all, alloc, w);
    if (kind != PlannerKind::kBalanced) return;
    const int R = l.num_ranks, E = l.num_experts;
    const PlanQuality greedy = evaluate_alloc(x, l, tpe_all, alloc, w.num_in, w.num_out);
    PlanQuality best = greedy;
    auto consider = [&](int index, bool& found) {
        if (!build_candidate(x, l, tpe_all, w.cand, w, index)) return;
        const PlanQuality q = evaluate_alloc(x, l, tpe_all, w.cand, w.num_in, w.num_out);
        if (!acceptable(greedy, q)) return;
        found = true;
        if (!better_than(q, best)) return;
        best = q;
        for (int i = 0; i < R * E; ++i) alloc[i] = w.cand[i];
    };
    bool unused = false;
    for (int i = 0; i < kNumPathVariants; ++i) consider(i, unused);
    for (int budget = 1; budget <= best.makespan; ++budget) {
        bool found = false;
        for (int variant = 0; variant < kVariantsPerBudget; ++variant) {
            consider(kNumPathVariants + (budget - 1) * kVariantsPerBudget + variant, found);
        }
        if (found) break;
    }
}

}  // namespace flatep::planner
