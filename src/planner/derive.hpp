// derive_plan: everything of the global part of a plan that follows from the counts and the allocation (plan.hpp's
// split rule, design §5's groups), plus the statistics. Written once, over a derive executor, so the host planner
// (one thread) and the GPU planner (a block, one warp per task: planner/warp_exec.cuh) run the same code and get
// bitwise-equal plans.
//
// The work is a list of independent tasks, then the statistics:
//   task d < R        rank d: its slot experts, group_row row, group rows and cu_seqlens, loads after and replicas in
//   task R + c        the expert chunk [c*W, (c+1)*W): keep / spill / take of every cell, loads before, replicas out
// where W is the width of the executor's lane group (1 on the host, 32 on the GPU: one expert per lane).
//
// A derive executor `x` provides:
//   x.lanes()          this thread's lane group (OneLane, or a warp): G::kWidth lanes, g.lane, and the lane
//                      primitives below; a task runs on one lane group
//   x.thread(), x.threads()   this thread among the executor's threads (loops over kMaxRanks)
//   x.first_task(), x.task_stride()   the tasks of this lane group: first_task, first_task + stride, ...
//   x.first_lanes()    true on the lane group that computes the scalar statistics
//   x.sync()           a barrier of all the executor's threads
//   x.tasks_done(), x.done()  barriers after the tasks and at the end (where the GPU stamps its profile)
//   x.merge(l, tpe, alloc, sums)  after the tasks: true when this executor goes on to the statistics with every
//                      task's sums in `sums` (one executor: always, its tasks added them; several blocks of a grid:
//                      only the block that computes the sums itself from tpe and alloc, and no task ran on it)
// A lane group `g` provides (every lane calls them with its own values, as a warp's *_sync intrinsics):
//   G::kItems                                        items a lane takes per pass of a rank task's walks
//   g.inclusive_sum(v), g.from_last(v)               a prefix sum over the lanes; the last lane's value
//   g.sum(v), g.sum2(a, b), g.max(v), g.min(v)       reductions over the lanes (every lane gets the result)
//   g.match(key), g.sum_in(mask, v), g.leads(mask)   the lanes with the same key, a sum over them, its lowest lane
//   g.any(b)                                         whether b holds on any lane
//   g.add(p, v)                                      *p += v, safe when several lane groups add to the same word
//   g.sync()                                         the lanes' writes visible to the group
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "flatep/types.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "planner/static_placement.hpp"

// nvcc unrolls the batch loops of derive_experts; host compilers keep their own choice.
#if defined(__CUDACC__)
#define FLATEP_DERIVE_UNROLL _Pragma("unroll")
#else
#define FLATEP_DERIVE_UNROLL
#endif

