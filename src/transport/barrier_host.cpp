#include "transport/barrier_host.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "common/check.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace flatep::host {

namespace {

// The waiting ladder of wait_flag_at_least (measured in benchmarks/soak.cpp on a 2-CPU VM; README, Soak).
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

// Which rung of the ladder returns decides only when this rank goes on, never what any rank computes.
void wait_flag_at_least(const SyncArgs& sync, OpId op, int peer, const uint64_t* flag, uint64_t expected,
                        double start_s) {
    // Acquire loads: pair with the peer's release store in barrier(), so the peer's earlier writes are visible.
    std::atomic_ref<uint64_t> word(*const_cast<uint64_t*>(flag));
    uint64_t observed = word.load(std::memory_order_acquire);
    if (observed >= expected) return;
    const double wait_start = now_s();
    // Every return below goes through here: feeds the wait's length into long_wait_share.
    auto done = [&] {
        const float is_long = now_s() - wait_start > kLongWaitSeconds ? 1.0f : 0.0f;
        long_wait_share += (is_long - long_wait_share) / 16;
    };

    static const int cpus = usable_cpus();
    if (sync.num_ranks <= cpus && long_wait_share < kMaxLongWaitShare) {
        const double spin_end = wait_start + kSpinSeconds;
        for (uint32_t spins = 1;; ++spins) {
            cpu_relax();
            observed = word.load(std::memory_order_acquire);
            if (observed >= expected) return done();
            if (spins % 64 == 0 && now_s() >= spin_end) break;
        }
    }
    for (int i = 0; i < kNumYields; ++i) {
        sched_yield();
        observed = word.load(std::memory_order_acquire);
        if (observed >= expected) return done();
    }
    for (;;) {
        const double now = now_s();
        if (now - start_s > sync.timeout_s) {
            observed = word.load(std::memory_order_acquire);
            if (observed >= expected) return done();
            record_status(sync.status, kStatusTimeout, int32_t(op), int32_t(observed), peer);
            char waited[32];
            std::snprintf(waited, sizeof(waited), "%.1f", sync.timeout_s);
            FLATEP_THROW(ErrorCategory::kTimeout, "timeout in ", op_name(op), ": rank ", sync.rank, " waited ", waited,
                         " s for peer ", peer, " (flag ", observed, " < expected ", expected, ")");
        }
        sleep_seconds(std::clamp((now - wait_start) / 8, kMinSleepSeconds, kMaxSleepSeconds));
        observed = word.load(std::memory_order_acquire);
        if (observed >= expected) return done();
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
