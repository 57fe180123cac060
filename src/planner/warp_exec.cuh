// The GPU executors of the planner core (planner/executor.hpp's contract; planner/derive.hpp's for derive_plan):
// WarpExec (a warp builds a candidate or the greedy), BlockExec (a block computes the home allocation), and the
// derive executor of a block (one warp per task). Every selection is a warp reduction with the host's key and tie
// rule, every sum an integer sum, so the plans are bitwise the host's.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "layout/layout.hpp"
#include "planner/derive.hpp"
#include "planner/executor.hpp"
#include "planner/gpu_device.cuh"
#include "planner/gpu_planner.cuh"

namespace flatep::planner {

// Keys for warp arg-max with ties to the lower index: larger value first, then lower index. 0 = no candidate.
FLATEP_DEVICE uint64_t arg_key(uint32_t value, int index) {
    return (uint64_t(value) << 32) | uint32_t(0xffffffffu - uint32_t(index));
}
FLATEP_DEVICE int key_index(uint64_t key) { return int(0xffffffffu - uint32_t(key)); }
FLATEP_DEVICE uint32_t key_value(uint64_t key) { return uint32_t(key >> 32); }

FLATEP_DEVICE uint64_t warp_max_u64(uint64_t v) {
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t u = __shfl_xor_sync(kFull, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// Named barrier (not 0, which __syncthreads uses) between warp 0 and the other warps of a candidate block: the
// others sync on it once home_ahead's table is written (they have nothing else to do until the block's next
// barrier), warp 0 before its first read of the table. The two sides are different instructions, so the barrier is
// the non-.aligned barrier.sync (bar.sync is barrier.sync.aligned: every thread at the same instruction).
// (With bar.arrive on the writers' side, compute-sanitizer racecheck reported the block barrier after the build as
// a hazard.)
constexpr int kAheadBarrier = 1;
FLATEP_DEVICE void named_barrier_sync(int id, int threads) {
#ifdef __CUDA_ARCH__
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

// Item i of SerialExec::ahead_sums over v[0, n): the positive items before it (larger first, ties to the lower
// index) summed, -1 when v[i] <= 0. Every item is read in turn (broadcast reads, unrolled so that the loads overlap).
FLATEP_DEVICE int32_t ahead_of(const int32_t* v, int n, int i) {
    const int32_t vi = v[i];
    int32_t s = 0;
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
        const int32_t a = v[j];
        s += a > 0 && (a > vi || (a == vi && j < i)) ? a : 0;
    }
    return vi > 0 ? s : -1;
}

// SerialExec::ahead_sums over v[0, n), n <= kSortItems, by one warp (every lane calls it): the items' keys (value,
// then the lower index first; 0 for items <= 0) sorted descending by a bitonic network in registers (item p = q*32 +
// lane in register q), then an exclusive prefix sum of the values in that order scattered back to the items. The
// same integers as the O(n^2) scan (sums of the same positive values), in O(n log^2 n / 32) steps per lane instead of
// O(n^2 / 32): at epn = 112 (E=896, R=8) one call took 5.4 us on the H200 and home_ahead_table 8.6 us.
constexpr int kSortItems = 128;
FLATEP_DEVICE void warp_ahead_sums_sorted(const int32_t* v, int n, int32_t* out, int lane) {
    constexpr int kPer = kSortItems / 32;
    uint64_t key[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
        const int p = q * 32 + lane;
        const int32_t a = p < n ? v[p] : 0;
        key[q] = a > 0 ? (uint64_t(uint32_t(a)) << 32) | uint64_t(0xffffffffu - uint32_t(p)) : 0;
        if (p < n && a <= 0) out[p] = -1;
    }
#pragma unroll
    for (int k = 2; k <= kSortItems; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            uint64_t next[kPer];
#pragma unroll
            for (int q = 0; q < kPer; ++q) {
                const int p = q * 32 + lane;
                const uint64_t other =
                    j >= 32 ? key[q ^ (j >> 5)] : (uint64_t)__shfl_xor_sync(kFull, (unsigned long long)key[q], j);
                const bool keep_max = ((p & j) == 0) == ((p & k) == 0);  // descending overall
                const uint64_t hi = key[q] > other ? key[q] : other, lo = key[q] > other ? other : key[q];
                next[q] = keep_max ? hi : lo;
            }
#pragma unroll
            for (int q = 0; q < kPer; ++q) key[q] = next[q];
        }
    }
    int32_t carry = 0;
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
        const int32_t a = int32_t(key[q] >> 32);
        int32_t incl = a;
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t t = __shfl_up_sync(kFull, incl, o);
            if (lane >= o) incl += t;
        }
        if (key[q] != 0) out[int(0xffffffffu - uint32_t(key[q]))] = carry + incl - a;
        carry += __shfl_sync(kFull, incl, 31);
    }
}

