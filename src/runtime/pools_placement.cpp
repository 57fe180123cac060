// ExpertPools::placement_bytes: what moving a static placement's replicas into the slots copies (design §4 "The
// static planner"). Kept apart from expert_pools.cpp: it reads only the plan's placement and the pools' public sizes.
#include "common/check.hpp"
#include "flatep/expert_pools.hpp"
#include "layout/layout.hpp"
#include "runtime/plan_data.hpp"

namespace flatep {

int64_t ExpertPools::placement_bytes(const Plan& plan, int rank) const {
    FLATEP_CHECK(!plan.empty(), "placement_bytes: plan is empty (default-constructed); get one from Buffer::plan()");
    FLATEP_CHECK(plan.planner() == PlannerKind::kStatic, "placement_bytes: the plan's planner is '",
                 planner_name(plan.planner()), "'; only a static plan has a placement");
    const Layout& l = plan.data().host.layout;
    FLATEP_CHECK(l.experts_per_rank == experts_per_rank() && l.num_slots == num_slots(),
                 "placement_bytes: plan has epn=", l.experts_per_rank, " num_slots=", l.num_slots,
                 " but the pools have epn=", experts_per_rank(), " num_slots=", num_slots());
    FLATEP_CHECK(rank >= -1 && rank < l.num_ranks, "placement_bytes: rank must be in [0, ", l.num_ranks,
                 ") or -1 (every rank), got ", rank);
    const std::vector<int32_t>& slots = *plan.data().placement;  // a static plan always has its placement
    int64_t placed = 0;
    for (int d = 0; d < l.num_ranks; ++d) {
        if (rank >= 0 && d != rank) continue;
        for (int j = 0; j < l.num_slots; ++j) placed += slots[size_t(d) * l.num_slots + j] >= 0 ? 1 : 0;
    }
    int64_t expert_bytes = 0;
    for (int p = 0; p < num_projections(); ++p) expert_bytes += shape(p).expert_bytes();
    return placed * expert_bytes;
}

}  // namespace flatep
