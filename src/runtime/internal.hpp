// The internals of the public objects that FlatEP's own bindings, tools, tests and benchmarks reach, through the one
// internal API header (internal/api.hpp). Defined where the implementations live (runtime/buffer.cpp,
// runtime/expert_pools.cpp); not for users.
#pragma once

#include "flatep/buffer.hpp"
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

}  // namespace flatep::internal
