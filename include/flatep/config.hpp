// FlatEP construction parameters (design §1, §8). Every shape a step produces depends only on these (and, for a
// Buffer made from serving ExpertPools, on the pools' slots and view stride).
#pragma once

#include <cstdint>
#include <string>

#include "flatep/types.hpp"

namespace flatep {

struct Config {
    int num_ranks = 1;             // R: EP ranks
    int rank = 0;                  // this rank, in [0, R)
    int num_experts = 1;           // E: routed experts, E % R == 0
    int num_tokens = 1;            // S: tokens per rank per step (a call may pass fewer)
    int topk = 1;                  // K: routed experts per token, 1 <= K <= min(32, E)
    int hidden = 8;                // H: row width in bf16 elements; rows must be 16-byte multiples (H % 8 == 0)
    int align = 128;               // row padding of every non-empty expert group (1 = none), 1..4096
    double capacity_factor = 1.0;  // 1 = exact mode (C = S*K); > 1 = slack mode (C = ceil(f*S*K)), at most 4
    // The groups of a step's receive rows follow the training layout (2*epn groups, design §5) unless the Buffer is
    // made from serving ExpertPools, whose replica slots B and weight-view stride Q it then takes (design §5,
    // "Serving layout"): the pools own both, so they are not fields here.

    // Throws flatep::Error(kInvalidArgument) naming the first invalid field and its value. The planner kind matters
    // for the receive capacity only: the owner planner's is the worst case R*S*K rows (see make_layout).
    void validate(PlannerKind planner = PlannerKind::kBalanced) const;

    // Hash of every field except `rank` (what all ranks must agree on).
    uint64_t hash() const;

    // Empty when this and `other` agree on every field but `rank`; otherwise "field: mine vs theirs" for the
    // first differing field.
    std::string mismatch(const Config& other) const;

    std::string to_string() const;
};

}  // namespace flatep