// home_ahead's table for every rank's home experts from T_e (SerialExec::ahead_sums per rank), by threads
// [0, nthreads) of the caller (the block's warps other than warp 0; whole warps). Large groups (epn > 64): one warp
// per rank, sorted (warp_ahead_sums_sorted); else one item per thread.
FLATEP_DEVICE void home_ahead_table(const Layout& l, const int32_t* total, int32_t* table, int t, int nthreads) {
    const int E = l.num_experts, epn = l.experts_per_rank, R = l.num_ranks;
    if (epn > 64 && epn <= kSortItems) {
        for (int r = t / 32; r < R; r += nthreads / 32)
            warp_ahead_sums_sorted(total + r * epn, epn, table + r * epn, t % 32);
        return;
    }
    for (int e = t; e < E; e += nthreads) {
        const int base = l.home_rank(e) * epn;
        table[e] = ahead_of(total + base, epn, e - base);
    }
}

// key(i) for an item i of [0, n), 0 (no key) past the end; n >= 1. The key is evaluated at a valid index either way
// (keys are pure reads), so the lanes past the end take no branch of their own around it.
template <class K>
FLATEP_DEVICE auto key_or_zero(K& key, int i, int n) -> decltype(key(0)) {
    using T = decltype(key(0));
    const T k = key(i < n ? i : n - 1);
    return i < n ? k : T{};
}

// out[i] = the sum of v[i*size, (i+1)*size) for the groups i = first, first + stride, ... below `groups`: one thread
// per group, its items in turn (unrolled, so that their loads overlap).
FLATEP_DEVICE void group_sums_by_thread(int first, int stride, int groups, int size, const int32_t* v, int32_t* out) {
    for (int i = first; i < groups; i += stride) {
        int32_t s = 0;
#pragma unroll 8
        for (int j = 0; j < size; ++j) s += v[i * size + j];
        out[i] = s;
    }
}

