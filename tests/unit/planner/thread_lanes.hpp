// A lane group of W host threads for the planner's derive (planner/derive.hpp's lane contract, which the GPU's warp
// meets with 32 lanes): each primitive is an exchange between two barriers and `sync` is a barrier, so lanes run
// concurrently between primitives, as a warp's lanes do under independent thread scheduling.
#pragma once

#include <atomic>
#include <barrier>
#include <cstdint>

namespace flatep::testing {

template <int W>
struct LaneShared {
    std::barrier<> bar{W};
    int64_t v[W];
};

// A lane group of W threads (planner/derive.hpp's contract), each taking Q items per pass.
template <int W, int Q>
struct ThreadLanes {
    static_assert(W <= 32, "lane masks are 32-bit");
    static constexpr int kWidth = W;
    static constexpr int kItems = Q;
    int lane;
    LaneShared<W>* sh;

    void sync() const { sh->bar.arrive_and_wait(); }
    // Every lane posts v; f(all values) once all have; then everyone moves on.
    template <class F>
    auto exchange(int64_t v, F&& f) const {
        sh->v[lane] = v;
        sync();
        const auto r = f(static_cast<const int64_t*>(sh->v));
        sync();
        return r;
    }
    int64_t total(int64_t v) const {
        return exchange(v, [](const int64_t* a) {
            int64_t s = 0;
            for (int i = 0; i < W; ++i) s += a[i];
            return s;
        });
    }
    int32_t inclusive_sum(int32_t v) const {
        return exchange(v, [&](const int64_t* a) {
            int32_t s = 0;
            for (int i = 0; i <= lane; ++i) s += int32_t(a[i]);
            return s;
        });
    }
    int32_t from_last(int32_t v) const {
        return exchange(v, [](const int64_t* a) { return int32_t(a[W - 1]); });
    }
    unsigned sum(unsigned v) const { return unsigned(total(v)); }
    int32_t sum(int32_t v) const { return int32_t(total(v)); }
    void sum2(int64_t& a, int64_t& b) const {
        a = total(a);
        b = total(b);
    }
    int32_t max(int32_t v) const {
        return exchange(v, [](const int64_t* a) {
            int64_t m = a[0];
            for (int i = 1; i < W; ++i) m = a[i] > m ? a[i] : m;
            return int32_t(m);
        });
    }
    int32_t min(int32_t v) const { return -max(-v); }
    unsigned match(int key) const {
        return exchange(key, [&](const int64_t* a) {
            unsigned m = 0;
            for (int i = 0; i < W; ++i) m |= unsigned(a[i] == key) << i;
            return m;
        });
    }
    unsigned sum_in(unsigned mask, unsigned v) const {
        return exchange(v, [&](const int64_t* a) {
            unsigned s = 0;
            for (int i = 0; i < W; ++i) s += (mask >> i) & 1u ? unsigned(a[i]) : 0u;
            return s;
        });
    }
    bool leads(unsigned mask) const { return lane == __builtin_ctz(mask); }
    bool any(bool b) const { return total(b ? 1 : 0) != 0; }
    void add(int32_t* p, int32_t v) const { std::atomic_ref<int32_t>(*p).fetch_add(v); }
    void add(unsigned long long* p, unsigned long long v) const {
        std::atomic_ref<unsigned long long>(*p).fetch_add(v);
    }
};

}  // namespace flatep::testing