namespace flatep::planner {

// Sums of the tasks that the statistics are made of. Per rank: loads before (its home experts' entries) and after
// (its allocation), replicas it hosts and replica copies of its experts; entries in all and kept on their source.
struct DeriveSums {
    int32_t loads_before[kMaxRanks];
    int32_t loads_after[kMaxRanks];
    int32_t replicas_in[kMaxRanks];
    int32_t replicas_out[kMaxRanks];
    unsigned long long entries_total;
    unsigned long long entries_on_source;
};

// The lane group of one thread: every primitive is the identity of a single lane.
struct OneLane {
    static constexpr int kWidth = 1;
    static constexpr int kItems = 1;  // derive_rank's items per lane and pass
    static constexpr int lane = 0;
    FLATEP_HD int32_t inclusive_sum(int32_t v) const { return v; }
    FLATEP_HD int32_t from_last(int32_t v) const { return v; }
    FLATEP_HD unsigned sum(unsigned v) const { return v; }
    FLATEP_HD int32_t sum(int32_t v) const { return v; }
    FLATEP_HD void sum2(int64_t&, int64_t&) const {}
    FLATEP_HD int32_t max(int32_t v) const { return v; }
    FLATEP_HD int32_t min(int32_t v) const { return v; }
    FLATEP_HD unsigned match(int) const { return 1u; }
    FLATEP_HD unsigned sum_in(unsigned, unsigned v) const { return v; }
    FLATEP_HD bool leads(unsigned) const { return true; }
    FLATEP_HD bool any(bool b) const { return b; }
    FLATEP_HD void add(int32_t* p, int32_t v) const { *p += v; }
    FLATEP_HD void add(unsigned long long* p, unsigned long long v) const { *p += v; }
    FLATEP_HD void sync() const {}
};

// The derive executor of one thread (the host planner, the serial GPU reference): every task in turn.
struct SerialDerive {
    FLATEP_HD OneLane lanes() const { return OneLane{}; }
    FLATEP_HD int thread() const { return 0; }
    FLATEP_HD int threads() const { return 1; }
    FLATEP_HD int first_task() const { return 0; }
    FLATEP_HD int task_stride() const { return 1; }
    FLATEP_HD bool first_lanes() const { return true; }
    FLATEP_HD void sync() const {}
    FLATEP_HD void tasks_done() const {}
    FLATEP_HD bool merge(const Layout&, const int32_t*, const int32_t*, DeriveSums&) const { return true; }
    FLATEP_HD void done() const {}
};

// group_row's mark, during rank d's task, of a replica that got no slot (serving): its rows stay in its view row.
inline constexpr int32_t kInViewRow = -2;

// Serving (B < epn), rank d's slots when it hosts more replicas than slots: its n > B remote replicas slots_s[0, n)
// (ascending id) ranked by (rows on d descending, expert id ascending); the top B keep a slot, in ascending id, and the
// others are marked kInViewRow in group_row. slot_expert and slots_s keep the B chosen, then -1. A lane group's
// replicas are few (n <= epn), so each lane ranks its own against all n.
template <class G>
FLATEP_HD void choose_slots(const G& g, const Layout& l, const int32_t* row, int32_t* group_row, int32_t* slots_out,
                            int32_t* slots_s, int n) {
    constexpr int W = G::kWidth;
    const int B = l.num_slots;
    for (int i = g.lane; i < n; i += W) {
        const int e = slots_s[i];
        const int32_t a = row[e];
        int ahead = 0;  // replicas before e in the order
        for (int j = 0; j < n && ahead < B; ++j) {
            const int32_t b = row[slots_s[j]];
            ahead += b > a || (b == a && j < i);
        }
        if (ahead >= B) group_row[e] = kInViewRow;
    }
    g.sync();  // the marks before the compaction reads them
    // Compaction in place: an item moves only to a lower position, and a pass's items are all read before any of its
    // writes (the sync), so every read sees the list as it was.
    int kept = 0;
    for (int base = 0; base < n; base += W) {
        const int i = base + g.lane;
        const int e = i < n ? slots_s[i] : -1;
        const int32_t keep = e >= 0 && group_row[e] != kInViewRow ? 1 : 0;
        g.sync();
        const int32_t incl = g.inclusive_sum(keep);
        if (keep != 0) slots_out[kept + incl - 1] = slots_s[kept + incl - 1] = e;
        kept += g.from_last(incl);
    }
    g.sync();
    for (int j = B + g.lane; j < n; j += W) slots_out[j] = slots_s[j] = -1;
    g.sync();  // the slot list before the group scan reads it
}

// The expert whose rows group gi of rank d holds (its size padded(row[e])), or -1 (a group without rows: an unused
// slot, a pad row, a serving view row of an expert d does not compute from it). The own experts' groups always count
// (group_row is set even when empty). Serving: a remote expert's view row holds its rows when it has rows on d and no
// slot (`marked`: d has more replicas than its B slots, slots_s[0, B) the chosen; else every replica has a slot). Reads
// only alloc and the slot list, which the group scan does not write.
FLATEP_HD int held_expert(const Layout& l, const int32_t* row, const int32_t* slots_s, bool marked, int d, int gi) {
    const int e = group_expert(l, slots_s, d, gi);
    if (!l.serving || e < 0 || gi >= l.first_slot_group() || l.home_rank(e) == d) return e;
    if (!marked || row[e] == 0) return -1;
    for (int j = 0; j < l.num_slots; ++j)
        if (slots_s[j] == e) return -1;
    return e;
}

// Task d: rank d's slots (replica experts in ascending id, then -1; serving: the B chosen by choose_slots; the static
// planner: its placement row as given, then -1), its group_row row (-1, then the start row of every group it holds),
// cu_seqlens (inclusive padded group ends), loads after and replicas in (the static planner: its placed slots). alloc:
// the allocation derived from; slot_s: a copy of slot_expert the group scan reads back (p.slot_expert itself, or
// scratch); placed: the static planner's placement (null slots for every other planner). Each lane takes G::kItems
// consecutive items per pass (its loads in flight together), the lanes in order, so a prefix sum of the lanes' counts
// places every item as the item-by-item walk would.
template <class G>
FLATEP_HD void derive_rank(const G& g, const Layout& l, const PlanView& p, const int32_t* alloc, int32_t* slot_s, int d,
                           DeriveSums& sums, PlacementView placed = {}) {
    const int E = l.num_experts, epn = l.experts_per_rank, lane = g.lane, num_groups = l.num_groups();
    constexpr int W = G::kWidth, Q = G::kItems;
    const int32_t* row = alloc + int64_t(d) * E;
    int32_t* group_row = p.group_row + int64_t(d) * E;
    int32_t* const slots_out = p.slot_expert + d * epn;
    int32_t* const slots_s = slot_s + d * epn;
    int32_t* const cu = p.cu_seqlens + int64_t(d) * num_groups;
    const bool fixed = placed.slots != nullptr;  // the static planner: the slots are the placement
    int count = 0;
    unsigned after = 0;
    for (int base = 0; base < E; base += W * Q) {
        const int first = base + lane * Q;
        int32_t a[Q];
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q) a[q] = first + q < E ? row[first + q] : 0;
        unsigned mine = 0;  // bit q: item first + q is a replica on d
        int n_mine = 0;
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q) {
            const int e = first + q;
            if (e < E) group_row[e] = -1;
            after += unsigned(a[q]);
            const bool pred = !fixed && a[q] > 0 && (e < d * epn || e >= (d + 1) * epn);
            mine |= unsigned(pred) << q;
            n_mine += pred;
        }
        // A rank hosts few replicas: most passes find none and skip the scan (same positions either way).
        if (!g.any(n_mine != 0)) continue;
        const int32_t incl = g.inclusive_sum(n_mine);
        int pos = count + incl - n_mine;
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q) {
            if (((mine >> q) & 1u) == 0) continue;
            if (pos < epn) slots_out[pos] = slots_s[pos] = first + q;
            ++pos;
        }
        count += g.from_last(incl);
    }
    if (fixed) {
        // Every slot of the placement, in its order, whether or not its copy has rows this step (its group is then
        // empty): the slots hold those weights until the next placement.
        int32_t placed_here = 0;
        for (int j = lane; j < epn; j += W) {
            const int32_t e = j < l.num_slots ? placed.slots[int64_t(d) * l.num_slots + j] : -1;
            slots_out[j] = slots_s[j] = e;
            placed_here += e >= 0 ? 1 : 0;
        }
        count = g.sum(placed_here);
    } else {
        for (int j = count + lane; j < epn; j += W) slots_out[j] = slots_s[j] = -1;
    }
    after = g.sum(after);
    if (lane == 0) {
        sums.loads_after[d] = int32_t(after);
        sums.replicas_in[d] = count;
    }
    g.sync();                                              // slot_s and the -1 row before the scan below
    const bool marked = l.serving && count > l.num_slots;  // uniform over the lanes
    if (marked) choose_slots(g, l, row, group_row, slots_out, slots_s, min_of(count, epn));
    int32_t start = 0;
    for (int g0 = 0; g0 < num_groups; g0 += W * Q) {
        const int first = g0 + lane * Q;
        int ex[Q];
        int32_t size[Q];
        int32_t mine = 0;
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q)
            ex[q] = first + q < num_groups ? held_expert(l, row, slots_s, marked, d, first + q) : -1;
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q) {
            size[q] = ex[q] >= 0 ? l.padded(row[ex[q]]) : 0;
            mine += size[q];
        }
        const int32_t incl = g.inclusive_sum(mine);
        int32_t end = start + incl - mine;
        FLATEP_DERIVE_UNROLL
        for (int q = 0; q < Q; ++q) {
            if (ex[q] >= 0) group_row[ex[q]] = end;
            end += size[q];
            if (first + q < num_groups) cu[first + q] = end;
        }
        start += g.from_last(incl);
    }
}

