// The one timed-wait helper of the device code. Every spin-wait of every kernel goes through
// wait_flag_at_least: it never hangs; after sync.timeout_s it records what it waited for and returns false.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "sync/ptx.cuh"
#include "sync/sync.hpp"

namespace flatep::sync::device {

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

// Records a failed wait (code kStatusTimeout, kStatusMismatch or kStatusPeerAborted): the rank's status words
// (index = op, value = the peer's op for a mismatch, else the observed epoch; peer) and, when present, the
// host-mapped WaitRecord (all fields, then code last behind a system fence). Only the first error of a rank is kept
// in each.
FLATEP_DEVICE void record_wait_failure(const SyncArgs& sync, int32_t code, int op, int peer, uint64_t expected,
                                       uint64_t observed) {
    if (sync.epoch != nullptr) atomicExch(reinterpret_cast<unsigned long long*>(sync.epoch + kEpochFailed), 1ull);
    record_status(sync.status, code, op, wait_status_value(code, observed), peer);
    WaitRecord* rec = sync.wait_record;
    if (rec != nullptr && atomicCAS(&rec->op, kOpNone, op) == kOpNone) {  // op doubles as the claim word
        rec->rank = sync.rank;
        rec->peer = peer;
        rec->expected = expected;
        rec->observed = observed;
        rec->step = sync.step;
        __threadfence_system();
        atomicExch(&rec->code, code);
    }
}

// True when an earlier wait of this rank already failed: later waits give up at once instead of each waiting the
// full timeout (the step is lost anyway; the host reports the first failure). Reads device memory only: the rank's
// kEpochFailed word, which record_wait_failure sets with every record, and its status words. (Reading the host-mapped
// WaitRecord here instead cost a PCIe round trip in every barrier: about 2.4 us of two barriers on 8 virtual ranks,
// H200.)
FLATEP_DEVICE bool wait_already_failed(const SyncArgs& sync) {
    if (ld_relaxed_sys(sync.epoch + kEpochFailed) != 0) return true;
    return sync.status != nullptr && status_is_fatal(ld_relaxed_sys(&sync.status[kStatusCode]));
}

// Spins until the peer's flag word reaches barrier `mine` (flag_word(epoch, op, step) as this rank stored it), or
// until sync.timeout_s has passed, or the peer turns out to be in another op or step, or aborted; the last three
// record the failure and return false. Acquire: on a true return, every write the peer made before its
// st_release_sys of that word is visible to this thread (and, after a __syncthreads, to its block).
FLATEP_DEVICE bool wait_flag_at_least(const SyncArgs& sync, int op, int peer, const uint64_t* flag, uint64_t mine) {
    uint64_t observed = ld_acquire_sys(flag);
    int32_t state = flag_state(observed, mine);
    if (state == 0) {
        const uint64_t timeout_ns = uint64_t(sync.timeout_s * 1e9);
        const uint64_t start = globaltimer_ns();
        for (uint32_t spins = 1; state == 0; ++spins) {
            observed = ld_acquire_sys(flag);
            state = flag_state(observed, mine);
            if (state != 0 || (spins & 255u) != 0) continue;
            if (wait_already_failed(sync)) return false;
            if (globaltimer_ns() - start > timeout_ns) {
                observed = ld_acquire_sys(flag);
                state = flag_state(observed, mine);
                if (state == 0) state = -kStatusTimeout;
                break;
            }
            __nanosleep(64);
        }
    }
    if (state > 0) return true;
    record_wait_failure(sync, -state, op, peer, mine, observed);
    return false;
}

}  // namespace flatep::sync::device
