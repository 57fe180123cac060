#include "sync/barrier_host.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <string>

#include "common/check.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace flatep::sync::host {

namespace {

// The waiting ladder of wait_flag_at_least (measured in benchmarks/soak/soak.cpp on a 2-CPU VM;
// benchmarks/results/LOG.md, Soak).
// 1. Spin, at most kSpinSeconds, only while it pays: every rank can own a CPU (num_ranks <= the CPUs of this
//    process's affinity mask) and this thread's recent waits were short. A spinning rank keeps its CPU, so when the
//    peer it waits for has been pushed off its own CPU (more ranks than CPUs, other load) the spin delays that very
//    peer: with R=2 on 2 CPUs plus one busy process, a fixed 50 us spin made the median step 1.8x slower.
// 2. kNumYields sched_yield: a runnable peer on this CPU goes first.
// 3. Sleep in steps of kMinSleepSeconds, growing with the time waited (1/8 of it, at most kMaxSleepSeconds): a short
//    wait overshoots by one timer tick, a long one costs ~1000 wake-ups a second (a waiter burnt 17 ms of CPU in a
//    1 s wait, 180 ms with fixed 20 us sleeps). A futex wait woken by the peer's barrier was measured too and lost:
//    with one busy process next to R=2 on 2 CPUs it gave 10-18 steps over 3x median per 1800, these sleeps 0-6.
constexpr double kSpinSeconds = 200e-6;
constexpr double kLongWaitSeconds = kSpinSeconds;  // a wait longer than this would not have ended in the spin
constexpr float kMaxLongWaitShare = 1.0f / 8;      // spin while fewer of the recent waits were long
constexpr int kNumYields = 64;
constexpr double kMinSleepSeconds = 20e-6;
constexpr double kMaxSleepSeconds = 1e-3;

// Share of this thread's recent waits (those not over at once) that took longer than kLongWaitSeconds: an
// exponential moving average over ~16 waits. On an idle machine ~0.5%; with a busy process per 2 CPUs ~40%.
thread_local float long_wait_share = 0;

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

int usable_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
    return CPU_COUNT(&set);
}

void sleep_seconds(double seconds) {
    const timespec relative{time_t(seconds), long((seconds - double(time_t(seconds))) * 1e9)};
    nanosleep(&relative, nullptr);  // EINTR: the caller looks at the flag and the clock again
}

}  // namespace

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

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

ErrorCategory wait_failure_category(int32_t code) {
    return code == kStatusTimeout    ? ErrorCategory::kTimeout
           : code == kStatusMismatch ? ErrorCategory::kMismatch
                                     : ErrorCategory::kRuntime;
}

std::string wait_failure_message(int32_t code, OpId op, int rank, int peer, uint64_t mine, uint64_t observed,
                                 uint64_t step, double timeout_s) {
    switch (code) {
        case kStatusTimeout: {
            return detail::concat("timeout in ", op_name(op), ": rank ", rank, " waited ",
                                  detail::seconds_text(timeout_s), " s for peer ", peer, " (flag ",
                                  flag_epoch(observed), " < expected ", flag_epoch(mine), ")");
        }
        case kStatusMismatch: {
            return detail::concat(op_name(op), ": rank ", rank, " is in ", op_name(OpId(flag_op(mine))), " of step ",
                                  step, " but rank ", peer, " in ", op_name(OpId(flag_op(observed))), " of step ",
                                  flag_step_near(observed, step),
                                  "; every rank must call the same ops in the same order, with plans of the same step");
        }
        case kStatusPeerAborted:
            return detail::concat(op_name(op), ": rank ", rank, " gives up: peer ", peer,
                                  " failed an earlier wait (its own error says why)");
        default:
            return detail::concat(op_name(op), ": rank ", rank, ": wait failed with status ", code);
    }
}

