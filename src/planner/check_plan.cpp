// check_plan: an independent, deliberately plain re-derivation of everything a plan must satisfy (design §4
// constraints 1-4, plan.hpp's split rule, design §5's groups, the statistics), used by tests and debug builds.
// It shares no code with planner_core.hpp except place_entry, whose output it checks against the rows each group
// must hold.
#include <algorithm>
#include <vector>

#include "common/check.hpp"
#include "planner/planner.hpp"
#include "planner/static_placement.hpp"

namespace flatep::planner {

namespace {
using detail::concat;

// copies[d][e]: d computes a replica of e (rows on d; the static planner: e in d's placement, rows or not).
std::string check_stats(const Layout& l, const PlanView& p, const std::vector<int64_t>& group_load,
                        const std::vector<std::vector<char>>& copies) {
    const int R = l.num_ranks, E = l.num_experts;
    const PlanStats& st = *p.stats;
    int64_t total = 0, on_source = 0;
    std::vector<int32_t> in(R, 0), out(R, 0), after(R, 0);
    for (int d = 0; d < R; ++d) {
        for (int e = 0; e < E; ++e) {
            const int32_t a = p.alloc[d * E + e], t = p.tpe_all[d * E + e];
            total += t;
            on_source += std::min(a, t);
            after[d] += a;
            if (copies[d][e]) ++in[d], ++out[l.home_rank(e)];
        }
    }
    auto field = [](const char* name, int64_t got, int64_t want) -> std::string {
        return got == want ? "" : concat("stats.", name, " is ", got, ", expected ", want);
    };
    std::string m;
    if (!(m = field("entries_total", st.entries_total, total)).empty()) return m;
    if (!(m = field("entries_on_source", st.entries_on_source, on_source)).empty()) return m;
    if (!(m = field("entries_moved", st.entries_moved, total - on_source)).empty()) return m;
    const int32_t max_before = int32_t(*std::max_element(group_load.begin(), group_load.end()));
    if (!(m = field("max_load_before", st.max_load_before, max_before)).empty()) return m;
    if (!(m = field("max_load_after", st.max_load_after, *std::max_element(after.begin(), after.end()))).empty())
        return m;
    if (!(m = field("min_load_after", st.min_load_after, *std::min_element(after.begin(), after.end()))).empty())
        return m;
    int32_t total_in = 0, max_in = 0, max_out = 0;
    for (int r = 0; r < kMaxRanks; ++r) {
        const bool live = r < R;
        const std::string idx = concat("[", r, "]");
        if (!(m = field(("loads_before" + idx).c_str(), st.loads_before[r], live ? group_load[r] : 0)).empty())
            return m;
        if (!(m = field(("loads_after" + idx).c_str(), st.loads_after[r], live ? after[r] : 0)).empty()) return m;
        if (!(m = field(("replicas_in" + idx).c_str(), st.replicas_in[r], live ? in[r] : 0)).empty()) return m;
        if (!(m = field(("replicas_out" + idx).c_str(), st.replicas_out[r], live ? out[r] : 0)).empty()) return m;
        if (live) total_in += in[r], max_in = std::max(max_in, in[r]), max_out = std::max(max_out, out[r]);
    }
    if (!(m = field("total_replicas", st.total_replicas, total_in)).empty()) return m;
    if (!(m = field("max_replicas_in", st.max_replicas_in, max_in)).empty()) return m;
    if (!(m = field("max_replicas_out", st.max_replicas_out, max_out)).empty()) return m;
    return field("makespan", st.makespan, std::max(max_in, max_out));
}
}  // namespace

// The static planner's slot table (design §4 "The static planner"): rank d's first B slots are its placement row, the
// others -1; the placement is valid and, when `placement` is given, the one the plan was made for. Fills slotted.
std::string check_static_slots(const Layout& l, const PlanView& p, const int32_t* placement,
                               std::vector<std::vector<char>>& slotted) {
    const int R = l.num_ranks, epn = l.experts_per_rank, B = l.num_slots;
    std::vector<int32_t> rows(size_t(R) * B);
    for (int d = 0; d < R; ++d) {
        for (int j = 0; j < epn; ++j) {
            const int32_t e = p.slot_expert[d * epn + j];
            if (j < B) {
                rows[size_t(d) * B + j] = e;
                if (placement != nullptr && e != placement[d * B + j])
                    return concat("slot_expert[", d, "][", j, "] = ", e, ", expected the placement's ",
                                  placement[d * B + j]);
            } else if (e != -1) {
                return concat("slot_expert[", d, "][", j, "] = ", e, ", expected -1 (slot ", j, " >= B = ", B, ")");
            }
        }
    }
    const std::string bad = check_placement(l, rows);
    if (!bad.empty()) return "static slots: " + bad;
    for (int d = 0; d < R; ++d)
        for (int j = 0; j < B; ++j)
            if (rows[size_t(d) * B + j] >= 0) slotted[d][rows[size_t(d) * B + j]] = 1;
    return "";
}

// The split rule of the static planner, written out: e's copies are its home and its slot holders in ascending rank,
// each floor(T_e / n) entries, one more for the T_e mod n copies from copy e mod n on, cyclically.
std::string check_static_split(const Layout& l, const PlanView& p, const std::vector<std::vector<char>>& slotted) {
    const int R = l.num_ranks, E = l.num_experts;
    for (int e = 0; e < E; ++e) {
        std::vector<int> hosts;
        int64_t t = 0;
        for (int d = 0; d < R; ++d) {
            t += p.tpe_all[int64_t(d) * E + e];
            if (d == l.home_rank(e) || slotted[d][e]) hosts.push_back(d);
        }
        const int64_t n = int64_t(hosts.size());
        std::vector<int64_t> want(R, 0);
        for (int64_t c = 0; c < n; ++c) want[hosts[size_t(c)]] = t / n + (((c - e % n) + n) % n < t % n ? 1 : 0);
        for (int d = 0; d < R; ++d) {
            if (p.alloc[int64_t(d) * E + e] != want[d])
                return concat("static split: alloc[", d, "][", e, "] = ", p.alloc[int64_t(d) * E + e], ", expected ",
                              want[d], " (T_e = ", t, " over ", n, " copies)");
        }
    }
    return "";
}

std::string check_plan(const Layout& l, const PlanView& p, const int32_t* placement) {
    const std::string bad_counts = validate_counts(l, p.tpe_all);
    if (!bad_counts.empty()) return "counts: " + bad_counts;
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank;
    auto at = [E](int d, int e) { return int64_t(d) * E + e; };

    // Constraint 1 (conservation) and non-negative alloc.
    int64_t n = 0;
    std::vector<int64_t> group_load(R, 0);
    for (int e = 0; e < E; ++e) {
        int64_t t = 0, a = 0;
        for (int d = 0; d < R; ++d) {
            if (p.alloc[at(d, e)] < 0) return concat("alloc[", d, "][", e, "] = ", p.alloc[at(d, e)], " is negative");
            t += p.tpe_all[at(d, e)];
            a += p.alloc[at(d, e)];
        }
        if (t != a) return concat("conservation: expert ", e, " has T_e = ", t, " entries but alloc sums to ", a);
        n += t;
        group_load[l.home_rank(e)] += t;
    }
    // Constraint 2 (balance); the owner planner instead keeps every entry on its expert's home rank.
    for (int d = 0; d < R; ++d) {
        int64_t load = 0;
        for (int e = 0; e < E; ++e) load += p.alloc[at(d, e)];
        if (l.placed) {
            if (load > l.capacity)
                return concat("static: rank ", d, " computes ", load, " entries, above capacity R*S*K = ", l.capacity);
        } else if (l.owner) {
            for (int e = 0; e < E; ++e) {
                if (l.home_rank(e) != d && p.alloc[at(d, e)] != 0)
                    return concat("owner: alloc[", d, "][", e, "] = ", p.alloc[at(d, e)], ", expected 0 (home rank ",
                                  l.home_rank(e), ")");
            }
            if (load > l.capacity)
                return concat("owner: rank ", d, " computes ", load, " entries, above capacity R*S*K = ", l.capacity);
        } else if (l.exact) {
            const int64_t want = n / R + (d < n % R ? 1 : 0);
            if (load != want) return concat("balance: rank ", d, " computes ", load, " entries, expected ", want);
        } else if (load > l.capacity) {
            return concat("balance: rank ", d, " computes ", load, " entries, above capacity C = ", l.capacity);
        }
    }
    // Constraint 3 (slots) and the slot table: the replicas in ascending id (training), or the B with the most rows
    // on d (ties to the lower id), in ascending id (serving).
    std::vector<std::vector<char>> slotted(R, std::vector<char>(E, 0));
    std::vector<std::vector<char>> copies(R, std::vector<char>(E, 0));
    if (l.placed) {
        const std::string bad = check_static_slots(l, p, placement, slotted);
        if (!bad.empty()) return bad;
        const std::string split = check_static_split(l, p, slotted);
        if (!split.empty()) return split;
        copies = slotted;
    }
    for (int d = 0; d < R && !l.placed; ++d) {
        std::vector<int32_t> replicas;
        for (int e = 0; e < E; ++e)
            if (p.alloc[at(d, e)] > 0 && l.home_rank(e) != d) replicas.push_back(e);
        if (int(replicas.size()) > epn)
            return concat("slots: rank ", d, " hosts ", replicas.size(), " replicas, more than epn = ", epn);
        std::vector<int32_t> slots = replicas;
        std::stable_sort(slots.begin(), slots.end(), [&](int32_t a, int32_t b) {
            return p.alloc[at(d, a)] > p.alloc[at(d, b)];  // stable: equal rows keep ascending id
        });
        if (int(slots.size()) > l.num_slots) slots.resize(size_t(l.num_slots));
        std::sort(slots.begin(), slots.end());
        for (int32_t e : slots) slotted[d][e] = 1;
        for (int32_t e : replicas) copies[d][e] = 1;
        for (int j = 0; j < epn; ++j) {
            const int32_t want = j < int(slots.size()) ? slots[j] : -1;
            if (p.slot_expert[d * epn + j] != want)
                return concat("slot_expert[", d, "][", j, "] = ", p.slot_expert[d * epn + j], ", expected ", want);
        }
    }
    // Split-rule arrays (plan.hpp).
    for (int e = 0; e < E; ++e) {
        int64_t spill = 0, take = 0;
        for (int d = 0; d < R; ++d) {
            const int32_t keep = std::min(p.tpe_all[at(d, e)], p.alloc[at(d, e)]);
            if (p.keep[at(d, e)] != keep)
                return concat("keep[", d, "][", e, "] = ", p.keep[at(d, e)], ", expected ", keep);
            if (p.spill_start[at(d, e)] != spill)
                return concat("spill_start[", d, "][", e, "] = ", p.spill_start[at(d, e)], ", expected ", spill);
            if (p.take_start[at(d, e)] != take)
                return concat("take_start[", d, "][", e, "] = ", p.take_start[at(d, e)], ", expected ", take);
            spill += p.tpe_all[at(d, e)] - keep;
            take += p.alloc[at(d, e)] - keep;
        }
    }
    // Groups: cu_seqlens and group_row, written from design §5's two layouts. `weights`: the expert whose weights the
    // group reads (group_expert); `holds`: the expert whose rows it holds on d (its own experts always, empty or not).
    const int G = l.num_groups(), Q = l.view_stride;
    for (int d = 0; d < R; ++d) {
        int64_t row = 0;
        std::vector<int32_t> want_row(E, -1);
        for (int g = 0; g < G; ++g) {
            int weights = -1, holds = -1;
            if (!l.serving) {
                weights = g < epn ? d * epn + g : p.slot_expert[d * epn + g - epn];
                holds = weights;
            } else if (g >= R * Q) {
                weights = holds = p.slot_expert[d * epn + g - R * Q];
            } else if (g % Q < epn) {
                weights = (g / Q) * epn + g % Q;
                const bool own = g / Q == d, replica = p.alloc[at(d, weights)] > 0 && !slotted[d][weights];
                holds = own || replica ? weights : -1;
            }
            if (group_expert(l, p, d, g) != weights)
                return concat("group_expert(rank ", d, ", group ", g, ") = ", group_expert(l, p, d, g), ", expected ",
                              weights);
            if (holds >= 0) {
                want_row[holds] = int32_t(row);
                row += l.padded(p.alloc[at(d, holds)]);
            }
            if (p.cu_seqlens[int64_t(d) * G + g] != row)
                return concat("cu_seqlens[", d, "][", g, "] = ", p.cu_seqlens[int64_t(d) * G + g], ", expected ", row);
        }
        if (row > l.num_recv_rows)
            return concat("rank ", d, " uses ", row, " rows, more than the receive buffer's NvS = ", l.num_recv_rows);
        for (int e = 0; e < E; ++e)
            if (p.group_row[at(d, e)] != want_row[e])
                return concat("group_row[", d, "][", e, "] = ", p.group_row[at(d, e)], ", expected ", want_row[e]);
    }
    // Constraint 4 (placement): the rows place_entry gives all sources' entries of e on d are exactly
    // [group_row, group_row + alloc) in (source, j) order, each once.
    std::vector<int64_t> next(R);
    for (int e = 0; e < E; ++e) {
        for (int d = 0; d < R; ++d) next[d] = p.group_row[at(d, e)];
        for (int s = 0; s < R; ++s) {
            for (int j = 0; j < p.tpe_all[at(s, e)]; ++j) {
                const EntryPlace place = place_entry(l, p, s, e, j);
                if (place.rank < 0 || place.rank >= R || p.alloc[at(place.rank, e)] <= 0)
                    return concat("placement: entry ", j, " of source ", s, " for expert ", e, " goes to rank ",
                                  place.rank, ", which does not host it");
                if (place.row != next[place.rank])
                    return concat("placement: entry ", j, " of source ", s, " for expert ", e, " goes to row ",
                                  place.row, " of rank ", place.rank, ", expected ", next[place.rank]);
                ++next[place.rank];
            }
        }
        for (int d = 0; d < R; ++d) {
            const int64_t end = p.group_row[at(d, e)] + (p.alloc[at(d, e)] > 0 ? p.alloc[at(d, e)] : 0);
            if (p.group_row[at(d, e)] >= 0 && next[d] != end)
                return concat("placement: expert ", e, " on rank ", d, " receives ", next[d] - p.group_row[at(d, e)],
                              " entries, expected ", p.alloc[at(d, e)]);
        }
    }
    return check_stats(l, p, group_load, copies);
}

}  // namespace flatep::planner
