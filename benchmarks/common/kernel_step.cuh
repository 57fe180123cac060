// The kernel microbenchmarks' one helper (ops_bench, fp8_bench, serving_bench): R virtual ranks of one GPU
// (LocalDeviceGroup) with the device buffers of one step, and each op's Args for a rank, filled by hand here -- the
// one place outside src/ that fills them, so that a benchmark can time a kernel without its barriers, a barrier
// alone, or a phase of the plan op. Everything else (tests, the Python front) runs the ops through Buffer and
// ExpertPools, which fill them in src/runtime.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/memory.hpp"
#include "internal/api.hpp"

namespace flatep::bench {

namespace {
__global__ void fill_bf16_kernel(uint16_t* dst, int64_t n, uint64_t seed) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint64_t z = seed * 0x9e3779b97f4a7c15ull + uint64_t(i);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        dst[i] = uint16_t(((z & 1) << 15) | ((110 + (z >> 1) % 23) << 7) | ((z >> 8) & 0x7f));
    }
}
}  // namespace

// Fills n bf16 words of device memory with finite values (on the legacy stream): the inputs of the benchmarks.
inline void fill_device_bf16(void* dst, int64_t n, uint64_t seed) {
    fill_bf16_kernel<<<1024, 256>>>(static_cast<uint16_t*>(dst), n, seed);
    FLATEP_CUDA_CHECK_LAUNCH();
}

// One step's shape: the layout, the planner, the tokens each rank passes, and the expert pools: bytes of one expert
// per projection (each rank's own experts and a pool of pool_slots slots; grads: fp32 own gradients and a reduce pool
// of projection 0 for reduce_grad).
struct KernelStepSpec {
    Layout layout;
    PlannerKind planner = PlannerKind::kBalanced;
    std::vector<int> tokens;  // [R]
    bool weighted = true;
    std::vector<int64_t> expert_bytes;
    int pool_slots = 0;
    bool grads = false;
};

// What KernelStep(spec, ..) allocates on the device (common/memory.hpp: its constructor's buffers, every rank).
inline MemoryEstimate kernel_step_memory(const KernelStepSpec& spec) {
    return kernel_step_memory(spec.layout, spec.expert_bytes, spec.pool_slots, spec.grads,
                              int64_t(runtime::plan_workspace_bytes(spec.layout)));
}

class KernelStep {
  public:
    struct Rank {
        int32_t* plan = nullptr;
        void* workspace = nullptr;
        int32_t* topk = nullptr;
        uint16_t *x = nullptr, *y = nullptr, *out = nullptr;
        float* weights = nullptr;
        float* recv_w = nullptr;
        uint16_t* recv_x = nullptr;                      // the symmetric region's receive rows (zero copy)
        std::vector<uint8_t*> own, slots;                // per projection: epn experts, pool_slots experts
        float *grads = nullptr, *reduce_pool = nullptr;  // projection 0, spec.grads
    };

    KernelStep(const KernelStepSpec& spec, testing::LocalDeviceGroup& group) : spec_(spec), group_(group) {
        const Layout& l = spec.layout;
        const int R = l.num_ranks, epn = l.experts_per_rank;
        const int64_t H = l.hidden, nvs = l.num_recv_rows, S = l.num_tokens;
        sym_ = make_symmetric_layout(l);
        regions_ = group.allocate(size_t(sym_.total_bytes));
        ranks_.resize(size_t(R));
        for (int r = 0; r < R; ++r) {
            Rank& k = ranks_[size_t(r)];
            k.plan = alloc<int32_t>(make_plan_sizes(l).total_words);
            k.workspace = alloc<uint8_t>(int64_t(runtime::plan_workspace_bytes(l)));
            k.topk = alloc<int32_t>(S * l.topk);
            k.x = alloc<uint16_t>(S * H);
            k.weights = alloc<float>(S * l.topk);
            k.y = alloc<uint16_t>(nvs * H);
            k.out = alloc<uint16_t>(S * H);
            k.recv_w = alloc<float>(nvs);
            k.recv_x = region_at<uint16_t>(regions_[size_t(r)].local, sym_.recv_x_offset);
            for (int64_t bytes : spec.expert_bytes) {
                k.own.push_back(alloc<uint8_t>(epn * bytes));
                k.slots.push_back(alloc<uint8_t>(spec.pool_slots * bytes));
            }
            if (spec.grads) {
                k.grads = alloc<float>(epn * spec.expert_bytes[0] / 2);
                k.reduce_pool = alloc<float>(int64_t(spec.pool_slots) * spec.expert_bytes[0] / 2);
            }
        }
    }
    ~KernelStep() {
        cudaDeviceSynchronize();
        for (void* p : memory_) cudaFree(p);
        group_.release(regions_);
    }
    KernelStep(const KernelStep&) = delete;
    KernelStep& operator=(const KernelStep&) = delete;

    const Layout& layout() const { return spec_.layout; }
    Rank& rank(int r) { return ranks_[size_t(r)]; }
    const SymmetricRegion& region(int r) const { return regions_[size_t(r)]; }
    const SymmetricLayout& symmetric_layout() const { return sym_; }
    sync::SyncArgs sync(int r) const { return group_.sync_args(r, regions_, sym_.barrier_offset, sym_.status_offset); }

