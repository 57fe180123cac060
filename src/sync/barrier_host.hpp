// Host implementation of the barrier protocol of sync/sync.hpp (threads of one process or processes sharing
// memfd mappings). Every wait goes through wait_flag_at_least, the one timed-wait helper: on timeout it records
// kStatusTimeout in the status words and throws flatep::Error(kTimeout) naming the op, rank, peer, expected and
// observed values.
#pragma once

#include <cstdint>
#include <string>

#include "flatep/error.hpp"
#include "sync/sync.hpp"

namespace flatep::sync::host {

// Records the first error of a rank in its status words (no-op when status is null or an error is already there).
void record_status(int32_t* status, int32_t code, int32_t index, int32_t value, int32_t peer);

// Waits until the peer's flag word (load-acquire(*flag)) reaches the barrier of `mine`, the word this rank stored
// (sync.hpp; acquire: everything `peer` wrote before its release store of that word is visible after the return).
// After sync.timeout_s seconds measured from `start_s` (a steady-clock time in seconds, see now_s) records
// kStatusTimeout (index = op, value = observed epoch, peer) and throws kTimeout, e.g.
//   "timeout in dispatch: rank 1 waited 2.0 s for peer 3 (flag 7 < expected 8)";
// a peer at the same barrier in another (op, step) records kStatusMismatch and throws kMismatch, e.g.
//   "dispatch: rank 0 is in dispatch of step 5 but rank 1 in combine of step 5; ...";
// a peer that gave up (kFlagAbortBit) records kStatusPeerAborted and throws kRuntime naming it.
// How it waits (barrier_host.cpp): spins up to 200 us while every rank can own a CPU and recent waits were short,
// then sched_yield, then sleeps that grow with the time waited (20 us to 1 ms), checking the deadline after each.
void wait_flag_at_least(const SyncArgs& sync, OpId op, int peer, const uint64_t* flag, uint64_t mine, double start_s);

// The one-line text of a failed wait (both backends: the CPU barrier throws it, the runtime reports a GPU WaitRecord
// with it). code: kStatusTimeout / kStatusMismatch / kStatusPeerAborted; mine / observed: the flag words; step: the
// full step of this rank's op.
std::string wait_failure_message(int32_t code, OpId op, int rank, int peer, uint64_t mine, uint64_t observed,
                                 uint64_t step, double timeout_s);
// The category a failed wait raises: kTimeout, kMismatch (ranks in different ops or steps), else kRuntime.
ErrorCategory wait_failure_category(int32_t code);

// Seconds on the steady clock.
double now_s();

// Full barrier of all sync.num_ranks ranks (sync.hpp): bumps the epoch, store-releases flag_word(epoch, op,
// sync.step) into every peer's flag slot for this rank, then waits for every peer's flag in this rank's array.
// Release/acquire: every write this rank made before the barrier (to any rank's memory) is visible to every peer
// after its barrier returns. A failed wait stores its word with kFlagAbortBit into this rank's slot of every peer's
// array before it throws; a rank whose status already holds a fatal code throws at once (kRuntime) and publishes
// nothing else.
void barrier(const SyncArgs& sync, OpId op);

}  // namespace flatep::sync::host
