// The state behind a flatep::Plan: the plan arrays plus the ids that tie it to its Buffer and step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "flatep/buffer.hpp"
#include "planner/planner.hpp"

namespace flatep {

struct Plan::Data {
    explicit Data(const Layout& layout) : host(layout) {}
    // Host plans: `host` is the plan. Device plans: `device_words` is the plan (what the kernels read) and `host` a
    // copy refreshed on first access by a host accessor (a synchronising read, for diagnostics only).
    planner::HostPlan host;
    std::shared_ptr<int32_t> device_words;
    PlanView device_view{};
    std::function<void(planner::HostPlan&)> refresh_host;  // copies device_words into host (device plans only)
    mutable std::once_flag host_ready;
    // Device plans in one of the Buffer's plan slots: the slot and the Buffer's table of which generation each slot
    // holds (stale once another plan took the slot). slot < 0: caller storage or a host plan.
    int slot = -1;
    std::shared_ptr<const std::vector<uint64_t>> slot_generations;
    uint64_t generation = 0;
    uint64_t buffer_id = 0;
    int rank = 0;
    int num_tokens = 0;
    PlannerKind planner = PlannerKind::kBalanced;
    // The static planner: the placement the plan was made with ([R][B]) and its epoch (Buffer::placement_epoch).
    std::shared_ptr<const std::vector<int32_t>> placement;
    uint64_t placement_epoch = 0;

    bool on_device() const { return device_words != nullptr; }
    // The view kernels / host ops read.
    const PlanView& op_view() const { return on_device() ? device_view : host.view; }
    // Throws kMismatch (naming both steps) when the plan's arrays are no longer its own: its plan slot was reused by
    // a later step. Caller storage and host plans are never stale.
    void check_fresh(const char* op) const {
        if (slot < 0 || (*slot_generations)[size_t(slot)] == generation) return;
        FLATEP_THROW(ErrorCategory::kMismatch, op, ": the plan of step ", generation, " is stale: its plan slot ", slot,
                     " now holds the plan of step ", (*slot_generations)[size_t(slot)], " (the Buffer has ",
                     slot_generations->size(), " plan slots; keep fewer plans alive, or pass plan storage)");
    }
    // Host arrays (synchronised from the device on first use for device plans).
    const planner::HostPlan& host_plan() const {
        if (on_device()) {
            check_fresh("plan accessor");
            std::call_once(host_ready, [this] { refresh_host(const_cast<planner::HostPlan&>(host)); });
        }
        return host;
    }
};

}  // namespace flatep
