// The planner core's workspace and executors (design §4): where its O(R*E) and O(R) arrays live, the executor
// contract every planner function is written against, and SerialExec, the one-thread executor of the host planner.
// The GPU executors (WarpExec, BlockExec) are in planner/warp_exec.cuh.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "flatep/types.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::planner {

// Workspace layout, in int32 words. Every array is indexed like the plan's ([r], [e], [d*E + e]).
struct Workspace {
    int32_t* total;        // [E] T_e
    int32_t* target;       // [R] fixed target load (greedy; exact-mode transport)
    int32_t* load;         // [R] current load
    int32_t* room;         // [R] transport: entries a rank may still take
    int32_t* excess;       // [R] transport: entries a donor must still shed
    int32_t* num_in;       // [R] replicas hosted
    int32_t* num_out;      // [R] replica copies of the rank's experts
    int32_t* cand;         // [R*E] candidate allocation
    int32_t* item_expert;  // [E] pack_candidate: expert of each item
    int32_t* item_size;    // [E] pack_candidate: entries of each item
    int32_t* item_state;   // [E] pack_candidate: 0 open, 1 visited by the whole-item pass, 2 placed
    int32_t* itemized;     // [E] pack_candidate: expert already cut into an item
};

FLATEP_HD int64_t planner_workspace_words(const Layout& l) {
    const int64_t r = l.num_ranks, e = l.num_experts;
    return 5 * e + 6 * r + r * e;
}

// The workspace's arrays from three places: `front` (total [E], then target, load, room, excess, num_in, num_out
// [R] each), `cand` [R*E] and `items` (item_expert, item_size, item_state, itemized [E] each).
FLATEP_HD Workspace make_workspace_at(const Layout& l, int32_t* front, int32_t* cand, int32_t* items) {
    const int R = l.num_ranks, E = l.num_experts;
    Workspace w{};
    w.total = front;
    w.target = w.total + E;
    w.load = w.target + R;
    w.room = w.load + R;
    w.excess = w.room + R;
    w.num_in = w.excess + R;
    w.num_out = w.num_in + R;
    w.cand = cand;
    w.item_expert = items;
    w.item_size = w.item_expert + E;
    w.item_state = w.item_size + E;
    w.itemized = w.item_state + E;
    return w;
}

// One block of planner_workspace_words(l) words: front, then cand, then the items.
FLATEP_HD Workspace make_workspace(const Layout& l, int32_t* base) {
    const int64_t front = int64_t(l.num_experts) + 6 * int64_t(l.num_ranks);
    return make_workspace_at(l, base, base + front, base + front + int64_t(l.num_ranks) * l.num_experts);
}

// The same workspace with the candidate allocation `cand` ([R*E]) elsewhere (the GPU planner keeps it in global
// memory, or next to the counts, where shared memory does not hold everything): every other array packed into
// `small` (planner_small_workspace_words(l) words), in make_workspace's order.
FLATEP_HD int64_t planner_small_workspace_words(const Layout& l) {
    return planner_workspace_words(l) - int64_t(l.num_ranks) * l.num_experts;
}

FLATEP_HD Workspace make_workspace_split(const Layout& l, int32_t* small, int32_t* cand) {
    return make_workspace_at(l, small, cand, small + l.num_experts + 6 * l.num_ranks);
}

