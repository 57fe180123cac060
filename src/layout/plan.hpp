// The plan (design §4): what the planner produces from the all-gathered counts tpe_all[R][E], plus the
// per-rank routing of entries to rows. Every array has a size fixed by the Layout, so a plan lives in one
// allocation (host memory for the CPU backend, device memory for CUDA) and views of it are plain pointers.
//
// Split rule (which rank computes which entry; a documented function of tpe_all and alloc alone):
//   For expert e, the hosts are the ranks d with alloc[d][e] > 0 (its home and its replicas).
//   1. Keep: a host d keeps keep[d][e] = min(tpe[d][e], alloc[d][e]) of its own entries (locality).
//   2. Spill: the other entries of every source form one stream ordered by source rank, each source's entries in
//      (token, k) order; source s occupies [spill_start[s][e], spill_start[s][e] + tpe[s][e] - keep[s][e]).
//      Host d takes the stream range [take_start[d][e], take_start[d][e] + alloc[d][e] - keep[d][e]); hosts are
//      laid along the stream in ascending rank order.
//   So the j-th entry (in (token, k) order) of source s for expert e goes to s itself when j < keep[s][e], else to
//   the host d whose take range holds g = spill_start[s][e] + j - keep[s][e].
//   Row inside e's group on d (rows ordered by (source rank, token, k)):
//     kept entry:    clamp(spill_start[d][e] - take_start[d][e], 0, take_d) + j            (sources < d spill first)
//     spilled entry: (d < s ? keep[d][e] : 0) + g - take_start[d][e]
//   where take_d = alloc[d][e] - keep[d][e]. A source that hosts e never spills to itself (it keeps all it can).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/macros.hpp"
#include "flatep/types.hpp"
#include "layout/layout.hpp"

