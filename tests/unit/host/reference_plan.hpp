// An oracle for everything of a plan that follows from the counts and the allocation, written from the contract
// (design §4 constraint 4 and §5; the split rule in layout/plan.hpp's header comment) and calling no FlatEP code:
// which rank computes each entry, at which row, the slots and the padded group ends. The allocation itself is the
// planner's choice (pinned by tests/unit/planner); alloc_violation checks it against design §4's constraints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flatep::testing {

struct ReferencePlan {
    int R = 0, E = 0, epn = 0, align = 1;
    std::vector<int32_t> slot_expert;  // [R][epn] replica experts of each rank in ascending id, then -1
    std::vector<int32_t> cu_seqlens;   // [R][2*epn] inclusive padded group ends
    std::vector<int32_t> group_start;  // [R][E] first row of e's group on rank d, -1 when d does not host e
    // Per source s: [s's entries] destination rank and row of its entry i = t*K + k (-1 for an invalid id).
    std::vector<std::vector<int32_t>> entry_rank, entry_row;
};

// Group ends and slots from the allocation alone: groups g < epn are d's own experts d*epn + g, groups epn + j its
// replicas in ascending expert id; a non-empty group is padded to a multiple of align.
inline ReferencePlan reference_groups(int R, int E, int align, const std::vector<int32_t>& alloc) {
    ReferencePlan p;
    p.R = R, p.E = E, p.epn = E / R, p.align = align;
    const int epn = p.epn;
    p.slot_expert.assign(size_t(R) * epn, -1);
    p.cu_seqlens.assign(size_t(R) * 2 * epn, 0);
    p.group_start.assign(size_t(R) * E, -1);
    for (int d = 0; d < R; ++d) {
        std::vector<int> groups;
        for (int g = 0; g < epn; ++g) groups.push_back(d * epn + g);
        int j = 0;
        for (int e = 0; e < E; ++e) {
            if (e / epn != d && alloc[size_t(d) * E + e] > 0) {
                if (j < epn) p.slot_expert[size_t(d) * epn + j] = e;
                groups.push_back(e);
                ++j;
            }
        }
        int32_t end = 0;
        for (int g = 0; g < 2 * epn; ++g) {
            if (g < int(groups.size())) {
                const int e = groups[g];
                p.group_start[size_t(d) * E + e] = end;
                const int32_t rows = alloc[size_t(d) * E + e];
                end += (rows + align - 1) / align * align;
            }
            p.cu_seqlens[size_t(d) * 2 * epn + g] = end;
        }
    }
    return p;
}

// The full reference: groups as above, then every source's entries placed by the split rule. topk_idx[s] holds
// source s's ids in (token, k) order (ids outside [0, E) are not entries). For expert e, host d keeps
// min(tpe[d][e], alloc[d][e]) of its own entries (its first ones); the other entries of every source form one stream,
// sources in ascending rank, each in (token, k) order, cut among the hosts in ascending rank into alloc - kept
// pieces. Inside a group rows follow (source rank, token, k).
inline ReferencePlan reference_plan(int R, int E, int align, const std::vector<int32_t>& alloc,
                                    const std::vector<std::vector<int32_t>>& topk_idx) {
    ReferencePlan p = reference_groups(R, E, align, alloc);
    std::vector<int64_t> tpe(size_t(R) * E, 0);
    for (int s = 0; s < R; ++s) {
        for (int32_t e : topk_idx[s]) {
            if (e >= 0 && e < E) ++tpe[size_t(s) * E + e];
        }
    }
    auto kept = [&](int d, int e) { return std::min<int64_t>(tpe[size_t(d) * E + e], alloc[size_t(d) * E + e]); };
    // The host of position g of e's spill stream.
    auto host_of = [&](int e, int64_t g) {
        int64_t start = 0;
        for (int d = 0; d < R; ++d) {
            const int64_t take = alloc[size_t(d) * E + e] - kept(d, e);
            if (g < start + take) return d;
            start += take;
        }
        return -1;  // more entries than the allocation holds: the allocation is wrong
    };
    std::vector<int64_t> spill_before(size_t(E), 0);  // stream position of the next source's first spilled entry
    std::vector<int32_t> next_row(size_t(R) * E, 0);  // rows of (d, e) handed out so far
    p.entry_rank.resize(R);
    p.entry_row.resize(R);
    for (int s = 0; s < R; ++s) {
        std::vector<int64_t> seen(size_t(E), 0);
        for (int32_t e : topk_idx[s]) {
            if (e < 0 || e >= E) {
                p.entry_rank[s].push_back(-1);
                p.entry_row[s].push_back(-1);
                continue;
            }
            const int64_t j = seen[size_t(e)]++;
            const int d = j < kept(s, e) ? s : host_of(e, spill_before[size_t(e)] + j - kept(s, e));
            p.entry_rank[s].push_back(d);
            p.entry_row[s].push_back(d < 0 ? -1 : p.group_start[size_t(d) * E + e] + next_row[size_t(d) * E + e]++);
        }
        for (int e = 0; e < E; ++e) spill_before[size_t(e)] += tpe[size_t(s) * E + e] - kept(s, e);
    }
    return p;
}

// "" when `alloc` meets design §4's constraints for counts tpe (R x E) and capacity C (exact: every rank computes
// floor(N/R) or ceil(N/R) entries, the lower ranks the larger; slack: at most C), else what it breaks: conservation
// (every expert's T_e entries computed somewhere), no negative cell, at most epn replicas per rank.
inline std::string alloc_violation(int R, int E, bool exact, int64_t capacity, const std::vector<int32_t>& tpe,
                                   const std::vector<int32_t>& alloc) {
    const int epn = E / R;
    int64_t n = 0;
    for (int e = 0; e < E; ++e) {
        int64_t t = 0, a = 0;
        for (int d = 0; d < R; ++d) {
            t += tpe[size_t(d) * E + e];
            a += alloc[size_t(d) * E + e];
            if (alloc[size_t(d) * E + e] < 0) return "alloc[" + std::to_string(d) + "][" + std::to_string(e) + "] < 0";
        }
        if (t != a)
            return "expert " + std::to_string(e) + ": T_e = " + std::to_string(t) + ", allocated " + std::to_string(a);
        n += t;
    }
    for (int d = 0; d < R; ++d) {
        int64_t load = 0;
        int replicas = 0;
        for (int e = 0; e < E; ++e) {
            load += alloc[size_t(d) * E + e];
            replicas += e / epn != d && alloc[size_t(d) * E + e] > 0;
        }
        const int64_t want = n / R + (d < n % R ? 1 : 0);
        if (exact && load != want)
            return "rank " + std::to_string(d) + " computes " + std::to_string(load) + ", not " + std::to_string(want);
        if (!exact && load > capacity)
            return "rank " + std::to_string(d) + " computes " + std::to_string(load) + " > C";
        if (replicas > epn) return "rank " + std::to_string(d) + " hosts " + std::to_string(replicas) + " replicas";
    }
    return "";
}

}  // namespace flatep::testing
