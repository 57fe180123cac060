#include "gpu_harness.hpp"

#include <exception>

#include "../unit/host/rank_threads.hpp"  // testing::run_ranks
#include "common/check.hpp"
#include "planner/planner.hpp"
#include "sync/barrier_host.hpp"
#include "sync/sync.hpp"

namespace flatep::gpu_test {

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

void fill_device_bf16(void* dst, int64_t n, uint64_t seed) {
    fill_bf16_kernel<<<1024, 256>>>(static_cast<uint16_t*>(dst), n, seed);
    FLATEP_CUDA_CHECK_LAUNCH();
}

sync::SyncArgs host_sync(const SymmetricRegion& reg, const SymmetricLayout& sym, int rank, int num_ranks,
                         uint64_t* epoch) {
    sync::SyncArgs s{};
    for (int p = 0; p < num_ranks; ++p) s.flags[p] = reinterpret_cast<uint64_t*>(reg.peers[p] + sym.barrier_offset);
    s.epoch = epoch;
    s.status = reinterpret_cast<int32_t*>(reg.local + sym.status_offset);
    s.rank = rank;
    s.num_ranks = num_ranks;
    s.timeout_s = 60.0;
    return s;
}

void run_host_ranks(int num_ranks, const std::function<void(int rank)>& fn) {
    const std::string failed = testing::failures(testing::run_ranks(num_ranks, fn));
    FLATEP_CHECK_RUNTIME(failed.empty(), "host ", failed);
}

namespace {
int tokens_of(const CaseSpec& c, const Layout& l) { return c.num_tokens < 0 ? l.num_tokens : c.num_tokens; }
}  // namespace

std::vector<RankOutputs> run_host(const CaseSpec& c, const Layout& l, const StepInputs& in) {
    const int R = l.num_ranks, s = tokens_of(c, l), epn = l.experts_per_rank;
    const int64_t H = l.hidden, nvs = l.num_recv_rows, pe = int64_t(epn) * c.expert_elems;
    const SymmetricLayout sym = make_symmetric_layout(l);
    transport::LocalHostWorld world(R, 120.0);
    std::vector<RankOutputs> outs(R);
    std::vector<std::string> errors(R);
    std::vector<std::thread> threads;
    std::vector<uint64_t> epochs(R, 0);
    for (int r = 0; r < R; ++r) {
        threads.emplace_back([&, r] {
            try {
                auto t = world.transport(r);
                SymmetricRegion reg = t->allocate(size_t(sym.total_bytes));
                SymmetricRegion slot = t->allocate(size_t(pe) * 2);
                SymmetricRegion red = t->allocate(size_t(pe) * 4);
                std::memcpy(red.local, in.red_pool[r].data(), size_t(pe) * 4);
                const sync::SyncArgs sync = host_sync(reg, sym, r, R, &epochs[r]);
                RankOutputs& o = outs[r];
                planner::HostPlan plan(l);
                std::vector<int32_t> topk32;
                const void* topk = in.topk[r].data();
                if (c.index_bytes == 4) {
                    topk32.assign(in.topk[r].begin(), in.topk[r].end());
                    topk = topk32.data();
                }
                PlanArgs pa{};
                pa.layout = l;
                pa.rank = r;
                pa.num_tokens = s;
                pa.topk_idx = topk;
                pa.index_bytes = c.index_bytes;
                pa.planner = c.planner;
                for (int p = 0; p < R; ++p) pa.peers[p] = reg.peers[p];
                pa.plan = plan.view;
                pa.sync = sync;
                runtime::run_host_plan(pa);

                if (c.backward) {  // write_grads (local) of a bf16 and an fp32 gradient into canary-filled views
                    const int64_t ge = 2 * int64_t(epn) * c.grads_elems;
                    for (int bytes : {2, 4}) {
                        std::vector<float>& dst = bytes == 2 ? o.wgrads16 : o.wgrads32;
                        dst.resize(size_t(ge));
                        const uint32_t canary = DeviceCase::kCanaryF32;
                        for (float& v : dst) std::memcpy(&v, &canary, 4);
                        WriteGradsArgs wa{};
                        wa.experts_per_rank = epn;
                        wa.expert_elems = c.grads_elems;
                        wa.slot_expert = plan.view.slot_expert + int64_t(r) * epn;
                        wa.cu_seqlens = plan.view.cu_seqlens + int64_t(r) * l.num_groups();
                        wa.grad = bytes == 2 ? static_cast<const void*>(in.wgrad16[r].data()) : in.wgrad32[r].data();
                        wa.grad_bytes = bytes;
                        wa.grads = dst.data();
                        host::run(wa);
                        if (bytes == 4) {  // then accumulate the bf16 gradient on top (own groups add, slots copy)
                            wa.grad = in.wgrad16[r].data();
                            wa.grad_bytes = 2;
                            wa.accumulate = true;
                            host::run(wa);
                        }
                    }
                }

                std::vector<uint16_t> recv_sep;
                o.recv_w.assign(size_t(nvs), 0.0f);
                DispatchArgs da{};
                da.layout = l;
                da.rank = r;
                da.x = in.x[r].data();
                da.topk_weights = c.weighted ? in.weights[r].data() : nullptr;
                da.plan = plan.view;
                for (int p = 0; p < R; ++p) da.peers[p] = reg.peers[p];
                if (c.separate_recv) {
                    recv_sep.assign(size_t(nvs * H), DeviceCase::kCanary);
                    da.recv_x = recv_sep.data();
                } else {
                    da.recv_x = reinterpret_cast<uint16_t*>(reg.local + sym.recv_x_offset);
                }
                da.recv_w = o.recv_w.data();
                da.sync = sync;
                host::run(da);
                if (c.separate_recv) {
                    o.recv_x = std::move(recv_sep);
                } else {
                    o.recv_x.assign(da.recv_x, da.recv_x + nvs * H);
                }

                std::vector<float> ones;
                PrefetchArgs fa{};
                fa.rank = r;
                fa.num_ranks = R;
                fa.experts_per_rank = epn;
                fa.num_slots = epn;
                fa.num_projections = 1;
                fa.projections[0].expert_bytes = c.expert_elems * 2;
                fa.slot_expert = plan.view.slot_expert;
                fa.projections[0].weights = reinterpret_cast<const uint8_t*>(in.expert_w[r].data());
                for (int p = 0; p < R; ++p) fa.projections[0].slot_pools[p] = slot.peers[p];
                fa.sync = sync;
                host::run(fa);
                o.slot_pool.assign(reinterpret_cast<uint16_t*>(slot.local),
                                   reinterpret_cast<uint16_t*>(slot.local) + pe);

                o.out.assign(size_t(s * H), 0);
                CombineArgs ca{};
                ca.layout = l;
                ca.rank = r;
                ca.y = in.y[r].data();
                ca.weights = c.weighted ? o.recv_w.data() : nullptr;
                ca.plan = plan.view;
                for (int p = 0; p < R; ++p) ca.peers[p] = reg.peers[p];
                ca.out = o.out.data();
                ca.sync = sync;
                host::run(ca);

                if (c.backward) {
                    std::vector<uint16_t> recv_g(size_t(nvs * H), DeviceCase::kCanary);
                    DispatchArgs db = da;
                    db.x = in.gout[r].data();
                    db.topk_weights = nullptr;
                    db.recv_x = recv_g.data();
                    db.recv_w = nullptr;
                    host::run(db);
                    o.recv_gx = std::move(recv_g);
                    // combine_grad over the backward rows; y = the forward dispatch's rows when they are separate
                    // (their rows past the last group end hold NaN canaries that must not be read), weights = recv_w.
                    CombineGradArgs gg{};
                    gg.layout = l;
                    gg.rank = r;
                    gg.plan = plan.view;
                    gg.rows = o.recv_gx.data();
                    gg.y = c.separate_recv ? o.recv_x.data() : in.y[r].data();
                    gg.weights = o.recv_w.data();
                    o.grad_y.assign(size_t(nvs * H), 0);
                    o.grad_w.assign(size_t(nvs), 0.0f);
                    gg.grad_y = o.grad_y.data();
                    gg.grad_weights = o.grad_w.data();
                    host::run(gg);
                    o.gx.assign(size_t(s * H), 0);
                    CombineArgs cb = ca;
                    cb.y = in.gy[r].data();
                    cb.weights = nullptr;
                    cb.out = o.gx.data();
                    host::run(cb);
                }

                o.grads = in.grads[r];
                GradReduceArgs ga{};
                ga.rank = r;
                ga.num_ranks = R;
                ga.experts_per_rank = epn;
                ga.expert_elems = c.expert_elems;
                ga.slot_expert = plan.view.slot_expert;
                ga.grads = o.grads.data();
                for (int p = 0; p < R; ++p) ga.reduce_pools[p] = reinterpret_cast<float*>(red.peers[p]);
                ga.sync = sync;
                host::run(ga);
                // Every rank must be done reading every pool before any copy-out / release.
                sync::host::barrier(sync, sync::kOpNone);
                o.red_pool.assign(reinterpret_cast<float*>(red.local), reinterpret_cast<float*>(red.local) + pe);
                o.plan.assign(plan.view.tpe_all, plan.view.tpe_all + make_plan_sizes(l).total_words);
                std::memcpy(o.status, reg.local + sym.status_offset, 16);
                sync::host::barrier(sync, sync::kOpNone);
                t->release(red);
                t->release(slot);
                t->release(reg);
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < R; ++r) FLATEP_CHECK_RUNTIME(errors[r].empty(), "host rank ", r, ": ", errors[r]);
    return outs;
}

DeviceCase::DeviceCase(const CaseSpec& c, const Layout& l, testing::LocalDeviceGroup& g)
    : spec(c), layout(l), sym(make_symmetric_layout(l)), group(g), num_tokens(tokens_of(c, l)) {
    const int R = l.num_ranks, epn = l.experts_per_rank;
    const int64_t H = l.hidden, nvs = l.num_recv_rows, pe = int64_t(epn) * c.expert_elems;
    const int64_t S = l.num_tokens;
    regions = group.allocate(size_t(sym.total_bytes));
    slot_regions = group.allocate(size_t(pe) * 2);
    pull_regions = group.allocate(size_t(pe) * 2);
    red_regions = group.allocate(size_t(pe) * 4);
    ranks.resize(R);
    const size_t plan_bytes = size_t(make_plan_sizes(l).total_words) * 4;
    for (int r = 0; r < R; ++r) {
        PerRank& p = ranks[r];
        FLATEP_CUDA_CHECK(cudaMalloc(&p.plan, plan_bytes));
        FLATEP_CUDA_CHECK(cudaMemset(p.plan, 0, plan_bytes));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.workspace, runtime::plan_workspace_bytes(l)));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.topk, size_t(S) * l.topk * 8 + 16));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.x, size_t(S * H) * 2 + 16));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.weights, size_t(S) * l.topk * 4 + 16));
        const size_t recv_rows = size_t(nvs + 2 * kCanaryRows);
        if (c.separate_recv) {
            FLATEP_CUDA_CHECK(cudaMalloc(&p.recv_alloc, recv_rows * H * 2));
            p.recv_x = p.recv_alloc + kCanaryRows * H;
        } else {
            p.recv_x = reinterpret_cast<uint16_t*>(regions[r].local + sym.recv_x_offset);
        }
        FLATEP_CUDA_CHECK(cudaMalloc(&p.recv_w, size_t(nvs) * 4));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.y, size_t(nvs * H) * 2));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.out_alloc, size_t((S + kCanaryRows) * H) * 2));
        if (c.backward) {
            FLATEP_CUDA_CHECK(cudaMalloc(&p.gout, size_t(S * H) * 2 + 16));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.recv_galloc, recv_rows * H * 2));
            p.recv_gx = p.recv_galloc + kCanaryRows * H;
            FLATEP_CUDA_CHECK(cudaMalloc(&p.gy, size_t(nvs * H) * 2));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.gx_alloc, size_t((S + kCanaryRows) * H) * 2));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.grad_y_alloc, recv_rows * H * 2));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.grad_w_alloc, recv_rows * 4));
            const size_t ge = size_t(2 * epn) * size_t(c.grads_elems);
            FLATEP_CUDA_CHECK(cudaMalloc(&p.wgrad16, ge * 2));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.wgrad32, ge * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.wgrads16, ge * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.wgrads32, ge * 4));
        }
        FLATEP_CUDA_CHECK(cudaMalloc(&p.expert_w, size_t(pe) * 2 + 16));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.grads, size_t(pe) * 4 + 16));
    }
}

