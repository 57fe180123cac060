// The GPU tests' harness (no GoogleTest): R virtual ranks driven through the public Buffer and ExpertPools, on the GPU
// and, as the oracle, on the CPU backend, with the same inputs; the outputs of a step compared bit for bit. A World is
// the ranks of one backend (flatep::make_virtual_ranks: threads over the in-process ipc transport, what flatep.virtual
// builds in Python), and a step runs on any World, so the "device" side of every test runs on the CPU backend too
// (each test's --cpu: the harness itself, checked where no GPU exists).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep::gpu_test {

// Name of the plan array holding word w.
inline std::string plan_word_name(const Layout& l, int64_t w) {
    const PlanSizes s = make_plan_sizes(l);
    const std::pair<const char*, int64_t> arrays[] = {
        {"tpe_all", s.tpe_all},         {"alloc", s.alloc},           {"keep", s.keep},
        {"spill_start", s.spill_start}, {"take_start", s.take_start}, {"group_row", s.group_row},
        {"slot_expert", s.slot_expert}, {"cu_seqlens", s.cu_seqlens}, {"stats", s.stats},
        {"entry_rank", s.entry_rank},   {"entry_row", s.entry_row},   {"row_head", s.row_head},
        {"row_next", s.row_next},       {"header", s.header}};
    std::string name = "?";
    int64_t base = 0;
    for (auto& a : arrays) {
        if (w >= a.second) {
            name = a.first;
            base = a.second;
        }
    }
    return name + "[" + std::to_string(w - base) + "]";
}

// R virtual ranks of one backend and the memory a test moves through them. Host memory: each op blocks its thread, so
// run() gives every rank a thread; device memory (CUDA device `devices`, one per block of ranks): ops only enqueue, so
// run() calls the ranks in order on this thread, each on its own stream, with an SM budget that keeps every rank's
// kernels resident at once (twice the SMs / R, as LocalDeviceGroup; 0 = no cap for one rank).
class World {
  public:
    World(int num_ranks, bool on_device, const std::vector<int>& devices = {});
    ~World();
    World(const World&) = delete;
    World& operator=(const World&) = delete;

    int num_ranks() const { return int(transports_.size()); }
    bool on_device() const { return on_device_; }
    const std::shared_ptr<Transport>& transport(int r) const { return transports_[size_t(r)]; }
    Launch launch(int r, bool plan_ordered = false) const;
    void run(const std::function<void(int rank)>& fn);  // every rank's part, see above
    void synchronize() const;                           // the device's work done (no-op on the host)

    // Memory of the world's kind (freed with it), zero-filled, and synchronous copies into and out of it (which wait
    // for the device first).
    template <class T>
    T* alloc(int64_t n) {
        return static_cast<T*>(alloc_bytes(size_t(n) * sizeof(T)));
    }
    void copy_in(void* dst, const void* src, size_t bytes);
    void copy_out(void* dst, const void* src, size_t bytes);
    template <class T>
    void put(T* dst, const std::vector<T>& v) {
        copy_in(dst, v.data(), v.size() * sizeof(T));
    }
    template <class T>
    std::vector<T> get(const T* src, int64_t n) {
        std::vector<T> v(static_cast<size_t>(n));
        copy_out(v.data(), src, v.size() * sizeof(T));
        return v;
    }
    template <class T>
    void fill(T* dst, int64_t n, T value) {
        put(dst, std::vector<T>(size_t(n), value));
    }

    // Device worlds: fn's work on every rank's stream captured as one graph (forked from and joined into rank 0's).
    cudaGraphExec_t capture(const std::function<void()>& fn);
    void replay(cudaGraphExec_t exec);

  private:
    void* alloc_bytes(size_t bytes);
    bool on_device_;
    int num_sms_ = 0;
    std::vector<std::shared_ptr<Transport>> transports_;
    std::vector<cudaStream_t> streams_;
    std::vector<void*> memory_;
    std::vector<std::vector<uint8_t>> host_memory_;
};

// The seconds of a cross-rank wait in the tests: FLATEP_GPU_TEST_TIMEOUT (default 20).
double test_timeout_s();

