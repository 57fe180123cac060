// The internals of the public objects that FlatEP's own bindings, tools, tests and benchmarks reach, through the one
// internal API header (internal/api.hpp). Defined where the implementations live (runtime/buffer.cpp,
// runtime/expert_pools.cpp); not for users.
#pragma once

#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "host/op_stats.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"

namespace flatep::internal {

// Every size the Buffer's config derives (its Config, planner and, for a Buffer of serving pools, their B and Q).
const Layout& layout(const Buffer& buffer);
// The shape of the Buffer that made `plan` (known on the host for device plans too; no synchronisation).
const Layout& layout(const Plan& plan);
// The plan's arrays in host memory (device plans: copied once on first use, synchronising: diagnostics only).
const planner::HostPlan& host_plan(const Plan& plan);
// Counters of the CPU backend's ops (tests: dedup and traffic): `stats` must stay valid while set; null stops.
void set_op_stats(Buffer& buffer, host::OpStats* stats);
// The transport the pools were built over (what a Buffer made from them runs over).
const std::shared_ptr<Transport>& transport(const ExpertPools& pools);
// A Buffer whose groups follow `view` without ExpertPools (tests and tools of the planner and the data plane: any B
// and Q the layout accepts; a Buffer for pools is made from them, Buffer(config, pools)).
std::unique_ptr<Buffer> make_buffer(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner,
                                    const ViewShape& view, int num_plan_slots = Buffer::kDefaultPlanSlots);

}  // namespace flatep::internal
