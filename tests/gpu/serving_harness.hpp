// A serving step of R ranks (issues 43 and 47) on the GPU (LocalDeviceGroup virtual ranks) and, as the oracle, on the
// CPU backend (LocalHostWorld threads): plan, dispatch, the pull prefetch of every rank's B slots (one call per
// projection, e.g. FP8 weights and their block scales as a companion projection) and combine, with a token count per
// rank (0: an empty rank, whose token inputs and outputs are null on both backends). Shared by test_gpu_serving and
// benchmarks/serving_bench. No GoogleTest.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/prefetch_args.hpp"
#include "testing/local_device.hpp"

namespace flatep::gpu_test {

// Every rank's own experts and its slot pool, per projection, in device memory. The virtual ranks share one process,
// so each rank's pointers are readable (and, for the push, writable) by every rank as they are. Slot pools hold
// num_slots experts; a pull with B <= num_slots fills the first B.
struct DevicePools {
    DevicePools(int num_ranks, int experts_per_rank, int num_slots, std::vector<int64_t> expert_bytes);
    ~DevicePools();
    DevicePools(const DevicePools&) = delete;
    DevicePools& operator=(const DevicePools&) = delete;
    int num_projections() const { return int(expert_bytes.size()); }

    int num_ranks, experts_per_rank, num_slots;
    std::vector<int64_t> expert_bytes;         // [P] bytes of one expert (multiples of 16)
    std::vector<std::vector<uint8_t*>> own;    // [P][R] epn experts
    std::vector<std::vector<uint8_t*>> slots;  // [P][R] num_slots experts
};

// One serving step's shape: the layout's config (num_slots B, view_stride Q), the planner, the tokens of each rank.
struct ServingSpec {
    std::string name;
    Config config;
    PlannerKind planner = PlannerKind::kBalanced;
    std::vector<int> tokens;  // [R] tokens each rank passes (0 .. S)
    bool weighted = true;
    bool prefetch = true;        // the step pulls the slots (the owner planner's step has none to pull)
    bool prefetch_push = false;  // push instead of pull (training's prefetch; B = epn only)
    bool plan_ordered = false;   // the pull without its barrier (PrefetchArgs::plan_ordered), as nn.MoE serves
    // Dispatch and combine without their entry barriers (DispatchArgs / CombineArgs::plan_ordered), as nn.MoE serves.
    bool step_ordered = false;
    // Dispatch trusts the receive region's row marks once a dispatch since the last upload set them, as a Buffer does
    // (DispatchArgs::marks_valid: padding rows already zero are not zeroed again). Off: every dispatch zeroes every
    // padding row (the tests' setting, which trusts nothing).
    bool trust_marks = false;
    // The static planner's placement ([R][B] expert ids, -1 empty): its table in host memory for the CPU backend, in
    // device memory (set up once, before the steps) for the GPU planner.
    std::vector<int32_t> placement;
};

// Inputs of one step (identical on both backends).
struct ServingInputs {
    std::vector<std::vector<int32_t>> topk;              // [R][s_r*K]
    std::vector<std::vector<uint16_t>> x;                // [R][s_r*H]
    std::vector<std::vector<float>> weights;             // [R][s_r*K]
    std::vector<std::vector<uint16_t>> y;                // [R][NvS*H] expert outputs
    std::vector<std::vector<std::vector<uint8_t>>> own;  // [P][R][epn*expert_bytes] own experts' weights
};

// Routing with popularity sigma (seeded; every rank its own draw), the experts homed on the first `hot_ranks` ranks
// 32x as popular (their home ranks overflow, so each other rank takes rows of many of them), and random data of every
// input.
ServingInputs make_serving_inputs(const ServingSpec& spec, const Layout& l, const std::vector<int64_t>& expert_bytes,
                                  double sigma, uint64_t seed, int hot_ranks = 0);

// Outputs of one step of one rank (host copies).
struct ServingOutputs {
    std::vector<int32_t> plan;                // the whole plan allocation
    std::vector<uint16_t> recv_x;             // [NvS*H]
    std::vector<float> recv_w;                // [NvS]
    std::vector<uint16_t> out;                // [S*H]: s_r rows, then canary rows nobody may write
    std::vector<std::vector<uint8_t>> slots;  // [P][B*expert_bytes] (slots without an expert keep kSlotCanary)
    int32_t status[4];
};
constexpr uint16_t kOutCanary = 0x7fa5;  // a bf16 NaN pattern nothing writes
constexpr uint8_t kSlotCanary = 0xa5;

// The step on the CPU backend (R threads).
std::vector<ServingOutputs> run_serving_host(const ServingSpec& spec, const Layout& l, const ServingInputs& in);

// Device state of a step over `pools`: buffers sized once (for S tokens a rank), reused by steps and graph replays.
// Ranks with s = 0 pass null token inputs and outputs.
class ServingDevice {
  public:
    ServingDevice(const ServingSpec& spec, const Layout& l, testing::LocalDeviceGroup& group, DevicePools& pools);
    ~ServingDevice();
    ServingDevice(const ServingDevice&) = delete;
    ServingDevice& operator=(const ServingDevice&) = delete;