// Warp executor of planner_core (see "Executors" there): the 32 lanes run the planner's scalar code together with
// the same values; loops are split over the lanes and selections are warp reductions (redux.sync; up to 32 items, one
// per lane, and the lowest lane holding the maximum by ballot). Keys are compared as (high word, low word), then the
// lower index wins, exactly like SerialExec's strict '>' scan. (Every lane scanning the ranks itself was slower: 15.0
// vs 22.5 us per MoonEP candidate on the H200.) home_ready: the candidate blocks compute init_home's results with the
// whole block before warp 0 builds.
struct WarpExec {
    int lane;
    int64_t home_n = -1;  // >= 0: init_home's results for home_alloc are in place (home_ready)
    const int32_t* home_alloc = nullptr;
    long long* trace = nullptr;  // profile: clock64 after every single(), sum() and arg_max() (lane 0), up to kTrace
    int* trace_n = nullptr;
    FLATEP_HD void mark() const {
#ifdef __CUDA_ARCH__
        if (trace != nullptr && lane == 0 && *trace_n < PlannerProfileRecord::kTrace) trace[(*trace_n)++] = clock64();
#endif
    }
    // Path candidates: the other warps of the block compute home_ahead's table ([E], epn words per rank) while warp 0
    // starts, then sync on named barrier kAheadBarrier; so does warp 0 at its first home_ahead() (every lane).
    const int32_t* ahead_table = nullptr;
    int ahead_epn = 0;
    int ahead_threads = 0;  // threads of the named barrier (the block)
    mutable bool ahead_waited = false;
    FLATEP_DEVICE const int32_t* home_ahead(int r) const {
        if (ahead_table == nullptr) return nullptr;
        wait_ahead_table();
        return ahead_table + r * ahead_epn;
    }
    FLATEP_DEVICE void wait_ahead_table() const {
        if (ahead_table == nullptr || ahead_waited) return;
        named_barrier_sync(kAheadBarrier, ahead_threads);
        ahead_waited = true;
    }
    FLATEP_HD bool home_ready(const int32_t* alloc, int64_t* n) const {
        if (home_n < 0 || alloc != home_alloc) return false;
        *n = home_n;
        return true;
    }
    FLATEP_HD bool targets_ready() const { return home_n >= 0; }  // computed by the block with the home allocation
    FLATEP_HD void sync() const {
#ifdef __CUDA_ARCH__
        __syncwarp();
#endif
    }
    template <class F>
    FLATEP_HD void single(F&& f) const {
        sync();
        if (lane == 0) f();
        mark();
        sync();
    }
    template <class F>
    FLATEP_HD void for_each(int n, F&& f) const {
        sync();
        for (int i = lane; i < n; i += 32) f(i);
        sync();
    }
    template <class F>
    FLATEP_HD int64_t sum(int n, F&& f) const {
        sync();
        int64_t s = 0;
        for (int i = lane; i < n; i += 32) s += int64_t(f(i));
#ifdef __CUDA_ARCH__
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
#endif
        mark();
        return s;
    }
    template <class K>
    FLATEP_HD int arg_max(int n, K&& key) const {
        const int at = arg_max_of(n, key);
        mark();
        return at;
    }
    // Up to 32 items: the three reductions side by side (each as in arg_max, without its 32-bit shortcut, so that
    // no branch separates them); else three arg_max scans.
    template <class K>
    FLATEP_HD void arg_max3(int n, K&& key, int* out) const {
#ifdef __CUDA_ARCH__
        if (n <= 0) {
            out[0] = out[1] = out[2] = -1;
            mark();
            return;
        }
        if (n <= 32) {
            const Keys3 k = key_or_zero(key, lane, n);
            unsigned hi[3], lo[3];
#pragma unroll
            for (int j = 0; j < 3; ++j) hi[j] = __reduce_max_sync(kFull, unsigned(k.k[j] >> 32));
#pragma unroll
            for (int j = 0; j < 3; ++j)
                lo[j] = __reduce_max_sync(kFull, unsigned(k.k[j] >> 32) == hi[j] ? unsigned(k.k[j]) : 0u);
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                const unsigned at = __ballot_sync(kFull, k.k[j] == ((uint64_t(hi[j]) << 32) | lo[j]));
                out[j] = (hi[j] | lo[j]) == 0 ? -1 : __ffs(at) - 1;
            }
            mark();
            return;
        }
        if (n <= 64) {
            // Two items per lane (R up to 64), each key evaluated once: per selection the maximum of the lane's two,
            // the warp maximum, then the lowest index holding it (first items, then second items), as arg_max_of.
            const Keys3 k0 = key(lane);
            const Keys3 k1 = key_or_zero(key, lane + 32, n);
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                const uint64_t k = k1.k[j] > k0.k[j] ? k1.k[j] : k0.k[j];
                const unsigned hi = __reduce_max_sync(kFull, unsigned(k >> 32));
                const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
                const uint64_t best = (uint64_t(hi) << 32) | lo;
                const unsigned first = __ballot_sync(kFull, k0.k[j] == best);
                const unsigned second = __ballot_sync(kFull, k1.k[j] == best);
                out[j] = (hi | lo) == 0 ? -1 : first != 0 ? __ffs(first) - 1 : 32 + __ffs(second) - 1;
            }
            mark();
            return;
        }
#endif
        // Unrolled, so that out[] (the caller's array) and the keys stay in registers.
