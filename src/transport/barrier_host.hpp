// Host implementation of the barrier protocol of transport/sync.hpp (threads of one process or processes sharing
// memfd mappings). Every wait goes through wait_flag_at_least, the one timed-wait helper: on timeout it records
// kStatusTimeout in the status words and throws flatep::Error(kTimeout) naming the op, rank, peer, expected and
// observed values.
#pragma once

#include <cstdint>

#include "transport/sync.hpp"

namespace flatep::host {

// Name of an op as timeout messages print it ("plan", "dispatch", ...).
const char* op_name(OpId op);

// Records the first error of a rank in its status words (no-op when status is null or an error is already there).
void record_status(int32_t* status, int32_t code, int32_t index, int32_t value, int32_t peer);

// Waits until load-acquire(*flag) >= expected (acquire: everything `peer` wrote before its release store of that
// value is visible after the return). After sync.timeout_s seconds measured from `start_s` (a steady-clock time in
// seconds, see now_s) records kStatusTimeout (index = op, value = observed, peer) and throws, e.g.
//   "timeout in dispatch: rank 1 waited 2.0 s for peer 3 (flag 7 < expected 8)".
// How it waits (barrier_host.cpp): spins up to 200 us while every rank can own a CPU and recent waits were short,
// then sched_yield, then sleeps that grow with the time waited (20 us to 1 ms), checking the deadline after each.
void wait_flag_at_least(const SyncArgs& sync, OpId op, int peer, const uint64_t* flag, uint64_t expected,
                        double start_s);

// Seconds on the steady clock.
double now_s();

// Full barrier of all sync.num_ranks ranks (sync.hpp): bumps the epoch, store-releases it into every peer's flag
// slot for this rank, then waits for every peer's flag in this rank's array. Release/acquire: every write this
// rank made before the barrier (to any rank's memory) is visible to every peer after its barrier returns.
void barrier(const SyncArgs& sync, OpId op);

}  // namespace flatep::host