namespace flatep {

// Pointers into one plan allocation. Index conventions: [d*E + e] for per-(rank, expert) arrays;
// [d*epn + j] for slot_expert; [d*G + g] for cu_seqlens, G = Layout::num_groups() (2*epn, or R*Q + B serving).
struct PlanView {
    // Global part: identical on every rank.
    int32_t* tpe_all;      // [R][E] counts: entries of source s routed to expert e
    int32_t* alloc;        // [R][E] entries of expert e computed on rank d
    int32_t* keep;         // [R][E] entries of source d for expert e kept on d (0 unless d hosts e)
    int32_t* spill_start;  // [R][E] start of source s in e's spill stream
    int32_t* take_start;   // [R][E] start of host d's take range in e's spill stream
    int32_t* group_row;    // [R][E] first row of the group holding e's rows on rank d; -1 when d does not host e
    int32_t* slot_expert;  // [R][epn] expert held by each slot, -1 if none (every j >= B); slots sorted by expert id
    int32_t* cu_seqlens;   // [R][G] inclusive padded ends of the groups (grouped-GEMM offs), G = num_groups()
    PlanStats* stats;
    // Per-rank part: this rank's entries and rows.
    int32_t* entry_rank;  // [S*K] destination rank of entry (t,k) = t*K+k of this rank; -1 if its id was invalid
    int32_t* entry_row;   // [S*K] destination row of that entry on entry_rank
    int32_t* row_head;    // [NvS] rows of this rank: first row of the same (source, token) chain; -1 padding/unused
    int32_t* row_next;    // [NvS] next row of the same (source, token) on this rank (ascending k); -1 at the end
    int32_t* header;      // [kPlanHeaderWords]: see PlanHeader
};

// Small scalar header stored in the plan allocation (int32 words).
enum PlanHeader : int {
    kHeaderNumTokens = 0,  // tokens this rank passed to plan() (s <= S)
    kHeaderGenerationLo,   // generation id, low/high 32 bits (runtime stamps it)
    kHeaderGenerationHi,
    kHeaderPlanner,  // PlannerKind used
    kPlanHeaderWords = 8,
};

// The tokens this rank passed to plan() (s <= S): the rows every op of the step moves for this rank's tokens.
FLATEP_HD int plan_num_tokens(const PlanView& p) { return p.header[kHeaderNumTokens]; }

// Sizes and offsets (in int32 words) of every array of a plan allocation.
struct PlanSizes {
    int64_t tpe_all, alloc, keep, spill_start, take_start, group_row, slot_expert, cu_seqlens, stats;
    int64_t entry_rank, entry_row, row_head, row_next, header;
    int64_t total_words;
};

FLATEP_HD PlanSizes make_plan_sizes(const Layout& l) {
    PlanSizes s{};
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    const int64_t sk = int64_t(l.num_tokens) * l.topk;
    int64_t at = 0;
    auto take = [&at](int64_t words) {
        const int64_t start = at;
        at += (words + 63) / 64 * 64;  // keep every array 256-byte aligned
        return start;
    };
    s.tpe_all = take(re);
    s.alloc = take(re);
    s.keep = take(re);
    s.spill_start = take(re);
    s.take_start = take(re);
    s.group_row = take(re);
    s.slot_expert = take(int64_t(l.num_ranks) * l.experts_per_rank);
    s.cu_seqlens = take(int64_t(l.num_ranks) * l.num_groups());
    s.stats = take(int64_t(sizeof(PlanStats) + 3) / 4);
    s.entry_rank = take(sk);
    s.entry_row = take(sk);
    s.row_head = take(l.num_recv_rows);
    s.row_next = take(l.num_recv_rows);
    s.header = take(kPlanHeaderWords);
    s.total_words = at;
    return s;
}

// Views a plan allocation of at least make_plan_sizes(l).total_words int32 words (256-byte aligned base).
FLATEP_HD PlanView make_plan_view(const Layout& l, int32_t* base) {
    const PlanSizes s = make_plan_sizes(l);
    PlanView v{};
    v.tpe_all = base + s.tpe_all;
    v.alloc = base + s.alloc;
    v.keep = base + s.keep;
    v.spill_start = base + s.spill_start;
    v.take_start = base + s.take_start;
    v.group_row = base + s.group_row;
    v.slot_expert = base + s.slot_expert;
    v.cu_seqlens = base + s.cu_seqlens;
    v.stats = reinterpret_cast<PlanStats*>(base + s.stats);
    v.entry_rank = base + s.entry_rank;
    v.entry_row = base + s.entry_row;
    v.row_head = base + s.row_head;
    v.row_next = base + s.row_next;
    v.header = base + s.header;
    return v;
}

// The expert of group g of `rank` in the training layout (B == epn, design §5): its home expert rank*epn + g for
// g < epn, else the expert of slot g - epn (-1: an unused slot). `rank_slots` is that rank's [epn] row of
// slot_expert (a plan's, or a copy of it).
FLATEP_HD int group_expert(int experts_per_rank, const int32_t* rank_slots, int rank, int g) {
    const int epn = experts_per_rank;
    return g < epn ? rank * epn + g : rank_slots[g - epn];
}

// The expert whose weights group g (< l.num_groups()) of `rank` reads, in either layout (layout.hpp): training as
// above; serving: view row g's expert (g / Q)*epn + g % Q for g < R*Q (-1: a pad row), else slot g - R*Q's expert
// (-1: unused). A serving view row's expert may have no rows on `rank` (the group is then empty: cu_seqlens). Every
// backend reads a group's expert through this function (or the PlanView form below).
FLATEP_HD int group_expert(const Layout& l, const int32_t* rank_slots, int rank, int g) {
    const int epn = l.experts_per_rank;
    if (!l.serving) return group_expert(epn, rank_slots, rank, g);
    const int Q = l.view_stride, slot0 = l.first_slot_group();
    if (g >= slot0) return rank_slots[g - slot0];
    const int local = g % Q;
    return local < epn ? (g / Q) * epn + local : -1;
}

FLATEP_HD int group_expert(const Layout& l, const PlanView& p, int rank, int g) {
    return group_expert(l, p.slot_expert + int64_t(rank) * l.experts_per_rank, rank, g);
}

// Entries (real rows) of group g of `rank`: its expert's allocation on `rank` when the group is non-empty
// (cu_seqlens), else 0 (an unused slot, a pad row, or a serving view row whose expert is not computed there from it).
// Its rows are [start, start + entries) with start = g == 0 ? 0 : cu[g - 1], the rest up to cu[g] padding.
FLATEP_HD int32_t group_entries(const Layout& l, const PlanView& p, int rank, int g) {
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * l.num_groups();
    const int32_t start = g == 0 ? 0 : cu[g - 1];
    if (cu[g] == start) return 0;
    const int expert = group_expert(l, p, rank, g);
    return expert < 0 ? 0 : p.alloc[int64_t(rank) * l.num_experts + expert];
}

// The group holding receive row r of a rank whose G inclusive group ends are cu[] (its cu_seqlens): the first end
// above r, or G when r is past the last end. Binary search; the host and the kernels share it.
FLATEP_HD int find_group(const int32_t* cu, int G, int64_t r) {
    int lo = 0, hi = G;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (cu[mid] > r) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return lo;
}

// Where the j-th entry (in (token, k) order) of source `src` for `expert` is computed: rank and row.
// Pure arithmetic on the global part of the plan; the host and CUDA routing both call it.
struct EntryPlace {
    int32_t rank;
    int32_t row;
};

FLATEP_HD EntryPlace place_entry(const Layout& l, const PlanView& p, int src, int expert, int j) {
    const int E = l.num_experts;
    const int32_t keep_s = p.keep[src * E + expert];
    if (j < keep_s) {
        const int32_t take_s = p.alloc[src * E + expert] - keep_s;
        int64_t before = int64_t(p.spill_start[src * E + expert]) - p.take_start[src * E + expert];
        before = before < 0 ? 0 : (before > take_s ? take_s : before);
        return EntryPlace{src, int32_t(p.group_row[src * E + expert] + before + j)};
    }
    const int64_t g = int64_t(p.spill_start[src * E + expert]) + (j - keep_s);
    // Hosts are laid along the stream in ascending rank order: the host of g is the last rank d whose take range
    // starts at or before g and is non-empty.
    int dst = -1;
    for (int d = 0; d < l.num_ranks; ++d) {
        const int32_t take_d = p.alloc[d * E + expert] - p.keep[d * E + expert];
        if (take_d > 0 && p.take_start[d * E + expert] <= g && g < int64_t(p.take_start[d * E + expert]) + take_d) {
            dst = d;
            break;
        }
    }
    if (dst < 0) return EntryPlace{-1, -1};  // unreachable for a consistent plan
    const int64_t row = int64_t(p.group_row[dst * E + expert]) + (dst < src ? p.keep[dst * E + expert] : 0) +
                        (g - p.take_start[dst * E + expert]);
    return EntryPlace{dst, int32_t(row)};
}

// The row chains of one token (design §5) pushed to its destinations: for each rank d among ranks[0, K) (-1: a
// dropped entry), the token's rows on d in ascending k; every one of them gets head = the first of those rows and
// next = the one after it (-1 after the last), written to d's row_head / row_next staging (peers[d] is d's
// symmetric buffer as mapped here). rows[k]: entry k's row on ranks[k]. The host and CUDA plan ops both call it.
FLATEP_HD void push_token_chains(const SymmetricLayout& sym, uint8_t* const* peers, const int32_t* ranks,
                                 const int32_t* rows, int K) {
    for (int k = 0; k < K; ++k) {
        const int d = ranks[k];
        if (d < 0) continue;
        bool seen = false;
        for (int k0 = 0; k0 < k && !seen; ++k0) seen = ranks[k0] == d;
        if (seen) continue;  // not the token's first entry on d: written with that one's chain
        int32_t* head = region_at<int32_t>(peers[d], sym.row_head_offset);
        int32_t* next = region_at<int32_t>(peers[d], sym.row_next_offset);
        int32_t row = rows[k];
        for (int k1 = k + 1; k1 <= K; ++k1) {
            if (k1 < K && ranks[k1] != d) continue;
            head[row] = rows[k];
            next[row] = k1 < K ? rows[k1] : -1;
            if (k1 < K) row = rows[k1];
        }
    }
}

}  // namespace flatep
