// Cross-rank synchronisation state handed to every collective op (host threads, processes or GPU kernels).
//
// Barrier protocol (one epoch counter per rank, one flag word per (owner, writer) pair):
//   e = ++(*epoch);                                                  // local, owner-only counter
//   for every peer p: store-release flags[p][rank] = flag_word(e, op, step)   // "I am at barrier e of (op, step)"
//   for every peer p: wait until flag_epoch(load-acquire flags[rank][p]) >= e, with a timeout
// Release/acquire pairs order each rank's writes before the barrier with every peer's reads after it.
// ">=" accepts a peer that already went on to the next barrier (it has checked this one). A peer seen at exactly
// epoch e with another (op, step) is a mismatch: the ranks called different ops, or passed plans of different steps.
// All ranks must run the same sequence of barriers; a rank that dies or stops calling makes the others fail with a
// timeout naming it. A rank whose wait failed (timeout, mismatch, or a peer's abort) stores its word with the abort
// bit into its slot of every peer's array, so every peer's next wait on it fails at once instead of computing with
// stale flags: the Buffer or pools is then poisoned on every rank (the runtime raises at every later call).
#pragma once

#include <cstdint>

#include "common/macros.hpp"

namespace flatep::sync {

// Which op a wait belonged to (WaitRecord::op, and kStatusIndex of a kStatusTimeout status).
enum OpId : int32_t {
    kOpNone = 0,
    kOpPlan = 1,
    kOpDispatch = 2,
    kOpCombine = 3,
    kOpPrefetch = 4,
    kOpGradReduce = 5,
    kOpEntryValues = 6,
    kOpDispatchFp8 = 7,  // dispatch of FP8 rows: its own tag, so a rank in it never meets a peer in dispatch
    // The barriers a plan-ordered op keeps (DispatchArgs::plan_ordered, ...: no entry barrier) carry their own tags,
    // so a rank that skipped the entry barrier never meets a peer that did not (a mismatch on every rank).
    kOpDispatchOrdered = 8,
    kOpCombineOrdered = 9,
    kOpDispatchFp8Ordered = 10,
};

// Name of an op as timeout and mismatch messages print it ("plan", "dispatch", ...).
constexpr const char* op_name(OpId op) {
    switch (op) {
        case kOpNone:
            return "none";
        case kOpPlan:
            return "plan";
        case kOpDispatch:
            return "dispatch";
        case kOpCombine:
            return "combine";
        case kOpPrefetch:
            return "prefetch";
        case kOpGradReduce:
            return "reduce_grad";
        case kOpEntryValues:
            return "entry_values";
        case kOpDispatchFp8:
            return "dispatch_fp8";
        case kOpDispatchOrdered:
            return "dispatch (plan_ordered)";
        case kOpCombineOrdered:
            return "combine (plan_ordered)";
        case kOpDispatchFp8Ordered:
            return "dispatch_fp8 (plan_ordered)";
    }
    return "unknown op";
}

// First failed wait of a rank, written by the GPU into host-mapped memory so the host can read it, without any
// synchronisation, even while a kernel is still running (the runtime looks at it at the entry of every op). code is 0
// until a wait fails; the other fields are written before code (system-scope fence in between).
struct WaitRecord {
    int32_t code;       // 0, or the StatusCode of the failure (kStatusTimeout, kStatusMismatch, kStatusPeerAborted)
    int32_t op;         // OpId
    int32_t rank;       // the rank that waited
    int32_t peer;       // the rank it waited for
    uint64_t expected;  // flag_word this rank published at the failed barrier
    uint64_t observed;  // the peer's flag word as last read
    uint64_t step;      // SyncArgs::step of the op that failed
};

// The words SyncArgs::epoch points at: this rank's own memory, zeroed at creation (device memory for a device backend,
// kEpochWords of them; the host barrier uses the first alone).
enum EpochWord : int {
    kEpochCounter = 0,  // the barrier epoch (the last barrier this rank entered)
    kEpochFailed = 1,   // device: nonzero once a wait of this rank has failed (record_wait_failure), read by every wait
    kEpochWords = 2,
};

struct SyncArgs {
    uint64_t* flags[kMaxRanks];  // flags[p]: rank p's flag array (uint64_t[kMaxRanks]) as mapped in this process
    uint64_t* epoch;             // this rank's EpochWord words (local memory of this rank): [kEpochCounter] the epoch
    int32_t* status;             // this rank's status words (see StatusWord); may be null
    int rank;
    int num_ranks;
    double timeout_s;   // every wait fails after this many seconds
    uint64_t step = 0;  // the op's step (its plan's generation; 0: none) tagged into every flag word it stores
    // CUDA launchers only (the host twins ignore these):
    WaitRecord* wait_record = nullptr;  // host-readable record of the first failed wait; may be null
    int32_t* host_status = nullptr;     // host-mapped twin of `status` (StatusWord), read at op entry; may be null
};

// Status words of a rank (int32_t[4] in its symmetric buffer). Written by ops, read by the runtime.
enum StatusWord : int {
    kStatusCode = 0,   // 0 ok, otherwise a StatusCode
    kStatusIndex = 1,  // first offending flat index (e.g. t*K+k of a bad expert id)
    kStatusValue = 2,  // the offending value
    kStatusPeer = 3,   // peer involved (timeouts)
};

enum StatusCode : int32_t {
    kStatusOk = 0,
    kStatusBadExpert = 1,    // an expert id outside [0, E): the entry was skipped
    kStatusTimeout = 2,      // a wait timed out
    kStatusMismatch = 3,     // a peer was at the same barrier in another op or step (index = op, value = peer's op)
    kStatusPeerAborted = 4,  // a peer's wait failed first and it gave up (index = op)
};

// A status code that ends the Buffer's (or pools') life: its barrier sequence can no longer be trusted.
FLATEP_HD bool status_is_fatal(int32_t code) {
    return code == kStatusTimeout || code == kStatusMismatch || code == kStatusPeerAborted;
}

// A flag word: barrier epoch (high 43 bits), an abort bit, the op (4 bits) and the low 16 bits of the step (plan
// generation) of the barrier a rank has reached. A rank whose wait failed stores its word of that barrier with the
// abort bit set: the peers' waits then fail at once, and a peer at the same barrier still sees which (op, step) the
// aborting rank was in, so it can name both sides of a mismatch.
inline constexpr int kFlagStepBits = 16;
inline constexpr uint64_t kFlagStepMask = (uint64_t(1) << kFlagStepBits) - 1;
inline constexpr uint64_t kFlagTagMask = (uint64_t(1) << 20) - 1;  // op and step
inline constexpr uint64_t kFlagAbortBit = uint64_t(1) << 20;
FLATEP_HD uint64_t flag_word(uint64_t epoch, int op, uint64_t step) {
    return (epoch << 21) | (uint64_t(op & 0xf) << kFlagStepBits) | (step & kFlagStepMask);
}
FLATEP_HD uint64_t flag_epoch(uint64_t word) { return word >> 21; }
FLATEP_HD bool flag_aborted(uint64_t word) { return (word & kFlagAbortBit) != 0; }
FLATEP_HD int flag_op(uint64_t word) { return int((word >> kFlagStepBits) & 0xf); }
// The full step a peer's 16 step bits stand for: the one nearest to `mine` (exact while steps differ by < 2^15).
FLATEP_HD uint64_t flag_step_near(uint64_t word, uint64_t mine) {
    const int64_t d = int64_t((word - mine) & kFlagStepMask);
    return mine + uint64_t(d >= int64_t(kFlagStepMask / 2 + 1) ? d - int64_t(kFlagStepMask + 1) : d);
}
// One read `observed` of a peer's flag word against `mine`, the word this rank stored at its current barrier:
// 1 the peer has reached (or passed) this barrier in the same (op, step); 0 not yet; a negative StatusCode when the
// wait has failed for good: -kStatusMismatch (the peer is, or aborted, at this barrier in another op or step),
// -kStatusPeerAborted (the peer gave up). Both backends' timed waits classify with this one function.
FLATEP_HD int flag_state(uint64_t observed, uint64_t mine) {
    const bool same_barrier = flag_epoch(observed) == flag_epoch(mine);
    const bool same_tags = ((observed ^ mine) & kFlagTagMask) == 0;
    if (flag_aborted(observed)) {
        // The peer failed at barrier flag_epoch(observed), after passing every earlier one: a waiter at an earlier
        // barrier has its arrival (the abort store is a release like any flag store).
        if (flag_epoch(observed) > flag_epoch(mine)) return 1;
        return same_barrier && !same_tags ? -kStatusMismatch : -kStatusPeerAborted;
    }
    if (flag_epoch(observed) < flag_epoch(mine)) return 0;
    return same_barrier && !same_tags ? -kStatusMismatch : 1;
}

// The kStatusValue word a failed wait records: the peer's op for a mismatch, else the epoch it was seen at.
FLATEP_HD int32_t wait_status_value(int32_t code, uint64_t observed) {
    return code == kStatusMismatch ? int32_t(flag_op(observed)) : int32_t(flag_epoch(observed));
}

}  // namespace flatep::sync
