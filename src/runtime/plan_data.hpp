// The state behind a flatep::Plan: the plan arrays plus the ids that tie it to its Buffer and step.
#pragma once

#include <cstdint>

#include "flatep/buffer.hpp"
#include "planner/planner.hpp"

namespace flatep {

struct Plan::Data {
    explicit Data(const Layout& layout) : host(layout) {}
    HostPlan host;
    uint64_t generation = 0;
    uint64_t buffer_id = 0;
    int rank = 0;
};

}  // namespace flatep
