// The one timed-wait helper of the device code. Every spin-wait of every kernel goes through
// wait_flag_at_least: it never hangs; after sync.timeout_s it records what it waited for and returns false.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "kernels/common/ptx.cuh"
#include "transport/sync.hpp"

namespace flatep::kernels {

// Records the first error of a rank in its status words: claims kStatusCode (0 -> -1 while writing), writes
// index, value and peer, then publishes the code behind a system fence. Later errors are dropped.
FLATEP_DEVICE void record_status(int32_t* status, int32_t code, int32_t index, int32_t value, int32_t peer) {
    if (status == nullptr) return;
    if (atomicCAS(&status[kStatusCode], kStatusOk, -1) != kStatusOk) return;
    status[kStatusIndex] = index;
    status[kStatusValue] = value;
    status[kStatusPeer] = peer;
    __threadfence_system();
    atomicExch(&status[kStatusCode], code);
}

// Records a failed wait: the rank's status words (kStatusTimeout, index = op, value = observed, peer) and, when
// present, the host-mapped WaitRecord (all fields, then code last behind a system fence). Only the first error
// of a rank is kept in each.
FLATEP_DEVICE void record_wait_timeout(const SyncArgs& sync, int op, int peer, uint64_t expected, uint64_t observed) {
    record_status(sync.status, kStatusTimeout, op, int32_t(observed), peer);
    WaitRecord* rec = sync.wait_record;
    if (rec != nullptr && atomicCAS(&rec->op, kOpNone, op) == kOpNone) {  // op doubles as the claim word
        rec->rank = sync.rank;
        rec->peer = peer;
        rec->expected = expected;
        rec->observed = observed;
        __threadfence_system();
        atomicExch(&rec->code, kStatusTimeout);
    }
}

// True when an earlier wait of this rank already timed out: later waits give up at once instead of each waiting
// the full timeout (the step is lost anyway; the host reports the first failure).
FLATEP_DEVICE bool wait_already_failed(const SyncArgs& sync) {
    return sync.status != nullptr && ld_relaxed_sys(&sync.status[kStatusCode]) == kStatusTimeout;
}

// Spins until ld_acquire_sys(flag) >= expected, or until sync.timeout_s has passed (then records the timeout and
// returns false). Acquire: on a true return, every write the peer made before its st_release_sys of a value
// >= expected is visible to this thread (and, after a __syncthreads, to its block).
FLATEP_DEVICE bool wait_flag_at_least(const SyncArgs& sync, int op, int peer, const uint64_t* flag, uint64_t expected) {
    uint64_t observed = ld_acquire_sys(flag);
    if (observed >= expected) return true;
    const uint64_t timeout_ns = uint64_t(sync.timeout_s * 1e9);
    const uint64_t start = globaltimer_ns();
    for (uint32_t spins = 1;; ++spins) {
        observed = ld_acquire_sys(flag);
        if (observed >= expected) return true;
        if ((spins & 255u) == 0) {
            if (wait_already_failed(sync)) return false;
            if (globaltimer_ns() - start > timeout_ns) {
                observed = ld_acquire_sys(flag);
                if (observed >= expected) return true;
                record_wait_timeout(sync, op, peer, expected, observed);
                return false;
            }
            __nanosleep(64);
        }
    }
}

}  // namespace flatep::kernels