#pragma unroll
        for (int j = 0; j < 3; ++j) out[j] = arg_max_of(n, [&](int i) { return key(i).k[j]; });
        mark();
    }
    template <class K>
    FLATEP_HD int arg_max_of(int n, K&& key) const {
#ifdef __CUDA_ARCH__
        if (n <= 0) return -1;
        if (n <= 32) {
            // One item per lane (ranks, mostly): the largest key, then the lowest lane holding it (= the lowest index).
            // Keys of 32 bits (most) need one reduction.
            const uint64_t k = key_or_zero(key, lane, n);
            if (!__any_sync(kFull, (k >> 32) != 0)) {
                const unsigned lo = __reduce_max_sync(kFull, unsigned(k));
                return lo == 0 ? -1 : __ffs(__ballot_sync(kFull, unsigned(k) == lo)) - 1;
            }
            const unsigned hi = __reduce_max_sync(kFull, unsigned(k >> 32));
            const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
            if (hi == 0 && lo == 0) return -1;
            return __ffs(__ballot_sync(kFull, k == ((uint64_t(hi) << 32) | lo))) - 1;
        }
        if (n <= 64) {
            // Two items per lane (experts of a rank, mostly): the maximum as above, then the lowest index holding it:
            // the lowest lane among the first items, else among the second.
            const uint64_t k0 = key(lane);
            const uint64_t k1 = key_or_zero(key, lane + 32, n);
            const uint64_t k = k1 > k0 ? k1 : k0;
            const bool wide = __any_sync(kFull, (k >> 32) != 0);
            const unsigned hi = wide ? __reduce_max_sync(kFull, unsigned(k >> 32)) : 0u;
            const unsigned lo = __reduce_max_sync(kFull, unsigned(k >> 32) == hi ? unsigned(k) : 0u);
            if (hi == 0 && lo == 0) return -1;
            const uint64_t best = (uint64_t(hi) << 32) | lo;
            const unsigned first = __ballot_sync(kFull, k0 == best);
            return first != 0 ? __ffs(first) - 1 : 32 + __ffs(__ballot_sync(kFull, k1 == best)) - 1;
        }
        if (n <= 128) {
            // Four items per lane (a rank's experts at E=896, R=8), their keys evaluated together: the lane's largest
            // (the lower item on a tie), the warp maximum, then the lowest index holding it: items q*32 + lane, so the
            // first q with a match, then its lowest lane. (The strided loop below: 1-2 us more per K3 planner.)
            uint64_t k[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) k[q] = key_or_zero(key, q * 32 + lane, n);
            uint64_t mine = k[0];
#pragma unroll
            for (int q = 1; q < 4; ++q) mine = k[q] > mine ? k[q] : mine;
            const bool wide = __any_sync(kFull, (mine >> 32) != 0);
            const unsigned hi = wide ? __reduce_max_sync(kFull, unsigned(mine >> 32)) : 0u;
            const unsigned lo = __reduce_max_sync(kFull, unsigned(mine >> 32) == hi ? unsigned(mine) : 0u);
            if (hi == 0 && lo == 0) return -1;
            const uint64_t best = (uint64_t(hi) << 32) | lo;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const unsigned at = __ballot_sync(kFull, k[q] == best);
                if (at != 0) return q * 32 + __ffs(at) - 1;
            }
            return -1;  // unreachable: some lane holds the maximum
        }
#endif
        uint64_t best = 0;
        int at = -1;
        for (int i = lane; i < n; i += 32) {
            const uint64_t k = key(i);
            if (k > best) {
                best = k;
                at = i;
            }
        }
#ifdef __CUDA_ARCH__
        const unsigned hi = __reduce_max_sync(kFull, unsigned(best >> 32));
        const unsigned lo = __reduce_max_sync(kFull, unsigned(best >> 32) == hi ? unsigned(best) : 0u);
        if (hi == 0 && lo == 0) return -1;
        const bool mine = best == ((uint64_t(hi) << 32) | lo);
        return int(__reduce_min_sync(kFull, mine ? unsigned(at) : 0xffffffffu));
#else
        return at;
#endif
    }
    // Only evaluate_alloc adds, and the kernels evaluate with evaluate_alloc_block (the whole block):
    // kept for the executor contract, unreferenced.
#pragma nv_diag_suppress 177
    FLATEP_DEVICE void add(int32_t* p, int32_t v) const { atomicAdd(p, v); }