DeviceCase::~DeviceCase() {
    cudaDeviceSynchronize();
    for (PerRank& p : ranks) {
        for (void* ptr : {(void*)p.plan, p.workspace, p.topk, (void*)p.x, (void*)p.weights, (void*)p.recv_alloc,
                          (void*)p.recv_w, (void*)p.y, (void*)p.out_alloc, (void*)p.gout, (void*)p.recv_galloc,
                          (void*)p.gy, (void*)p.gx_alloc, (void*)p.expert_w, (void*)p.grads}) {
            if (ptr != nullptr) cudaFree(ptr);
        }
        for (void* ptr : {(void*)p.grad_y_alloc, (void*)p.grad_w_alloc, (void*)p.wgrad16, (void*)p.wgrad32,
                          (void*)p.wgrads16, (void*)p.wgrads32}) {  // backward cases only
            if (ptr != nullptr) cudaFree(ptr);
        }
    }
    group.release(red_regions);
    group.release(slot_regions);
    group.release(pull_regions);
    group.release(regions);
}

namespace {
// Fills n bf16 words of device memory with the canary pattern.
void fill_canary(uint16_t* dst, size_t n) {
    std::vector<uint16_t> host(n, DeviceCase::kCanary);
    FLATEP_CUDA_CHECK(cudaMemcpy(dst, host.data(), n * 2, cudaMemcpyHostToDevice));
}
void fill_canary_f32(float* dst, size_t n) {
    std::vector<uint32_t> host(n, DeviceCase::kCanaryF32);
    FLATEP_CUDA_CHECK(cudaMemcpy(dst, host.data(), n * 4, cudaMemcpyHostToDevice));
}
}  // namespace

