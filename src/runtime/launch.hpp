// The Launch of one call as a backend runs it: the SM budget resolved and the options checked against what the op
// takes (flatep/launch.hpp), for Buffer and ExpertPools alike.
#pragma once

#include "common/check.hpp"
#include "common/env.hpp"
#include "flatep/launch.hpp"

namespace flatep::runtime {

// What an op takes of OpOptions.
enum class Takes { kNoOption, kPlanOrdered };

// Refuses an option the op does not take: every flag set reaches an op that reads it.
inline void check_options(const char* op, const OpOptions& options, Takes takes) {
    FLATEP_CHECK(!options.plan_ordered || takes == Takes::kPlanOrdered, op,
                 ": options.plan_ordered must be false: only dispatch, dispatch_fp8, combine and a serving prefetch "
                 "take it, got true");
}

// `launch` with num_sms -1 replaced by the object's budget (any other value checked), its options checked.
inline Launch resolve_launch(const char* op, const Launch& launch, int object_num_sms, Takes takes) {
    check_options(op, launch.options, takes);
    Launch resolved = launch;
    resolved.num_sms = launch.num_sms == -1 ? object_num_sms : env::check_num_sms(op, launch.num_sms);
    return resolved;
}

}  // namespace flatep::runtime