    PlanArgs plan_args(int r) const {
        PlanArgs a{};
        a.layout = spec_.layout;
        a.rank = r;
        a.num_tokens = spec_.tokens[size_t(r)];
        a.topk_idx = ranks_[size_t(r)].topk;
        a.index_bytes = 4;
        a.planner = spec_.planner;
        for (int p = 0; p < spec_.layout.num_ranks; ++p) a.peers[p] = regions_[size_t(r)].peers[p];
        a.plan = make_plan_view(spec_.layout, ranks_[size_t(r)].plan);
        a.sync = sync(r);
        a.workspace = ranks_[size_t(r)].workspace;
        check_plan_args(a);
        return a;
    }
    // The fields every data-plane op's Args share (DispatchArgs, DispatchFp8Args, CombineArgs).
    template <class Args>
    Args data_args(int r) const {
        Args a{};
        a.layout = spec_.layout;
        a.rank = r;
        a.plan = make_plan_view(spec_.layout, ranks_[size_t(r)].plan);
        for (int p = 0; p < spec_.layout.num_ranks; ++p) a.peers[p] = regions_[size_t(r)].peers[p];
        a.sync = sync(r);
        return a;
    }
    DispatchArgs dispatch_args(int r) const {
        DispatchArgs a = data_args<DispatchArgs>(r);
        a.x = ranks_[size_t(r)].x;
        a.topk_weights = spec_.weighted ? ranks_[size_t(r)].weights : nullptr;
        a.recv_x = ranks_[size_t(r)].recv_x;
        a.recv_w = ranks_[size_t(r)].recv_w;
        return a;
    }
    CombineArgs combine_args(int r) const {
        CombineArgs a = data_args<CombineArgs>(r);
        a.y = ranks_[size_t(r)].y;
        a.weights = spec_.weighted ? ranks_[size_t(r)].recv_w : nullptr;
        a.out = ranks_[size_t(r)].out;
        return a;
    }
    // Projections [first, first + count) in one op: the owners push (training) or each rank pulls its first
    // layout.num_slots slots (serving).
    PrefetchArgs prefetch_args(int r, int first, int count, bool push, bool plan_ordered = false) const {
        const int R = spec_.layout.num_ranks;
        PrefetchArgs a{};
        a.rank = r;
        a.num_ranks = R;
        a.experts_per_rank = spec_.layout.experts_per_rank;
        a.num_slots = spec_.layout.num_slots;
        a.slot_expert = make_plan_view(spec_.layout, ranks_[size_t(r)].plan).slot_expert;
        a.pull = !push;
        a.plan_ordered = !push && plan_ordered;
        a.num_projections = count;
        for (int i = 0; i < count; ++i) {
            PrefetchProjection& pp = a.projections[i];
            pp.expert_bytes = spec_.expert_bytes[size_t(first + i)];
            pp.weights = ranks_[size_t(r)].own[size_t(first + i)];
            for (int q = 0; q < R; ++q) {
                pp.owners[q] = push ? nullptr : ranks_[size_t(q)].own[size_t(first + i)];
                pp.slot_pools[q] = push || q == r ? ranks_[size_t(q)].slots[size_t(first + i)] : nullptr;
            }
        }
        a.sync = sync(r);
        check_prefetch_args(a);
        return a;
    }
    GradReduceArgs reduce_args(int r) const {
        GradReduceArgs a{};
        a.rank = r;
        a.num_ranks = spec_.layout.num_ranks;
        a.experts_per_rank = spec_.layout.experts_per_rank;
        a.expert_elems = spec_.expert_bytes[0] / 2;
        a.slot_expert = make_plan_view(spec_.layout, ranks_[size_t(r)].plan).slot_expert;
        a.grads = ranks_[size_t(r)].grads;
        for (int p = 0; p < spec_.layout.num_ranks; ++p) a.reduce_pools[p] = ranks_[size_t(p)].reduce_pool;
        a.sync = sync(r);
        return a;
    }

    // Every rank's plan op; phases < 3: only its first phases (1: the counts' histogram and all-gather; 2: and the
    // planner), for a benchmark's breakdown (the plan is then incomplete).
    void enqueue_plan(int phases = 3) {
        for (int r = 0; r < spec_.layout.num_ranks; ++r) {
            const PlanArgs a = plan_args(r);
            if (phases >= 3) {
                runtime::launch_plan(a, group_.stream(r), group_.num_sms());
                continue;
            }
            uint8_t* ws = static_cast<uint8_t*>(a.workspace);
            kernels::launch_plan_counts(a, ws, group_.stream(r), group_.num_sms());
            if (phases >= 2)
                planner::launch_planner(spec_.layout, a.planner, a.plan, ws + runtime::plan_kernels_part(spec_.layout),
                                        planner::planner_engine(), group_.stream(r));
        }
    }
    std::vector<int32_t> download_plan(int r) const {
        std::vector<int32_t> words(size_t(make_plan_sizes(spec_.layout).total_words));
        FLATEP_CUDA_CHECK(cudaMemcpy(words.data(), ranks_[size_t(r)].plan, words.size() * 4, cudaMemcpyDeviceToHost));
        return words;
    }
    // "" when no rank's barrier failed, else the first failure.
    std::string wait_failure() const {
        for (int r = 0; r < group_.num_ranks(); ++r) {
            const sync::WaitRecord& w = group_.wait_record(r);
            if (w.code != 0)
                return detail::concat("a wait failed: op ", sync::op_name(sync::OpId(w.op)), " rank ", w.rank, " peer ",
                                      w.peer, " (expected ", w.expected, " observed ", w.observed, ")");
        }
        return "";
    }

  private:
    template <class T>
    T* alloc(int64_t n) {
        void* p = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(size_t(n) * sizeof(T), 16)));
        FLATEP_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(size_t(n) * sizeof(T), 16)));
        memory_.push_back(p);
        return static_cast<T*>(p);
    }
    KernelStepSpec spec_;
    testing::LocalDeviceGroup& group_;
    SymmetricLayout sym_;
    std::vector<SymmetricRegion> regions_;
    std::vector<Rank> ranks_;
    std::vector<void*> memory_;
};

}  // namespace flatep::bench
