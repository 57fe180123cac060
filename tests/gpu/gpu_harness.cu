#include "gpu_harness.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace flatep::gpu_test {

World::World(int num_ranks, bool on_device, const std::vector<int>& devices) : on_device_(on_device) {
    transports_ =
        make_virtual_ranks(num_ranks, on_device ? MemoryKind::kDevice : MemoryKind::kHost, test_timeout_s(), devices);
    if (!on_device) return;
    int sms = 0, device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    FLATEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    num_sms_ = num_ranks > 1 && devices.size() < 2 ? std::max(sms / num_ranks, 1) * 2 : 0;
    for (int r = 0; r < num_ranks; ++r) {
        const std::unique_ptr<DeviceBinding> bound = transports_[size_t(r)]->bind_device();
        cudaStream_t s = nullptr;
        FLATEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        streams_.push_back(s);
    }
}

World::~World() {
    synchronize();
    for (void* p : memory_) cudaFree(p);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
}

Launch World::launch(int r, bool plan_ordered) const {
    return Launch{on_device_ ? static_cast<void*>(streams_[size_t(r)]) : nullptr, num_sms_, OpOptions{plan_ordered}};
}

void World::run(const std::function<void(int)>& fn) {
    if (!on_device_) return run_threads(num_ranks(), fn);
    for (int r = 0; r < num_ranks(); ++r) fn(r);
}

void World::synchronize() const {
    if (on_device_) FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

void* World::alloc_bytes(size_t bytes) {
    bytes = std::max<size_t>(bytes, 16);
    if (!on_device_) return host_memory_.emplace_back(bytes, uint8_t(0)).data();
    void* p = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&p, bytes));
    FLATEP_CUDA_CHECK(cudaMemset(p, 0, bytes));
    memory_.push_back(p);
    return p;
}

void World::copy_in(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    if (!on_device_) return (void)std::memcpy(dst, src, bytes);
    synchronize();
    FLATEP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void World::copy_out(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    if (!on_device_) return (void)std::memcpy(dst, src, bytes);
    synchronize();
    FLATEP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

cudaGraphExec_t World::capture(const std::function<void()>& fn) {
    FLATEP_CHECK(on_device_, "World::capture: a graph needs device ranks");
    cudaStream_t s0 = streams_[0];
    std::vector<cudaEvent_t> events(size_t(num_ranks()) + 1);
    for (cudaEvent_t& e : events) FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
    FLATEP_CUDA_CHECK(cudaEventRecord(events[0], s0));
    for (int r = 1; r < num_ranks(); ++r) FLATEP_CUDA_CHECK(cudaStreamWaitEvent(streams_[size_t(r)], events[0]));
    fn();
    for (int r = 1; r < num_ranks(); ++r) {
        FLATEP_CUDA_CHECK(cudaEventRecord(events[size_t(r)], streams_[size_t(r)]));
        FLATEP_CUDA_CHECK(cudaStreamWaitEvent(s0, events[size_t(r)]));
    }
    FLATEP_CUDA_CHECK(cudaStreamEndCapture(s0, &graph));
    FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaGraphDestroy(graph);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    return exec;
}

void World::replay(cudaGraphExec_t exec) { FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, streams_[0])); }

double test_timeout_s() {
    const char* text = std::getenv("FLATEP_GPU_TEST_TIMEOUT");
    return text != nullptr ? std::atof(text) : 20.0;
}

std::string compare(const Outputs& got, const Outputs& want) {
    for (size_t r = 0; r < want.size(); ++r) {
        for (size_t i = 0; i < want[r].size(); ++i) {
            const Blob &g = got[r][i], &w = want[r][i];
            if (g.bytes.size() != w.bytes.size())
                return detail::concat(w.name, ": rank ", r, ": ", g.bytes.size(), " bytes, expected ", w.bytes.size());
            for (size_t at = 0; at < w.bytes.size(); at += size_t(w.elem_bytes)) {
                if (std::memcmp(&g.bytes[at], &w.bytes[at], size_t(w.elem_bytes)) == 0) continue;
                uint64_t gv = 0, wv = 0;
                std::memcpy(&gv, &g.bytes[at], size_t(w.elem_bytes));
                std::memcpy(&wv, &w.bytes[at], size_t(w.elem_bytes));
                char text[96];
                std::snprintf(text, sizeof(text), "got 0x%llx expected 0x%llx", (unsigned long long)gv,
                              (unsigned long long)wv);
                return detail::concat(w.name, ": rank ", r, " row ", int64_t(at) / w.row_bytes, " col ",
                                      int64_t(at) % w.row_bytes / w.elem_bytes, ": ", text);
            }
        }
    }
    return "";
}

