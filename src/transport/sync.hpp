// Cross-rank synchronisation state handed to every collective op (host threads, processes or GPU kernels).
//
// Barrier protocol (one epoch counter per rank, one flag word per (owner, writer) pair):
//   e = ++(*epoch);                                   // local, owner-only counter
//   for every peer p: store-release flags[p][rank] = e  // "I have arrived at barrier e"
//   for every peer p: wait until load-acquire flags[rank][p] >= e, with a timeout
// Release/acquire pairs order each rank's writes before the barrier with every peer's reads after it.
// ">=" accepts a peer that already went on to the next barrier. All ranks must run the same sequence of
// barriers; a rank that dies or stops calling makes the others fail with a timeout naming it.
#pragma once

#include <cstdint>

#include "common/macros.hpp"

namespace flatep {

// Which op a wait belonged to (WaitRecord::op, and kStatusIndex of a kStatusTimeout status).
enum OpId : int32_t {
    kOpNone = 0,
    kOpPlan = 1,
    kOpDispatch = 2,
    kOpCombine = 3,
    kOpPrefetch = 4,
    kOpGradReduce = 5,
    kOpEntryValues = 6,
};

// First timed-out wait of a rank, written by the GPU into host-mapped memory so the host can read it even while a
// kernel is still running. code is 0 until a wait times out, then kStatusTimeout; the other fields are written
// before code (system-scope fence in between).
struct WaitRecord {
    int32_t code;
    int32_t op;    // OpId
    int32_t rank;  // the rank that waited
    int32_t peer;  // the rank it waited for
    uint64_t expected;
    uint64_t observed;
};

struct SyncArgs {
    uint64_t* flags[kMaxRanks];  // flags[p]: rank p's flag array (uint64_t[kMaxRanks]) as mapped in this process
    uint64_t* epoch;             // this rank's barrier counter (local memory of this rank)
    int32_t* status;             // this rank's status words (see StatusWord); may be null
    int rank;
    int num_ranks;
    double timeout_s;  // every wait fails after this many seconds
    // CUDA launchers only (the host twins ignore these):
    int max_blocks = 0;                 // most thread blocks one launch of this rank may use (SM budget); 0: no cap
    WaitRecord* wait_record = nullptr;  // host-readable record of the first timed-out wait; may be null
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
    kStatusBadExpert = 1,  // an expert id outside [0, E): the entry was skipped
    kStatusTimeout = 2,    // a wait timed out
};

}  // namespace flatep