#pragma nv_diag_default 177
    // Up to 32 groups, or groups of up to 32 items: a group per lane at a time (unrolled, so that the loads overlap);
    // else one group after the other, its items over the lanes and a warp reduction. (R=64, E=896: 64 groups of 14,
    // one after the other, took 11 us of a path candidate on the H200, its items in global memory.)
    FLATEP_DEVICE void group_sum(int groups, int size, const int32_t* v, int32_t* out) const {
        sync();
        if (groups <= 32 || size <= 32) {
            group_sums_by_thread(lane, 32, groups, size, v, out);
            sync();
            return;
        }
        for (int i = 0; i < groups; ++i) {
            int32_t s = 0;
            for (int j = lane; j < size; j += 32) s += v[i * size + j];
            s = __reduce_add_sync(kFull, s);
            if (lane == 0) out[i] = s;
        }
        sync();
    }
    FLATEP_DEVICE void group_max(int groups, int size, const int32_t* v, int32_t* out) const {
        sync();
        if (groups <= 32 || size <= 32) {
            for (int i = lane; i < groups; i += 32) {
                int32_t m = 0;
#pragma unroll 8
                for (int j = 0; j < size; ++j) m = max_of(m, v[i * size + j]);
                out[i] = m;
            }
            sync();
            return;
        }
        for (int i = 0; i < groups; ++i) {
            int32_t m = 0;
            for (int j = lane; j < size; j += 32) m = max_of(m, v[i * size + j]);
            m = __reduce_max_sync(kFull, m);
            if (lane == 0) out[i] = m;
        }
        sync();
    }
    // Every lane its items, each against all n items (broadcast reads, unrolled so that the loads overlap). (Shuffling
    // register copies of the items instead was slower on the H200.)
    FLATEP_DEVICE void ahead_sums(int n, const int32_t* v, int32_t* out) const {
        sync();
        if (n <= 64) {  // both items of a lane in one pass
            const int i0 = lane, i1 = lane + 32;
            const int32_t v0 = i0 < n ? v[i0] : 0, v1 = i1 < n ? v[i1] : 0;
            int32_t s0 = 0, s1 = 0;
#pragma unroll 8
            for (int j = 0; j < n; ++j) {
                const int32_t a = v[j];
                s0 += a > 0 && (a > v0 || (a == v0 && j < i0)) ? a : 0;
                s1 += a > 0 && (a > v1 || (a == v1 && j < i1)) ? a : 0;
            }
            if (i0 < n) out[i0] = v0 > 0 ? s0 : -1;
            if (i1 < n) out[i1] = v1 > 0 ? s1 : -1;
            sync();
            return;
        }
        if (n <= kSortItems) {
            warp_ahead_sums_sorted(v, n, out, lane);
        } else {
            for (int i = lane; i < n; i += 32) out[i] = ahead_of(v, n, i);
        }
        sync();
    }
};

// Block executor for init_home (sum, sync, group_sum) and evaluate_expert (add): the candidate blocks
// compute the home allocation and evaluate with all their threads, while warp 0 builds alone (WarpExec::home_ready
// then skips init_home). red: 32 int64 words of
// shared memory.
struct BlockExec {
    int tid, nthreads;
    long long* red;
    FLATEP_DEVICE void sync() const { __syncthreads(); }
    FLATEP_DEVICE void add(int32_t* p, int32_t v) const { atomicAdd(p, v); }
    template <class F>
    FLATEP_DEVICE int64_t sum(int n, F&& f) const {
        __syncthreads();
        long long s = 0;
        for (int i = tid; i < n; i += nthreads) s += (long long)f(i);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
        if (tid % 32 == 0) red[tid / 32] = s;
        __syncthreads();
        long long t = 0;
        for (int w = 0; w < nthreads / 32; ++w) t += red[w];
        __syncthreads();
        return t;
    }
    // Groups of up to 32 items: a thread per group (the loads of its items overlap). Else warps take the groups in
    // turn; items over the lanes, a warp reduction.
    FLATEP_DEVICE void group_sum(int groups, int size, const int32_t* v, int32_t* out) const {
        __syncthreads();
        if (size <= 32) {
            group_sums_by_thread(tid, nthreads, groups, size, v, out);
            __syncthreads();
            return;
        }
        for (int i = tid / 32; i < groups; i += nthreads / 32) {
            int32_t s = 0;
            for (int j = tid % 32; j < size; j += 32) s += v[i * size + j];
            s = __reduce_add_sync(kFull, s);
            if (tid % 32 == 0) out[i] = s;
        }
        __syncthreads();
    }
    FLATEP_DEVICE bool home_ready(const int32_t*, int64_t*) const { return false; }
};

