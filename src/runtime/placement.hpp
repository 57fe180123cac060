// The static planner's placement as a Buffer holds it (Buffer::set_placement, design §4 "The static planner"): the
// placement as given (what plans record, what ExpertPools::placement_bytes counts), its epoch, and where the plan op
// reads its table (the backend's memory: host for the CPU twin, device for the GPU planner).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flatep/launch.hpp"
#include "flatep/transport.hpp"
#include "flatep/types.hpp"
#include "layout/layout.hpp"

namespace flatep::runtime {

class BufferBackend;

struct PlacementState {
    std::shared_ptr<const std::vector<int32_t>> slots;  // [R][B] expert ids, -1 empty; null before set_placement
    uint64_t epoch = 0;                                 // set_placement calls that took effect
    const int32_t* table = nullptr;  // planner::make_placement_table's words, in the backend's memory
};

// Buffer::set_placement's work after the op's entry checks: the planner must be static; every rank's placement is
// all-gathered over the transport's bootstrap and compared (kMismatch, placement_disagreement) before any rank judges
// its own (kInvalidArgument, planner::check_placement), so that ranks fail together; then the table goes to the
// backend's memory (on launch's stream) and the epoch grows. On any error `state` is left as it was.
void set_placement(PlacementState& state, const Layout& layout, PlannerKind planner, Transport& transport,
                   BufferBackend& backend, std::span<const int32_t> placement, const Launch& launch);

// The placement set last ([R][B]; empty before set_placement).
std::span<const int32_t> placement_of(const PlacementState& state);

// Every rank's placement as all-gathered (the raw int32 words each passed): "" when they are all the same, else one
// line naming the first difference, the same on every rank: the first entry (in [R][B] order, then the first rank) at
// which a rank differs from rank 0, or a rank that passed another number of entries. B names the entries.
std::string placement_disagreement(const std::vector<std::string>& blobs, int num_slots);

}  // namespace flatep::runtime
