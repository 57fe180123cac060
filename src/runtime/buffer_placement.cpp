// Buffer::set_placement's work (design §4 "The static planner"): the collective that gives a static Buffer its
// placement. Kept apart from buffer.cpp, which calls it between the op's entry and exit (runtime/placement.hpp).
#include <cstring>

#include "common/check.hpp"
#include "flatep/buffer.hpp"
#include "layout/layout.hpp"
#include "planner/static_placement.hpp"
#include "runtime/backend.hpp"
#include "runtime/placement.hpp"
#include "runtime/plan_data.hpp"

namespace flatep {

namespace runtime {

std::string placement_disagreement(const std::vector<std::string>& blobs, int num_slots) {
    const size_t words = blobs[0].size() / sizeof(int32_t);
    for (size_t p = 1; p < blobs.size(); ++p) {
        if (blobs[p].size() != blobs[0].size())
            return detail::concat("set_placement: ranks disagree on the placement: rank 0 passed ", words,
                                  " entries, rank ", p, " passed ", blobs[p].size() / sizeof(int32_t),
                                  " (every rank must pass the same placement)");
    }
    for (size_t i = 0; i < words; ++i) {
        int32_t first = 0;
        std::memcpy(&first, blobs[0].data() + i * sizeof(int32_t), sizeof(int32_t));
        for (size_t p = 1; p < blobs.size(); ++p) {
            int32_t theirs = 0;
            std::memcpy(&theirs, blobs[p].data() + i * sizeof(int32_t), sizeof(int32_t));
            if (theirs == first) continue;
            const size_t B = size_t(num_slots > 0 ? num_slots : 1);
            return detail::concat("set_placement: ranks disagree on the placement: placement[", i / B, "][", i % B,
                                  "] is ", first, " on rank 0 but ", theirs, " on rank ", p,
                                  " (every rank must pass the same placement)");
        }
    }
    return "";
}

}  // namespace runtime

namespace runtime {

void set_placement(PlacementState& state, const Layout& layout, PlannerKind planner, Transport& transport,
                   BufferBackend& backend, std::span<const int32_t> placement, const Launch& launch) {
    FLATEP_CHECK(planner == PlannerKind::kStatic, "set_placement: this Buffer's planner is '", planner_name(planner),
                 "'; a placement is for the static planner (PlannerKind::kStatic)");
    const std::string mine(reinterpret_cast<const char*>(placement.data()), placement.size_bytes());
    const std::vector<std::string> blobs = transport.bootstrap().all_gather(mine);
    const std::string disagree = placement_disagreement(blobs, layout.num_slots);
    if (!disagree.empty()) FLATEP_THROW(ErrorCategory::kMismatch, disagree);
    const std::string bad = planner::check_placement(layout, placement);
    FLATEP_CHECK(bad.empty(), "set_placement: ", bad);
    const std::vector<int32_t> table = planner::make_placement_table(layout, placement);
    state.table = backend.store_placement(table, launch);
    state.slots = std::make_shared<const std::vector<int32_t>>(placement.begin(), placement.end());
    ++state.epoch;
}

std::span<const int32_t> placement_of(const PlacementState& state) {
    if (state.slots == nullptr) return {};
    return {state.slots->data(), state.slots->size()};
}

}  // namespace runtime

uint64_t Plan::placement_epoch() const { return data().placement_epoch; }

}  // namespace flatep