// One output of one rank: raw bytes in rows of row_bytes, named for the first mismatch.
struct Blob {
    std::string name;
    std::vector<uint8_t> bytes;
    int64_t row_bytes;
    int elem_bytes;
};
using Outputs = std::vector<std::vector<Blob>>;  // [rank][blob]

template <class T>
Blob blob(std::string name, const std::vector<T>& v, int64_t row_elems) {
    Blob b{std::move(name), std::vector<uint8_t>(v.size() * sizeof(T)), row_elems * int64_t(sizeof(T)), sizeof(T)};
    if (!v.empty()) std::memcpy(b.bytes.data(), v.data(), b.bytes.size());
    return b;
}
// "" when every blob of `got` has `want`'s bits, else the first difference: "name: rank r row i col j: got 0x..
// expected 0x..".
std::string compare(const Outputs& got, const Outputs& want);

// What every rank of a step holds: its ExpertPools (B = view.num_slots: -1 or epn train, B < epn serve; view_stride
// asked of serving pools, 0 the smallest), the Buffer made from them, a layer, the step's plan and, on the device, the
// storage the plan lives in (read back whole).
struct RankObjects {
    std::unique_ptr<ExpertPools> pools;
    std::unique_ptr<Buffer> buffer;
    ExpertLayer layer;
    Plan plan;
    int32_t* storage = nullptr;
};
// Every rank's objects (the constructors are collective: built on R threads).
std::vector<RankObjects> make_rank_objects(World& world, const Config& config, const ViewShape& view,
                                           PlannerKind planner, const std::vector<ProjectionShape>& projections,
                                           int view_stride);

// The plan's words (device plans: the caller's storage; host plans: their arrays) with the generation the runtime
// stamps cleared (it counts the Buffer's plan() calls, which differ between an eager step and a graph's replay).
std::vector<int32_t> plan_words(World& world, const Buffer& buffer, const Plan& plan, const int32_t* storage);
// What check_status reports on a rank: "" or the error's text (a synchronising read).
std::string status_of(Buffer& buffer, const Launch& launch);

// n values of routing::finite_bf16 / data_float (the data of tests and benchmarks) of stream `seed`.
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed);
std::vector<float> random_f32(int64_t n, uint64_t seed, float lo, float hi);

constexpr int kCanaryRows = 4;
constexpr uint16_t kCanary = 0x7fa5;         // a bf16 NaN pattern nothing writes
constexpr uint32_t kCanaryF32 = 0x7fa5a5a5;  // an fp32 NaN pattern nothing writes
float canary_f32();

// A step's common case: the shape and the group layout (B and Q: the pools'), the planner, the routing.
enum class RoutingKind { kRandom, kOneExpert, kBadIds };
struct CaseSpec {
    std::string name;
    Config config;
    ViewShape view;  // B and Q of the pools (view_stride: asked of host pools; device pools take the smallest)
    PlannerKind planner = PlannerKind::kBalanced;
    RoutingKind routing = RoutingKind::kRandom;
    double sigma = 1.0;
    uint64_t seed = 1;
    int num_tokens = -1;  // tokens passed per rank (-1: S)
    int index_bytes = 4;
    bool weighted = true;
    bool separate_recv = true;      // recv_x outside the symmetric region (with canary rows around it)
    bool backward = false;          // also combine's backward (dispatch, combine_grad) and dispatch's (combine)
    int64_t expert_elems = 1024;    // prefetch / reduce_grad: bf16 elements of one expert
    int64_t grads_elems = 1024;     // backward: write_grads' experts (two more projections)
    bool misaligned_grads = false;  // write_grads' gradients off 16-byte alignment: its element-by-element kernel
    int tokens_of() const { return num_tokens < 0 ? config.num_tokens : num_tokens; }
};
// Topk ids of every rank: [R][s*K] int64.
std::vector<std::vector<int64_t>> make_routing(const CaseSpec& c, uint64_t seed);
using testing::make_config;  // unit/host/rank_threads.hpp: the tests' one Config helper

}  // namespace flatep::gpu_test