// The lane group of derive_plan on the GPU: a warp (see planner/derive.hpp's contract).
struct WarpLanes {
    static constexpr int kWidth = 32;
    // derive_rank's items per lane and pass: four loads in flight a lane, and a quarter of the passes. (At E=896, with
    // 32 warps on the SM, a rank task took 6.0 us with one item a lane and 5.8 us with four; H200.)
    static constexpr int kItems = 4;
    int lane;
    FLATEP_DEVICE int32_t inclusive_sum(int32_t v) const {
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t u = __shfl_up_sync(kFull, v, o);
            if (lane >= o) v += u;
        }
        return v;
    }
    FLATEP_DEVICE int32_t from_last(int32_t v) const { return __shfl_sync(kFull, v, 31); }
    FLATEP_DEVICE unsigned sum(unsigned v) const { return __reduce_add_sync(kFull, v); }
    FLATEP_DEVICE int32_t sum(int32_t v) const { return __reduce_add_sync(kFull, v); }
    // Two int64 sums side by side (their shuffles interleaved).
    FLATEP_DEVICE void sum2(int64_t& a, int64_t& b) const {
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_xor_sync(kFull, a, o);
            b += __shfl_xor_sync(kFull, b, o);
        }
    }
    FLATEP_DEVICE int32_t max(int32_t v) const { return __reduce_max_sync(kFull, v); }
    FLATEP_DEVICE int32_t min(int32_t v) const { return __reduce_min_sync(kFull, v); }
    FLATEP_DEVICE unsigned match(int key) const { return __match_any_sync(kFull, key); }
    FLATEP_DEVICE unsigned sum_in(unsigned mask, unsigned v) const { return __reduce_add_sync(mask, v); }
    FLATEP_DEVICE bool leads(unsigned mask) const { return lane == __ffs(mask) - 1; }
    FLATEP_DEVICE bool any(bool b) const { return __any_sync(kFull, b) != 0; }
    FLATEP_DEVICE void add(int32_t* p, int32_t v) const { atomicAdd(p, v); }
    FLATEP_DEVICE void add(unsigned long long* p, unsigned long long v) const { atomicAdd(p, v); }
    FLATEP_DEVICE void sync() const { __syncwarp(); }
};

