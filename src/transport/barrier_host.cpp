#include "transport/barrier_host.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/check.hpp"

namespace flatep::host {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

const char* op_name(OpId op) {
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
    }
    return "unknown op";
}

void record_status(int32_t* status, int32_t code, int32_t index, int32_t value, int32_t peer) {
    if (status == nullptr) return;
    // Relaxed is enough: status words are written by their own rank and read by the runtime on the same thread
    // (or after a barrier); atomic_ref only keeps concurrent readers well defined.
    std::atomic_ref<int32_t> word(status[kStatusCode]);
    if (word.load(std::memory_order_relaxed) != kStatusOk) return;
    status[kStatusIndex] = index;
    status[kStatusValue] = value;
    status[kStatusPeer] = peer;
    word.store(code, std::memory_order_release);
}

void wait_flag_at_least(const SyncArgs& sync, OpId op, int peer, const uint64_t* flag, uint64_t expected,
                        double start_s) {
    // Acquire load: pairs with the peer's release store in barrier(), so the peer's earlier writes are visible.
    std::atomic_ref<uint64_t> word(*const_cast<uint64_t*>(flag));
    uint64_t observed = word.load(std::memory_order_acquire);
    for (uint64_t spins = 0; observed < expected; ++spins) {
        if (spins < 64) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
            if ((spins & 15) == 0 && now_s() - start_s > sync.timeout_s) {
                observed = word.load(std::memory_order_acquire);
                if (observed >= expected) break;
                record_status(sync.status, kStatusTimeout, int32_t(op), int32_t(observed), peer);
                char waited[32];
                std::snprintf(waited, sizeof(waited), "%.1f", sync.timeout_s);
                FLATEP_THROW(ErrorCategory::kTimeout, "timeout in ", op_name(op), ": rank ", sync.rank, " waited ",
                             waited, " s for peer ", peer, " (flag ", observed, " < expected ", expected, ")");
            }
        }
        observed = word.load(std::memory_order_acquire);
    }
}

void barrier(const SyncArgs& sync, OpId op) {
    const uint64_t epoch = ++(*sync.epoch);
    const int rank = sync.rank;
    // Release stores: order every write of this rank before the barrier with the peers' acquire loads below.
    for (int p = 0; p < sync.num_ranks; ++p) {
        std::atomic_ref<uint64_t>(sync.flags[p][rank]).store(epoch, std::memory_order_release);
    }
    const double start = now_s();
    for (int p = 0; p < sync.num_ranks; ++p) {
        if (p == rank) continue;
        wait_flag_at_least(sync, op, p, &sync.flags[rank][p], epoch, start);
    }
}

}  // namespace flatep::host