// Task R + chunk: keep / spill / take of experts [chunk*W, (chunk+1)*W), one per lane, the ranks in batches whose
// cells are loaded before any is stored; their loads before, replica copies (the static planner: placed copies, with
// rows this step or not) and entries (kept) added to sums.
template <class G>
FLATEP_HD void derive_experts(const G& g, const Layout& l, const PlanView& p, const int32_t* tpe, const int32_t* alloc,
                              int chunk, DeriveSums& sums, PlacementView placed = {}) {
    const int R = l.num_ranks, E = l.num_experts;
    constexpr int kBatch = 8;
    const int e = chunk * G::kWidth + g.lane;
    const bool valid = e < E;
    const int h = valid ? l.home_rank(e) : -1;
    int32_t spill = 0, take = 0, total = 0, copies = 0;
    int64_t kept = 0;
    for (int d0 = 0; d0 < R; d0 += kBatch) {
        int32_t tc[kBatch], ac[kBatch];
        FLATEP_DERIVE_UNROLL
        for (int j = 0; j < kBatch; ++j) {
            const int d = d0 + j;
            tc[j] = valid && d < R ? tpe[d * E + e] : 0;
            ac[j] = valid && d < R ? alloc[d * E + e] : 0;
        }
        FLATEP_DERIVE_UNROLL
        for (int j = 0; j < kBatch; ++j) {
            const int d = d0 + j;
            if (d >= R) break;  // uniform over the lanes
            const int32_t t = tc[j], a = ac[j];
            const int32_t k = t < a ? t : a;
            if (valid) {
                p.keep[d * E + e] = k;
                p.spill_start[d * E + e] = spill;
                p.take_start[d * E + e] = take;
            }
            spill += t - k;
            take += a - k;
            total += t;
            kept += k;
            const bool copy = placed.copy != nullptr ? valid && placed.copy[int64_t(d) * E + e] >= 0 : a > 0;
            copies += copy && h != d;
        }
    }
    // Lanes of the same home rank: one add per rank and lane group.
    const unsigned same = g.match(h);
    const unsigned group_total = g.sum_in(same, unsigned(total));
    const unsigned group_copies = g.sum_in(same, unsigned(copies));
    if (valid && g.leads(same)) {
        if (group_total != 0) g.add(&sums.loads_before[h], int32_t(group_total));
        if (group_copies != 0) g.add(&sums.replicas_out[h], int32_t(group_copies));
    }
    int64_t sum_kept = kept, sum_total = total;
    g.sum2(sum_kept, sum_total);
    if (g.lane == 0) {
        g.add(&sums.entries_on_source, (unsigned long long)sum_kept);
        g.add(&sums.entries_total, (unsigned long long)sum_total);
    }
}

