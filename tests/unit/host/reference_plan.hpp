// An oracle for everything of a plan that follows from the counts and the allocation, written from the contract
// (design §4 constraint 4 and §5; the split rule in layout/plan.hpp's header comment) and calling no FlatEP code:
// which rank computes each entry, at which row, the slots and the padded group ends. The allocation itself is the
// planner's choice (pinned by tests/unit/planner); alloc_violation checks it against design §4's constraints.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace flatep::testing {

struct ReferencePlan {
    int R = 0, E = 0, epn = 0, align = 1;
    int num_groups = 0;                // 2*epn (training) or R*Q + B (serving)
    std::vector<int32_t> slot_expert;  // [R][epn] slot experts of each rank in ascending id, then -1
    std::vector<int32_t> cu_seqlens;   // [R][num_groups] inclusive padded group ends
    std::vector<int32_t> group_start;  // [R][E] first row of e's group on rank d, -1 when d does not host e
    std::vector<int32_t> group_of;     // [R][E] the group holding e's rows on rank d, -1 when d does not host e
    // Per source s: [s's entries] destination rank and row of its entry i = t*K + k (-1 for an invalid id).
    std::vector<std::vector<int32_t>> entry_rank, entry_row;
};

// Group ends and slots from the allocation alone, for B slots per rank and Q view rows per rank (B = -1 or E/R: the
// training layout). Training: groups g < epn are d's own experts d*epn + g, groups epn + j its replicas in ascending
// expert id. Serving (B < epn): the replicas of d ordered by (rows on d descending, id ascending), the first B get the
// slots (in ascending id); groups g < R*Q are the view rows (rank g / Q's expert g % Q, or padding when g % Q >= epn),
// holding that expert's rows when it is d's own or a replica of d without a slot; groups R*Q + j the slots. A
// non-empty group is padded to a multiple of align. A static plan (placement: [R][B] expert ids, -1 empty) has the
// placement as its slots instead, in the placement's order, each slot's group holding its expert's rows (none or
// some).
inline ReferencePlan reference_groups(int R, int E, int align, const std::vector<int32_t>& alloc, int B = -1, int Q = 0,
                                      const std::vector<int32_t>* placement = nullptr) {
    ReferencePlan p;
    p.R = R, p.E = E, p.epn = E / R, p.align = align;
    const int epn = p.epn;
    if (B < 0) B = epn;
    if (Q == 0) Q = epn;
    const bool serving = B < epn;
    p.num_groups = serving ? R * Q + B : 2 * epn;
    const int G = p.num_groups;
    p.slot_expert.assign(size_t(R) * epn, -1);
    p.cu_seqlens.assign(size_t(R) * G, 0);
    p.group_start.assign(size_t(R) * E, -1);
    p.group_of.assign(size_t(R) * E, -1);
    for (int d = 0; d < R; ++d) {
        std::vector<int> replicas;  // ascending id
        for (int e = 0; e < E; ++e)
            if (e / epn != d && alloc[size_t(d) * E + e] > 0) replicas.push_back(e);
        std::vector<int> slotted = replicas;
        if (placement != nullptr) {
            slotted.assign(placement->begin() + int64_t(d) * B, placement->begin() + int64_t(d + 1) * B);
        } else if (serving) {
            std::vector<int> by_rows = replicas;
            std::stable_sort(by_rows.begin(), by_rows.end(),
                             [&](int a, int b) { return alloc[size_t(d) * E + a] > alloc[size_t(d) * E + b]; });
            by_rows.resize(std::min(by_rows.size(), size_t(B)));
            slotted.clear();
            for (int e : replicas)
                if (std::find(by_rows.begin(), by_rows.end(), e) != by_rows.end()) slotted.push_back(e);
        }
        for (size_t j = 0; j < slotted.size() && int(j) < epn; ++j) p.slot_expert[size_t(d) * epn + j] = slotted[j];
        std::vector<int> groups;  // the expert whose rows each group holds, -1 for none
        if (!serving) {
            for (int g = 0; g < epn; ++g) groups.push_back(d * epn + g);
            for (int j = 0; j < epn; ++j) groups.push_back(j < int(slotted.size()) ? slotted[j] : -1);
        } else {
            for (int g = 0; g < R * Q; ++g) {
                const int h = g / Q, i = g % Q, e = h * epn + i;
                const bool remote = i < epn && h != d && alloc[size_t(d) * E + e] > 0 &&
                                    std::find(slotted.begin(), slotted.end(), e) == slotted.end();
                groups.push_back(i < epn && (h == d || remote) ? e : -1);
            }
            for (int j = 0; j < B; ++j) groups.push_back(j < int(slotted.size()) ? slotted[j] : -1);
        }
        int32_t end = 0;
        for (int g = 0; g < G; ++g) {
            const int e = groups[g];
            if (e >= 0) {
                p.group_start[size_t(d) * E + e] = end;
                p.group_of[size_t(d) * E + e] = g;
                const int32_t rows = alloc[size_t(d) * E + e];
                end += (rows + align - 1) / align * align;
            }
            p.cu_seqlens[size_t(d) * G + g] = end;
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
                                    const std::vector<std::vector<int32_t>>& topk_idx, int B = -1, int Q = 0,
                                    const std::vector<int32_t>* placement = nullptr) {
    ReferencePlan p = reference_groups(R, E, align, alloc, B, Q, placement);
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