std::vector<RankObjects> make_rank_objects(World& world, const Config& config, const ViewShape& view,
                                           PlannerKind planner, const std::vector<ProjectionShape>& projections,
                                           int view_stride) {
    const int R = world.num_ranks(), epn = config.num_experts / R;
    const bool serving = view.num_slots >= 0 && view.num_slots < epn;
    std::vector<RankObjects> ranks(static_cast<size_t>(R));
    run_threads(R, [&](int r) {
        RankObjects& k = ranks[size_t(r)];
        Config cfg = config;
        cfg.rank = r;
        k.pools = std::make_unique<ExpertPools>(world.transport(r), epn, projections, view.num_slots,
                                                serving ? view_stride : 0);
        k.buffer = std::make_unique<Buffer>(cfg, *k.pools, planner, 0);  // the pools' B and Q
        k.layer = k.pools->register_layer();
    });
    for (RankObjects& k : ranks)
        if (world.on_device()) k.storage = world.alloc<int32_t>(k.buffer->plan_words());
    return ranks;
}

std::vector<int32_t> plan_words(World& world, const Buffer& buffer, const Plan& plan, const int32_t* storage) {
    const Layout& l = internal::layout(buffer);
    const PlanSizes sizes = make_plan_sizes(l);
    std::vector<int32_t> words = storage != nullptr
                                     ? world.get(storage, sizes.total_words)
                                     : std::vector<int32_t>(internal::host_plan(plan).view.tpe_all,
                                                            internal::host_plan(plan).view.tpe_all + sizes.total_words);
    words[size_t(sizes.header + kHeaderGenerationLo)] = words[size_t(sizes.header + kHeaderGenerationHi)] = 0;
    return words;
}

std::string status_of(Buffer& buffer, const Launch& launch) {
    try {
        buffer.check_status(launch);
    } catch (const Error& e) {
        return e.message();
    }
    return "";
}

std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed) {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = routing::finite_bf16(seed, uint64_t(i));
    return v;
}
std::vector<float> random_f32(int64_t n, uint64_t seed, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = routing::data_float(seed, uint64_t(i), lo, hi);
    return v;
}
float canary_f32() {
    float f;
    std::memcpy(&f, &kCanaryF32, 4);
    return f;
}

std::vector<std::vector<int64_t>> make_routing(const CaseSpec& c, uint64_t seed) {
    const Config& g = c.config;
    const int s = c.tokens_of();
    std::vector<std::vector<int64_t>> out(size_t(g.num_ranks));
    const std::vector<double> pop = routing::popularity(g.num_experts, c.sigma, seed);
    std::vector<int32_t> tmp(size_t(s) * g.topk);
    for (int r = 0; r < g.num_ranks; ++r) {
        std::vector<int64_t>& ids = out[size_t(r)];
        ids.resize(tmp.size());
        routing::sample_topk(pop, s, g.topk, seed, r, tmp.data());
        for (size_t i = 0; i < tmp.size(); ++i) {
            // kOneExpert: every token of every rank to the same K experts (the hot expert first).
            ids[i] = c.routing == RoutingKind::kOneExpert ? (3 + int64_t(i) % g.topk) % g.num_experts : tmp[i];
            const uint64_t h = routing::mix64(seed + 77 * uint64_t(r) + i);
            if (c.routing == RoutingKind::kBadIds && h % 97 == 0) ids[i] = (h & 1024) ? -1 : g.num_experts + 3;
        }
    }
    return out;
}

}  // namespace flatep::gpu_test