// The statistics from the tasks' sums: the per-rank arrays over the executor's threads, the scalars by its first
// lane group (a reduction over the ranks).
template <class X, class G>
FLATEP_HD void derive_stats(const X& x, const G& g, const Layout& l, const DeriveSums& sums, PlanStats& st) {
    const int R = l.num_ranks;
    for (int r = x.thread(); r < kMaxRanks; r += x.threads()) {
        const bool in = r < R;
        st.loads_before[r] = in ? sums.loads_before[r] : 0;
        st.loads_after[r] = in ? sums.loads_after[r] : 0;
        st.replicas_in[r] = in ? sums.replicas_in[r] : 0;
        st.replicas_out[r] = in ? sums.replicas_out[r] : 0;
    }
    if (!x.first_lanes()) return;
    int32_t total_replicas = 0, max_before = 0, max_after = 0, min_after = INT32_MAX, max_in = 0, max_out = 0;
    for (int d = g.lane; d < R; d += G::kWidth) {
        total_replicas += sums.replicas_in[d];
        max_before = max_of(max_before, sums.loads_before[d]);
        max_after = max_of(max_after, sums.loads_after[d]);
        min_after = min_of(min_after, sums.loads_after[d]);
        max_in = max_of(max_in, sums.replicas_in[d]);
        max_out = max_of(max_out, sums.replicas_out[d]);
    }
    total_replicas = g.sum(total_replicas);
    max_before = g.max(max_before);
    max_after = g.max(max_after);
    min_after = g.min(min_after);
    max_in = g.max(max_in);
    max_out = g.max(max_out);
    if (g.lane == 0) {
        st.entries_total = int64_t(sums.entries_total);
        st.entries_on_source = int64_t(sums.entries_on_source);
        st.entries_moved = st.entries_total - st.entries_on_source;
        st.max_load_before = max_before;
        st.max_load_after = max_after;
        st.min_load_after = min_after;
        st.total_replicas = total_replicas;
        st.max_replicas_in = max_in;
        st.max_replicas_out = max_out;
        st.makespan = max_of(max_in, max_out);
    }
}