    void upload(const ServingInputs& in);  // inputs into the device buffers, canaries around outputs (synchronous)
    // The ops of every rank on the rank streams (no host sync, capturable).
    // phases < 3: only the plan op's first phases (1: histogram and all-gather of the counts; 2: and the planner), for
    // the benchmark's breakdown; the plan is then incomplete.
    void enqueue_plan(int phases = 3);
    void enqueue_dispatch();
    // Projections [first, first + count) (count -1: all from first) pulled (or pushed) in one op, as
    // ExpertPools::prefetch moves a layer, or in one op per projection (op_per_projection: the form before one op
    // carried several, kept for the benchmark's A/B).
    void enqueue_prefetch(int first = 0, int count = -1, bool push = false, bool op_per_projection = false);
    // Later pulls with (or without) their barrier: spec.plan_ordered from now on.
    void set_plan_ordered(bool plan_ordered) { spec_.plan_ordered = plan_ordered; }
    // Later dispatches and combines with (or without) their entry barriers: spec.step_ordered from now on.
    void set_step_ordered(bool step_ordered) { spec_.step_ordered = step_ordered; }
    void enqueue_combine();
    // plan, dispatch, prefetch of projections [prefetch_first, prefetch_first + prefetch_count) in one op (count -1:
    // all from prefetch_first; 0: none; when spec.prefetch), combine
    void enqueue_step(int prefetch_count = -1, int prefetch_first = 0);
    std::vector<ServingOutputs> download();
    // rank r's plan (host copy of its global part and its own part).
    std::vector<int32_t> download_plan(int rank) const;
    // Empty when no rank's barrier timed out, else the first one's description.
    std::string wait_failure() const;

    struct PerRank {
        int32_t* plan = nullptr;
        void* workspace = nullptr;
        int32_t* topk = nullptr;  // null when s = 0 (so are x, weights, out)
        uint16_t* x = nullptr;
        float* weights = nullptr;
        uint16_t* recv_x = nullptr;  // the symmetric region's receive rows (zero copy)
        float* recv_w = nullptr;
        uint16_t* y = nullptr;
        uint16_t* out = nullptr;  // [S*H]
    };
    const Layout& layout() const { return layout_; }
    PerRank& rank(int r) { return ranks_[r]; }
    // Projections [first, first + count) in one op.
    PrefetchArgs prefetch_args(int r, int first, int count, bool push) const;

  private:
    sync::SyncArgs sync(int r) const;
    ServingSpec spec_;
    Layout layout_;
    SymmetricLayout sym_;
    testing::LocalDeviceGroup& group_;
    DevicePools& pools_;
    std::vector<SymmetricRegion> regions_;
    std::vector<PerRank> ranks_;
    bool marks_set_ = false;        // a dispatch since the last upload marked every rank's receive rows
    int32_t* placement_ = nullptr;  // the static planner's placement table (device memory), null otherwise
};

}  // namespace flatep::gpu_test
