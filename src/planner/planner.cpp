// Host entry points of the planner: allocate the workspace, validate the counts, run the shared core.
#include "planner/planner.hpp"

#include <cstring>

#include "common/check.hpp"
#include "ops/plan_args.hpp"
#include "planner/planner_core.hpp"

namespace flatep {

const char* planner_name(PlannerKind kind) {
    switch (kind) {
        case PlannerKind::kGreedy:
            return "greedy";
        case PlannerKind::kBalanced:
            return "balanced";
        case PlannerKind::kOwner:
            return "owner";
        case PlannerKind::kStatic:
            return "static";
    }
    return "unknown";
}

PlannerKind planner_from_name(const std::string& name) {
    for (const PlannerKind kind :
         {PlannerKind::kGreedy, PlannerKind::kBalanced, PlannerKind::kOwner, PlannerKind::kStatic})
        if (name == planner_name(kind)) return kind;
    FLATEP_CHECK(false, "planner must be 'greedy', 'balanced', 'owner' or 'static', got '", name, "'");
    return PlannerKind::kBalanced;
}

}  // namespace flatep

namespace flatep::planner {

HostPlan::HostPlan(const Layout& l)
    : layout(l),
      // 64 extra words so the base can be moved to a 256-byte boundary.
      storage(size_t(make_plan_sizes(l).total_words) + 64, 0),
      view{} {
    int32_t* base = storage.data();
    const uintptr_t misalign = reinterpret_cast<uintptr_t>(base) % 256;
    if (misalign != 0) base += (256 - misalign) / sizeof(int32_t);
    view = make_plan_view(l, base);
}

std::string validate_counts(const Layout& l, const int32_t* tpe_all) {
    if (tpe_all == nullptr) return "tpe_all is null";
    const int R = l.num_ranks, E = l.num_experts;
    const int64_t limit = int64_t(l.num_tokens) * l.topk;
    for (int s = 0; s < R; ++s) {
        int64_t sum = 0;
        for (int e = 0; e < E; ++e) {
            const int32_t v = tpe_all[int64_t(s) * E + e];
            if (v < 0) return detail::concat("tpe_all[", s, "][", e, "] = ", v, " is negative");
            sum += v;
        }
        if (sum > limit)
            return detail::concat("tpe_all row ", s, " sums to ", sum, ", above S*K = ", limit, " (S=", l.num_tokens,
                                  ", K=", l.topk, ")");
    }
    return "";
}

const char* layout_kind_name(const Layout& l) {
    return l.owner ? "the owner planner" : l.placed ? "the static planner" : "a balancing planner";
}

void plan_counts(const Layout& l, PlannerKind kind, const PlanView& p, const int32_t* placement) {
    check_planner_kind(kind);
    FLATEP_CHECK(layout_fits(l, kind), "planner ", planner_name(kind), " on a layout made for ", layout_kind_name(l),
                 ": make_layout(config, planner) with the same kind");
    FLATEP_CHECK(kind != PlannerKind::kStatic || placement != nullptr,
                 "planner static needs a placement table (make_placement_table), got null");
    const std::string bad = validate_counts(l, p.tpe_all);
    FLATEP_CHECK(bad.empty(), bad);
    if (kind == PlannerKind::kStatic) {
        const PlacementView placed = make_placement_view(l, placement);
        for (int e = 0; e < l.num_experts; ++e) static_alloc_expert(l, p.tpe_all, placed, p.alloc, e);
        derive_plan(l, p, placed);
        return;
    }
    std::vector<int32_t> workspace(size_t(planner_workspace_words(l)));
    plan_alloc(l, kind, p.tpe_all, p.alloc, workspace.data());
    derive_plan(l, p);
}

namespace {
template <typename Index>
int64_t route_typed(const Layout& l, const PlanView& p, int rank, const Index* topk_idx, int num_tokens) {
    const int E = l.num_experts;
    std::vector<int32_t> seen(size_t(E), 0);
    int64_t first_bad = -1;
    const int64_t num_entries = int64_t(num_tokens) * l.topk;
    for (int64_t i = 0; i < num_entries; ++i) {
        const Index id = topk_idx[i];
        if (id < 0 || id >= Index(E)) {
            p.entry_rank[i] = p.entry_row[i] = -1;
            if (first_bad < 0) first_bad = i;
            continue;
        }
        const int e = int(id);
        const int j = seen[size_t(e)]++;
        FLATEP_CHECK(j < p.tpe_all[int64_t(rank) * E + e], "topk_idx of rank ", rank, " routes more than tpe_all[",
                     rank, "][", e, "] = ", p.tpe_all[int64_t(rank) * E + e], " entries to expert ", e,
                     " (counts and routing disagree)");
        const EntryPlace place = place_entry(l, p, rank, e, j);
        p.entry_rank[i] = place.rank;
        p.entry_row[i] = place.row;
    }
    return first_bad;
}
}  // namespace

int64_t route_entries(const Layout& l, const PlanView& p, int rank, const void* topk_idx, int index_bytes,
                      int num_tokens) {
    check_plan_inputs(l, num_tokens, topk_idx, index_bytes);  // the plan op's own checks and messages
    FLATEP_CHECK(rank >= 0 && rank < l.num_ranks, "plan: rank must be in [0, ", l.num_ranks, "), got ", rank);
    if (index_bytes == 4) return route_typed(l, p, rank, static_cast<const int32_t*>(topk_idx), num_tokens);
    return route_typed(l, p, rank, static_cast<const int64_t*>(topk_idx), num_tokens);
}

}  // namespace flatep::planner