// The statistics' sums of derive_plan (planner/derive.hpp: what its rank and chunk tasks add) in one pass of a block
// over every cell: loads before and after, replicas in and out per rank, entries in all and kept on their source.
// Integer sums, so the same values in any order. Every thread calls it; sums must be zero.
// The block's warps split in two (one warp: it does both): row warps take one rank each (its allocation row: loads
// after, replicas in; one warp per rank, so plain stores), column warps one chunk of 32 experts each over every rank
// (loads before and replicas out by home rank, entries). (Before, every warp took an expert chunk and added each
// rank's row sums by shared atomics: 4.6 us at K3 on 16 warps, 14.8 us at R=64 on 32, H200.)
FLATEP_DEVICE void derive_sums_pass(int tid, int nthreads, const Layout& l, const int32_t* tpe, const int32_t* alloc,
                                    DeriveSums& sums) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank, lane = tid % 32, warp = tid / 32;
    const int warps = nthreads / 32;
    const int row_warps = warps == 1 ? 1 : min_of(R, warps / 2);
    const int col_first = warps == 1 ? 0 : row_warps;  // the first column warp
    const int col_warps = warps - col_first;
    if (warp < row_warps) {
        constexpr int kItems = 8;  // loads in flight a lane (the row may be in global memory)
        for (int d = warp; d < R; d += row_warps) {
            const int32_t* row = alloc + int64_t(d) * E;
            const int lo = d * epn, hi = lo + epn;
            int32_t after = 0, in = 0;
            for (int e0 = 0; e0 < E; e0 += 32 * kItems) {
                int32_t a[kItems];
#pragma unroll
                for (int j = 0; j < kItems; ++j) {
                    const int e = e0 + j * 32 + lane;
                    a[j] = e < E ? row[e] : 0;
                }
#pragma unroll
                for (int j = 0; j < kItems; ++j) {
                    const int e = e0 + j * 32 + lane;
                    after += a[j];
                    in += a[j] > 0 && (e < lo || e >= hi);
                }
            }
            after = __reduce_add_sync(kFull, after);
            in = __reduce_add_sync(kFull, in);
            if (lane == 0) {
                sums.loads_after[d] = after;
                sums.replicas_in[d] = in;
            }
        }
    }
    if (warp < col_first) return;
    int64_t kept = 0, total = 0;
    for (int e0 = (warp - col_first) * 32; e0 < E; e0 += col_warps * 32) {
        const int e = e0 + lane;
        const bool valid = e < E;
        const int h = valid ? l.home_rank(e) : -1;
        int32_t entries = 0, copies = 0;
        constexpr int kRanks = 8;  // ranks' cells loaded at once
        for (int d0 = 0; d0 < R; d0 += kRanks) {
            int32_t tv[kRanks], av[kRanks];
#pragma unroll
            for (int j = 0; j < kRanks; ++j) {
                const bool in = valid && d0 + j < R;
                tv[j] = in ? tpe[(d0 + j) * E + e] : 0;
                av[j] = in ? alloc[(d0 + j) * E + e] : 0;
            }
#pragma unroll
            for (int j = 0; j < kRanks; ++j) {
                entries += tv[j];
                kept += tv[j] < av[j] ? tv[j] : av[j];
                copies += av[j] > 0 && d0 + j != h;
            }
        }
        total += entries;
        const unsigned same = __match_any_sync(kFull, h);
        const int32_t group_entries = __reduce_add_sync(same, entries);
        const int32_t group_copies = __reduce_add_sync(same, copies);
        if (valid && lane == __ffs(same) - 1) {
            if (group_entries != 0) atomicAdd(&sums.loads_before[h], group_entries);
            if (group_copies != 0) atomicAdd(&sums.replicas_out[h], group_copies);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        kept += __shfl_xor_sync(kFull, kept, o);
        total += __shfl_xor_sync(kFull, total, o);
    }
    if (lane == 0 && total != 0) {
        atomicAdd(&sums.entries_on_source, (unsigned long long)kept);
        atomicAdd(&sums.entries_total, (unsigned long long)total);
    }
}

// Where the blocks of a grid-wide derive add up their statistics' sums (device memory, in the planner's workspace):
// every block adds its own, then takes a ticket; the block with the last ticket computes the statistics. Zero before
// the derive starts (the candidate kernel's greedy block clears it every planner run).
struct DeriveMerge {
    DeriveSums sums;
    unsigned int ticket;
};
constexpr int kDeriveMergeWords = int((sizeof(DeriveMerge) + 3) / 4);

// Clears a DeriveMerge: threads [0, nthreads) of one block.
FLATEP_DEVICE void clear_derive_merge(DeriveMerge* m, int tid, int nthreads) {
    int32_t* w = reinterpret_cast<int32_t*>(m);
    for (int i = tid; i < kDeriveMergeWords; i += nthreads) w[i] = 0;
}