void DeviceCase::upload(const StepInputs& in) {
    const int R = layout.num_ranks, s = num_tokens;
    const int64_t H = layout.hidden, nvs = layout.num_recv_rows, S = layout.num_tokens;
    const int64_t pe = int64_t(layout.experts_per_rank) * spec.expert_elems;
    group.synchronize();
    for (int r = 0; r < R; ++r) {
        PerRank& p = ranks[r];
        if (spec.index_bytes == 8) {
            FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, in.topk[r].data(), in.topk[r].size() * 8, cudaMemcpyHostToDevice));
        } else {
            std::vector<int32_t> t32(in.topk[r].begin(), in.topk[r].end());
            FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, t32.data(), t32.size() * 4, cudaMemcpyHostToDevice));
        }
        FLATEP_CUDA_CHECK(cudaMemcpy(p.x, in.x[r].data(), size_t(s * H) * 2, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(
            cudaMemcpy(p.weights, in.weights[r].data(), in.weights[r].size() * 4, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(cudaMemcpy(p.y, in.y[r].data(), size_t(nvs * H) * 2, cudaMemcpyHostToDevice));
        if (spec.separate_recv) fill_canary(p.recv_alloc, size_t((nvs + 2 * kCanaryRows) * H));
        FLATEP_CUDA_CHECK(cudaMemset(p.recv_w, 0, size_t(nvs) * 4));
        fill_canary(p.out_alloc, size_t((S + kCanaryRows) * H));
        if (spec.backward) {
            FLATEP_CUDA_CHECK(cudaMemcpy(p.gout, in.gout[r].data(), size_t(s * H) * 2, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(p.gy, in.gy[r].data(), size_t(nvs * H) * 2, cudaMemcpyHostToDevice));
            fill_canary(p.recv_galloc, size_t((nvs + 2 * kCanaryRows) * H));
            fill_canary(p.gx_alloc, size_t((S + kCanaryRows) * H));
            fill_canary(p.grad_y_alloc, size_t((nvs + 2 * kCanaryRows) * H));
            fill_canary_f32(p.grad_w_alloc, size_t(nvs + 2 * kCanaryRows));
            const size_t ge = size_t(2 * layout.experts_per_rank) * size_t(spec.grads_elems);
            FLATEP_CUDA_CHECK(cudaMemcpy(p.wgrad16, in.wgrad16[r].data(), ge * 2, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(p.wgrad32, in.wgrad32[r].data(), ge * 4, cudaMemcpyHostToDevice));
            fill_canary_f32(p.wgrads16, ge);
            fill_canary_f32(p.wgrads32, ge);
        }
        FLATEP_CUDA_CHECK(cudaMemcpy(p.expert_w, in.expert_w[r].data(), size_t(pe) * 2, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(cudaMemcpy(p.grads, in.grads[r].data(), size_t(pe) * 4, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(
            cudaMemcpy(red_regions[r].local, in.red_pool[r].data(), size_t(pe) * 4, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(cudaMemset(slot_regions[r].local, 0, size_t(pe) * 2));
        FLATEP_CUDA_CHECK(cudaMemset(pull_regions[r].local, 0, size_t(pe) * 2));
        FLATEP_CUDA_CHECK(cudaMemset(regions[r].local + sym.status_offset, 0, 16));
        FLATEP_CUDA_CHECK(cudaMemset(p.plan, 0, size_t(make_plan_sizes(layout).total_words) * 4));
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceCase::enqueue_step() {
    const Layout& l = layout;
    const int R = l.num_ranks;
    auto plan_view = [&](int r) { return make_plan_view(l, ranks[r].plan); };
    auto sync = [&](int r) { return group.sync_args(r, regions, sym.barrier_offset, sym.status_offset); };
    for (int r = 0; r < R; ++r) {
        PlanArgs a{};
        a.layout = l;
        a.rank = r;
        a.num_tokens = num_tokens;
        a.topk_idx = ranks[r].topk;
        a.index_bytes = spec.index_bytes;
        a.planner = spec.planner;
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.plan = plan_view(r);
        a.sync = sync(r);
        a.workspace = ranks[r].workspace;
        runtime::launch_plan(a, group.stream(r), group.num_sms());
    }
    if (spec.backward) {  // write_grads: local, right after the plan (same inputs as run_host's)
        for (int r = 0; r < R; ++r) {
            for (int bytes : {2, 4}) {
                WriteGradsArgs a{};
                a.experts_per_rank = l.experts_per_rank;
                a.expert_elems = spec.grads_elems;
                a.slot_expert = plan_view(r).slot_expert + int64_t(r) * l.experts_per_rank;
                a.cu_seqlens = plan_view(r).cu_seqlens + int64_t(r) * l.num_groups();
                a.grad = bytes == 2 ? static_cast<const void*>(ranks[r].wgrad16) : ranks[r].wgrad32;
                a.grad_bytes = bytes;
                a.grads = bytes == 2 ? ranks[r].wgrads16 : ranks[r].wgrads32;
                kernels::launch(a, group.stream(r), group.num_sms());
                if (bytes == 4) {  // as run_host: accumulate the bf16 gradient on top
                    a.grad = ranks[r].wgrad16;
                    a.grad_bytes = 2;
                    a.accumulate = true;
                    kernels::launch(a, group.stream(r), group.num_sms());
                }
            }
        }
    }
    auto dispatch_args = [&](int r) {
        DispatchArgs a{};
        a.layout = l;
        a.rank = r;
        a.x = ranks[r].x;
        a.topk_weights = spec.weighted ? ranks[r].weights : nullptr;
        a.plan = plan_view(r);
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.recv_x = ranks[r].recv_x;
        a.recv_w = ranks[r].recv_w;
        a.sync = sync(r);
        return a;
    };
    for (int r = 0; r < R; ++r) kernels::launch(dispatch_args(r), group.stream(r), group.num_sms());
    auto prefetch_args = [&](int r) {
        PrefetchArgs a{};
        a.rank = r;
        a.num_ranks = R;
        a.experts_per_rank = l.experts_per_rank;
        a.num_slots = l.experts_per_rank;
        a.num_projections = 1;
        a.projections[0].expert_bytes = spec.expert_elems * 2;
        a.slot_expert = plan_view(r).slot_expert;
        a.sync = sync(r);
        return a;
    };
    for (int r = 0; r < R; ++r) {
        PrefetchArgs a = prefetch_args(r);
        a.projections[0].weights = reinterpret_cast<const uint8_t*>(ranks[r].expert_w);
        for (int p = 0; p < R; ++p) a.projections[0].slot_pools[p] = slot_regions[r].peers[p];
        kernels::launch(a, group.stream(r), group.num_sms());
    }
    for (int r = 0; r < R; ++r) {  // the same slots pulled by each holder (serving's prefetch): the same bits
        PrefetchArgs a = prefetch_args(r);
        a.pull = true;
        for (int p = 0; p < R; ++p) a.projections[0].owners[p] = reinterpret_cast<const uint8_t*>(ranks[p].expert_w);
        a.projections[0].slot_pools[r] = pull_regions[r].local;
        kernels::launch(a, group.stream(r), group.num_sms());
    }
    auto combine_args = [&](int r) {
        CombineArgs a{};
        a.layout = l;
        a.rank = r;
        a.y = ranks[r].y;
        a.weights = spec.weighted ? ranks[r].recv_w : nullptr;
        a.plan = plan_view(r);
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.out = ranks[r].out_alloc;
        a.sync = sync(r);
        return a;
    };
    for (int r = 0; r < R; ++r) kernels::launch(combine_args(r), group.stream(r), group.num_sms());
    if (spec.backward) {
        for (int r = 0; r < R; ++r) {
            DispatchArgs a = dispatch_args(r);
            a.x = ranks[r].gout;
            a.topk_weights = nullptr;
            a.recv_x = ranks[r].recv_gx;
            a.recv_w = nullptr;
            kernels::launch(a, group.stream(r), group.num_sms());
        }
        for (int r = 0; r < R; ++r) {  // local: same inputs as run_host's combine_grad
            CombineGradArgs a{};
            a.layout = l;
            a.rank = r;
            a.plan = plan_view(r);
            a.rows = ranks[r].recv_gx;
            a.y = spec.separate_recv ? ranks[r].recv_x : ranks[r].y;
            a.weights = ranks[r].recv_w;
            a.grad_y = ranks[r].grad_y_alloc + kCanaryRows * l.hidden;
            a.grad_weights = ranks[r].grad_w_alloc + kCanaryRows;
            kernels::launch(a, group.stream(r), group.num_sms());
        }
        for (int r = 0; r < R; ++r) {
            CombineArgs a = combine_args(r);
            a.y = ranks[r].gy;
            a.weights = nullptr;
            a.out = ranks[r].gx_alloc;
            kernels::launch(a, group.stream(r), group.num_sms());
        }
    }
    for (int r = 0; r < R; ++r) {
        GradReduceArgs a{};
        a.rank = r;
        a.num_ranks = R;
        a.experts_per_rank = l.experts_per_rank;
        a.expert_elems = spec.expert_elems;
        a.slot_expert = plan_view(r).slot_expert;
        a.grads = ranks[r].grads;
        for (int p = 0; p < R; ++p) a.reduce_pools[p] = reinterpret_cast<float*>(red_regions[r].peers[p]);
        a.sync = sync(r);
        kernels::launch(a, group.stream(r), group.num_sms());
    }
}

std::vector<RankOutputs> DeviceCase::download() {
    group.synchronize();
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    const int R = layout.num_ranks;
    const int64_t H = layout.hidden, nvs = layout.num_recv_rows, S = layout.num_tokens;
    const int64_t pe = int64_t(layout.experts_per_rank) * spec.expert_elems;
    std::vector<RankOutputs> outs(R);
    auto get16 = [](std::vector<uint16_t>& v, const void* src, size_t n) {
        v.resize(n);
        FLATEP_CUDA_CHECK(cudaMemcpy(v.data(), src, n * 2, cudaMemcpyDeviceToHost));
    };
    for (int r = 0; r < R; ++r) {
        RankOutputs& o = outs[r];
        PerRank& p = ranks[r];
        o.plan.resize(size_t(make_plan_sizes(layout).total_words));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.plan.data(), p.plan, o.plan.size() * 4, cudaMemcpyDeviceToHost));
        if (spec.separate_recv) {
            get16(o.recv_x, p.recv_alloc, size_t((nvs + 2 * kCanaryRows) * H));  // with canaries
        } else {
            get16(o.recv_x, p.recv_x, size_t(nvs * H));
        }
        o.recv_w.resize(size_t(nvs));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.recv_w.data(), p.recv_w, size_t(nvs) * 4, cudaMemcpyDeviceToHost));
        get16(o.out, p.out_alloc, size_t((S + kCanaryRows) * H));
        if (spec.backward) {
            get16(o.recv_gx, p.recv_galloc, size_t((nvs + 2 * kCanaryRows) * H));
            get16(o.gx, p.gx_alloc, size_t((S + kCanaryRows) * H));
            get16(o.grad_y, p.grad_y_alloc, size_t((nvs + 2 * kCanaryRows) * H));  // with canaries
            o.grad_w.resize(size_t(nvs + 2 * kCanaryRows));
            FLATEP_CUDA_CHECK(cudaMemcpy(o.grad_w.data(), p.grad_w_alloc, o.grad_w.size() * 4, cudaMemcpyDeviceToHost));
            const size_t ge = size_t(2 * layout.experts_per_rank) * size_t(spec.grads_elems);
            o.wgrads16.resize(ge);
            o.wgrads32.resize(ge);
            FLATEP_CUDA_CHECK(cudaMemcpy(o.wgrads16.data(), p.wgrads16, ge * 4, cudaMemcpyDeviceToHost));
            FLATEP_CUDA_CHECK(cudaMemcpy(o.wgrads32.data(), p.wgrads32, ge * 4, cudaMemcpyDeviceToHost));
        }
        get16(o.slot_pool, slot_regions[r].local, size_t(pe));
        get16(o.pull_pool, pull_regions[r].local, size_t(pe));
        o.grads.resize(size_t(pe));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.grads.data(), p.grads, size_t(pe) * 4, cudaMemcpyDeviceToHost));
        o.red_pool.resize(size_t(pe));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.red_pool.data(), red_regions[r].local, size_t(pe) * 4, cudaMemcpyDeviceToHost));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.status, regions[r].local + sym.status_offset, 16, cudaMemcpyDeviceToHost));
    }
    return outs;
}

}  // namespace flatep::gpu_test