// derive_plan on executor x from the counts `tpe` and the allocation `alloc` (p.tpe_all / p.alloc, or copies of
// them); slot_s: [R*epn] words the rank tasks may overwrite (p.slot_expert itself, or scratch); sums: scratch the
// executor's threads share; placed: the static planner's placement (null slots otherwise). Writes every derived array
// of p and *p.stats.
template <class X>
FLATEP_HD void derive_plan(const X& x, const Layout& l, const PlanView& p, const int32_t* tpe, const int32_t* alloc,
                           int32_t* slot_s, DeriveSums& sums, PlacementView placed = {}) {
    const int R = l.num_ranks;
    // Every sum starts at 0, the rank tasks' own too (x.merge may add them all up in a pass of its own).
    for (int r = x.thread(); r < kMaxRanks; r += x.threads())
        sums.loads_before[r] = sums.replicas_out[r] = sums.loads_after[r] = sums.replicas_in[r] = 0;
    if (x.thread() == 0) sums.entries_total = sums.entries_on_source = 0;
    x.sync();
    const auto g = x.lanes();
    const int chunks = ceil_div(l.num_experts, int(g.kWidth));
    for (int task = x.first_task(); task < R + chunks; task += x.task_stride()) {
        if (task < R) {
            derive_rank(g, l, p, alloc, slot_s, task, sums, placed);
        } else {
            derive_experts(g, l, p, tpe, alloc, task - R, sums, placed);
        }
    }
    x.tasks_done();
    if (!x.merge(l, tpe, alloc, sums)) return;
    derive_stats(x, g, l, sums, *p.stats);
    x.done();
}

// derive_plan on one thread from p.tpe_all and p.alloc (the host planner, the serial GPU reference).
FLATEP_HD void derive_plan(const Layout& l, const PlanView& p, PlacementView placed = {}) {
    DeriveSums sums;
    derive_plan(SerialDerive{}, l, p, p.tpe_all, p.alloc, p.slot_expert, sums, placed);
}

}  // namespace flatep::planner