// Which rung of the ladder returns decides only when this rank goes on, never what any rank computes.
void wait_flag_at_least(const SyncArgs& sync, OpId op, int peer, const uint64_t* flag, uint64_t mine, double start_s) {
    // Acquire loads: pair with the peer's release store in barrier(), so the peer's earlier writes are visible.
    std::atomic_ref<uint64_t> word(*const_cast<uint64_t*>(flag));
    uint64_t observed = word.load(std::memory_order_acquire);
    int32_t state = flag_state(observed, mine);
    auto fail = [&](int32_t code) {
        record_status(sync.status, code, int32_t(op), wait_status_value(code, observed), peer);
        FLATEP_THROW(wait_failure_category(code),
                     wait_failure_message(code, op, sync.rank, peer, mine, observed, sync.step, sync.timeout_s));
    };
    if (state > 0) return;
    if (state < 0) fail(-state);
    const double wait_start = now_s();
    // Every return below goes through here: feeds the wait's length into long_wait_share.
    auto poll = [&] {
        observed = word.load(std::memory_order_acquire);
        state = flag_state(observed, mine);
        if (state == 0) return false;
        const float is_long = now_s() - wait_start > kLongWaitSeconds ? 1.0f : 0.0f;
        long_wait_share += (is_long - long_wait_share) / 16;
        if (state < 0) fail(-state);
        return true;
    };

    static const int cpus = usable_cpus();
    if (sync.num_ranks <= cpus && long_wait_share < kMaxLongWaitShare) {
        const double spin_end = wait_start + kSpinSeconds;
        for (uint32_t spins = 1;; ++spins) {
            cpu_relax();
            if (poll()) return;
            if (spins % 64 == 0 && now_s() >= spin_end) break;
        }
    }
    for (int i = 0; i < kNumYields; ++i) {
        sched_yield();
        if (poll()) return;
    }
    for (;;) {
        const double now = now_s();
        if (now - start_s > sync.timeout_s) {
            if (poll()) return;
            fail(kStatusTimeout);
        }
        sleep_seconds(std::clamp((now - wait_start) / 8, kMinSleepSeconds, kMaxSleepSeconds));
        if (poll()) return;
    }
}

void barrier(const SyncArgs& sync, OpId op) {
    const int rank = sync.rank;
    if (sync.status != nullptr && status_is_fatal(std::atomic_ref<int32_t>(sync.status[kStatusCode]).load())) {
        // Failed before (its abort word is in every peer's array): never publish a barrier again.
        FLATEP_THROW(ErrorCategory::kRuntime, op_name(op), ": rank ", rank,
                     " failed an earlier cross-rank wait; build a new Buffer / ExpertPools on every rank");
    }
    const uint64_t mine = flag_word(++(*sync.epoch), op, sync.step);
    // Release stores: order every write of this rank before the barrier with the peers' acquire loads below.
    for (int p = 0; p < sync.num_ranks; ++p) {
        std::atomic_ref<uint64_t>(sync.flags[p][rank]).store(mine, std::memory_order_release);
    }
    const double start = now_s();
    try {
        for (int p = 0; p < sync.num_ranks; ++p) {
            if (p == rank) continue;
            try {
                wait_flag_at_least(sync, op, p, &sync.flags[rank][p], mine, start);
            } catch (const Error& e) {
                if (e.category() != ErrorCategory::kRuntime) throw;
                // Peer p gave up. If another peer is at this barrier in another (op, step), that is what went wrong
                // here: name it instead (a mismatch is worth more to the user than "someone gave up").
                for (int q = 0; q < sync.num_ranks; ++q) {
                    const uint64_t theirs =
                        std::atomic_ref<uint64_t>(sync.flags[rank][q]).load(std::memory_order_acquire);
                    if (q == rank || flag_state(theirs, mine) != -kStatusMismatch) continue;
                    FLATEP_THROW(ErrorCategory::kMismatch, wait_failure_message(kStatusMismatch, op, rank, q, mine,
                                                                                theirs, sync.step, sync.timeout_s));
                }
                throw;
            }
        }
    } catch (...) {
        // Every peer's next wait on this rank fails at once, and sees the (op, step) this rank was in.
        for (int p = 0; p < sync.num_ranks; ++p) {
            std::atomic_ref<uint64_t>(sync.flags[p][rank]).store(mine | kFlagAbortBit, std::memory_order_release);
        }
        throw;
    }
}

}  // namespace flatep::sync::host