// The derive executor of a block of `nthreads` threads (whole warps): warp w runs tasks w, w + warps, ...; warp 0 the
// scalar statistics. Or of `blocks` > 1 such blocks of one grid, no block waiting for another, in one of two ways:
// * merge_to null: block 0 computes the statistics' sums in a pass of its own (derive_sums_pass) and the statistics,
//   while the tasks are dealt over the warps of blocks 1.. (task t on block 1 + t % (blocks - 1));
// * merge_to set (device memory, zero beforehand): task t runs on warp t / blocks of block t % blocks (the rank tasks,
//   the slowest, on different blocks); each block then adds its tasks' sums to *merge_to and takes a ticket, and the
//   block with the last ticket computes the statistics from the total.
// Integer sums, so the same statistics either way. rec: profile record (null = off) of block 0: every warp's end of
// its tasks (trace[8 + warp]) and the derive stamps; task_rec: the same for the warps' ends on a task block (block
// 1); merge_rec: the record of the block that computes merged statistics (its entry into them and its end).
struct BlockDerive {
    int tid, nthreads;
    PlannerProfileRecord* rec;
    PlannerProfileRecord* task_rec;
    int block = 0, blocks = 1;
    DeriveMerge* merge_to = nullptr;
    PlannerProfileRecord* merge_rec = nullptr;
    FLATEP_DEVICE WarpLanes lanes() const { return WarpLanes{tid % 32}; }
    FLATEP_DEVICE int thread() const { return tid; }
    FLATEP_DEVICE int threads() const { return nthreads; }
    // Several blocks, block 0 computing the statistics' sums in a pass of its own (not merged).
    FLATEP_DEVICE bool stats_block() const { return blocks > 1 && merge_to == nullptr; }
    // Several blocks, the last to finish its tasks merging every block's sums (the other arrangement).
    FLATEP_DEVICE bool merged() const { return blocks > 1 && merge_to != nullptr; }
    FLATEP_DEVICE int first_task() const {
        if (stats_block()) return block == 0 ? INT32_MAX : (tid / 32) * (blocks - 1) + (block - 1);
        return (tid / 32) * blocks + block;
    }
    FLATEP_DEVICE int task_stride() const { return (nthreads / 32) * (stats_block() ? blocks - 1 : blocks); }
    FLATEP_DEVICE bool first_lanes() const { return tid < 32; }
    FLATEP_DEVICE void sync() const { __syncthreads(); }
    FLATEP_DEVICE void tasks_done() const {
        const int warp = tid / 32;
        if (task_rec != nullptr && tid % 32 == 0 && 8 + warp < PlannerProfileRecord::kTrace)
            task_rec->trace[8 + warp] = clock64();
        __syncthreads();
        if (tid == 0) {
            profile_stamp(rec, kStampDeriveSums);
            profile_stamp(rec, kStampDeriveSlots);
        }
        if (rec != nullptr) {  // uniform: profiling only
            __syncthreads();
            if (tid == 0) profile_stamp(rec, kStampDeriveRows);
        }
    }
    FLATEP_DEVICE bool merge(const Layout& l, const int32_t* tpe, const int32_t* alloc, DeriveSums& sums) const {
        if (blocks == 1) return true;
        if (stats_block()) {
            if (block != 0) return false;
            derive_sums_pass(tid, nthreads, l, tpe, alloc, sums);
            __syncthreads();
            return true;
        }
        __shared__ int last;
        DeriveSums& to = merge_to->sums;
        const int R = l.num_ranks;
        for (int r = tid; r < R; r += nthreads) {
            if (sums.loads_before[r] != 0) atomicAdd(&to.loads_before[r], sums.loads_before[r]);
            if (sums.loads_after[r] != 0) atomicAdd(&to.loads_after[r], sums.loads_after[r]);
            if (sums.replicas_in[r] != 0) atomicAdd(&to.replicas_in[r], sums.replicas_in[r]);
            if (sums.replicas_out[r] != 0) atomicAdd(&to.replicas_out[r], sums.replicas_out[r]);
        }
        if (tid == 0) {
            if (sums.entries_total != 0) atomicAdd(&to.entries_total, sums.entries_total);
            if (sums.entries_on_source != 0) atomicAdd(&to.entries_on_source, sums.entries_on_source);
        }
        __threadfence();  // this block's adds before its ticket
        __syncthreads();
        if (tid == 0) last = atomicAdd(&merge_to->ticket, 1u) == unsigned(blocks - 1);
        __syncthreads();
        if (!last) return false;  // uniform over the block
        __threadfence();          // every block's adds (before their tickets) before the reads below
        if (tid == 0) profile_stamp(merge_rec, kStampEntry);
        for (int r = tid; r < R; r += nthreads) {
            sums.loads_before[r] = __ldcg(&to.loads_before[r]);
            sums.loads_after[r] = __ldcg(&to.loads_after[r]);
            sums.replicas_in[r] = __ldcg(&to.replicas_in[r]);
            sums.replicas_out[r] = __ldcg(&to.replicas_out[r]);
        }
        if (tid == 0) {
            sums.entries_total = __ldcg(&to.entries_total);
            sums.entries_on_source = __ldcg(&to.entries_on_source);
        }
        __syncthreads();
        return true;
    }
    FLATEP_DEVICE void done() const {
        __syncthreads();
        if (tid == 0) {
            profile_stamp(merged() ? merge_rec : rec, kStampDeriveEnd);
            if (merged() && merge_rec != nullptr) {
                merge_rec->index = block;
                merge_rec->sm = sm_id();
            }
        }
    }
};

}  // namespace flatep::planner