// Executors. Every function below takes an executor `x` that says who runs it:
//   SerialExec: one thread (the host planner, tests, the serial GPU reference);
//   a warp executor (planner/warp_exec.cuh): the 32 lanes of a warp run the same code with the same scalars, split
//   the scans and loops below among themselves and reduce with warp instructions.
// An executor provides:
//   x.for_each(n, f)   f(i) for every i in [0, n), spread over the lanes; f writes only cells of its own i
//   x.sum(n, f)        sum of f(i) over [0, n) (int64); f may write cells of its own i, as in for_each (visible to
//                      every lane after the next single or sync)
//   x.arg_max(n, key)  the i in [0, n) with the largest key(i) (uint64; 0 = not eligible), ties to the lower i; -1
//                      when no i is eligible. key only reads: an executor may call it more than once, at any i in
//                      [0, n)
//   x.arg_max3(n, key, out)  three such selections over the same items at once: key(i) returns Keys3, out[j] =
//                      arg_max(n, key(i).k[j]) (a warp runs the three reductions side by side)
//   x.single(f)        f() once (shared state: loads, rooms, allocation cells), visible to every lane afterwards
//   x.add(p, v)        *p += v, safe when several lanes add to the same word inside for_each or sum
//   x.group_sum(g, size, v, out) / x.group_max(g, size, v, out)  for every group i in [0, g): out[i] = the sum / the
//                      maximum (at least 0) of v[i*size, (i+1)*size); then synced
//   x.ahead_sums(n, v, out)  for every i in [0, n): out[i] = -1 when v[i] <= 0, else the sum of the positive v[j]
//                      that come before i in the order (larger value first, ties to the lower index); then synced
//   x.home_ready(alloc, &n)  true when the executor has already put init_home's results (the home allocation in
//                      alloc, w.total, w.load) in place and knows N; init_home then only returns n. SerialExec: never.
//   x.targets_ready()  true when w.target already holds fixed_targets' result for the counts (the callers of
//                      fixed_targets then skip it). SerialExec: never.
//   x.home_ahead(r)    ahead_sums of rank r's home experts under the home allocation (w.total[r*epn, (r+1)*epn)),
//                      when the executor has computed them for the whole candidate, else nullptr. SerialExec: nullptr.
// So every selection of design §4 ("the largest ..., ties to the lower index") is one arg_max with the same key on
// every executor, and the plans are bitwise equal by construction.

// Three keys per item (x.arg_max3).
struct Keys3 {
    uint64_t k[3];
};

struct SerialExec {
    FLATEP_HD void sync() const {}
    template <class F>
    FLATEP_HD void single(F&& f) const {
        f();
    }
    template <class F>
    FLATEP_HD void for_each(int n, F&& f) const {
        for (int i = 0; i < n; ++i) f(i);
    }
    template <class F>
    FLATEP_HD int64_t sum(int n, F&& f) const {
        int64_t s = 0;
        for (int i = 0; i < n; ++i) s += int64_t(f(i));
        return s;
    }
    template <class K>
    FLATEP_HD int arg_max(int n, K&& key) const {
        uint64_t best = 0;
        int at = -1;
        for (int i = 0; i < n; ++i) {
            const uint64_t k = key(i);
            if (k > best) {
                best = k;
                at = i;
            }
        }
        return at;
    }
    template <class K>
    FLATEP_HD void arg_max3(int n, K&& key, int* out) const {
        uint64_t best[3] = {0, 0, 0};
        out[0] = out[1] = out[2] = -1;
        for (int i = 0; i < n; ++i) {
            const Keys3 k = key(i);
            for (int j = 0; j < 3; ++j) {
                if (k.k[j] > best[j]) {
                    best[j] = k.k[j];
                    out[j] = i;
                }
            }
        }
    }
    FLATEP_HD void add(int32_t* p, int32_t v) const { *p += v; }
    FLATEP_HD void group_sum(int groups, int size, const int32_t* v, int32_t* out) const {
        for (int i = 0; i < groups; ++i) {
            int32_t s = 0;
            for (int j = 0; j < size; ++j) s += v[i * size + j];
            out[i] = s;
        }
    }
    FLATEP_HD void group_max(int groups, int size, const int32_t* v, int32_t* out) const {
        for (int i = 0; i < groups; ++i) {
            int32_t m = 0;
            for (int j = 0; j < size; ++j) m = v[i * size + j] > m ? v[i * size + j] : m;
            out[i] = m;
        }
    }
    FLATEP_HD void ahead_sums(int n, const int32_t* v, int32_t* out) const {
        for (int i = 0; i < n; ++i) {
            int32_t s = -1;
            if (v[i] > 0) {
                s = 0;
                for (int j = 0; j < n; ++j)
                    if (v[j] > 0 && (v[j] > v[i] || (v[j] == v[i] && j < i))) s += v[j];
            }
            out[i] = s;
        }
    }
    FLATEP_HD bool home_ready(const int32_t*, int64_t*) const { return false; }
    FLATEP_HD bool targets_ready() const { return false; }
    FLATEP_HD const int32_t* home_ahead(int) const { return nullptr; }
};

// Keys of arg_max. A positive int32 value, larger first.
FLATEP_HD uint64_t key_larger(int32_t v) { return v > 0 ? uint64_t(v) : 0; }
// A positive int32 value, smaller first (still > 0).
FLATEP_HD uint64_t key_smaller(int32_t v) { return uint64_t(int64_t(INT32_MAX) - v) + 1; }

}  // namespace flatep::planner
