#include "serving_harness.hpp"

#include <exception>
#include <thread>

#include "common/check.hpp"
#include "gpu_harness.hpp"
#include "ops/combine_args.hpp"
#include "ops/dispatch_args.hpp"
#include "ops/plan_args.hpp"
#include "planner/planner.hpp"
#include "planner/static_placement.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::gpu_test {

DevicePools::DevicePools(int R, int epn, int slots, std::vector<int64_t> bytes)
    : num_ranks(R), experts_per_rank(epn), num_slots(slots), expert_bytes(std::move(bytes)) {
    own.assign(expert_bytes.size(), std::vector<uint8_t*>(size_t(R), nullptr));
    this->slots.assign(expert_bytes.size(), std::vector<uint8_t*>(size_t(R), nullptr));
    for (size_t p = 0; p < expert_bytes.size(); ++p) {
        FLATEP_CHECK(expert_bytes[p] > 0 && expert_bytes[p] % 16 == 0,
                     "DevicePools: expert_bytes must be a positive multiple of 16, got ", expert_bytes[p]);
        for (int r = 0; r < R; ++r) {
            FLATEP_CUDA_CHECK(cudaMalloc(&own[p][r], size_t(epn) * size_t(expert_bytes[p])));
            if (slots > 0) FLATEP_CUDA_CHECK(cudaMalloc(&this->slots[p][r], size_t(slots) * size_t(expert_bytes[p])));
        }
    }
}

DevicePools::~DevicePools() {
    cudaDeviceSynchronize();
    for (auto* table : {&own, &slots})
        for (auto& per_rank : *table)
            for (uint8_t* ptr : per_rank)
                if (ptr != nullptr) cudaFree(ptr);
}

ServingInputs make_serving_inputs(const ServingSpec& spec, const Layout& l, const std::vector<int64_t>& expert_bytes,
                                  double sigma, uint64_t seed, int hot_ranks) {
    const int R = l.num_ranks, K = l.topk;
    const int64_t H = l.hidden, nvs = l.num_recv_rows;
    ServingInputs in;
    in.topk.resize(R);
    in.x.resize(R);
    in.weights.resize(R);
    in.y.resize(R);
    in.own.assign(expert_bytes.size(), std::vector<std::vector<uint8_t>>(size_t(R)));
    std::vector<double> pop = routing::popularity(l.num_experts, sigma, seed);
    for (int e = 0; e < l.num_experts; ++e)
        if (l.home_rank(e) < hot_ranks) pop[size_t(e)] *= 32.0;
    run_host_ranks(R, [&](int r) {
        const int s = spec.tokens[r];
        const uint64_t base = seed * 1000 + uint64_t(r) * 16;
        in.topk[r].resize(size_t(s) * K);
        routing::sample_topk(pop, s, K, seed, r, in.topk[r].data());
        in.x[r].resize(size_t(s * H));
        fill_bf16(in.x[r].data(), s * H, base + 1);
        in.weights[r].resize(size_t(s) * K);
        fill_f32(in.weights[r].data(), int64_t(s) * K, base + 2, -1.f, 1.f);
        in.y[r].resize(size_t(nvs * H));
        fill_bf16(in.y[r].data(), nvs * H, base + 3);
        for (size_t p = 0; p < expert_bytes.size(); ++p) {
            const int64_t n = l.experts_per_rank * expert_bytes[p];
            in.own[p][r].resize(size_t(n));
            fill_bf16(reinterpret_cast<uint16_t*>(in.own[p][r].data()), n / 2, base + 4 + p);
        }
    });
    return in;
}

std::vector<ServingOutputs> run_serving_host(const ServingSpec& spec, const Layout& l, const ServingInputs& in) {
    const int R = l.num_ranks, B = l.num_slots;
    const int64_t H = l.hidden, nvs = l.num_recv_rows;
    const int P = int(in.own.size());
    const SymmetricLayout sym = make_symmetric_layout(l);
    transport::LocalHostWorld world(R, 120.0);
    std::vector<ServingOutputs> outs(R);
    for (ServingOutputs& o : outs) {  // sized before the threads start: the push writes other ranks' slots
        o.slots.resize(size_t(P));
        for (int p = 0; p < P; ++p)
            o.slots[p].assign(size_t(B * int64_t(in.own[p][0].size()) / l.experts_per_rank), kSlotCanary);
    }
    std::vector<uint64_t> epochs(R, 0);
    const std::vector<int32_t> table = spec.planner == PlannerKind::kStatic
                                           ? planner::make_placement_table(l, spec.placement)
                                           : std::vector<int32_t>{};
    run_host_ranks(R, [&](int r) {
        auto t = world.transport(r);
        SymmetricRegion reg = t->allocate(size_t(sym.total_bytes));
        const sync::SyncArgs sync = host_sync(reg, sym, r, R, &epochs[r]);
        const int s = spec.tokens[r];
        ServingOutputs& o = outs[r];
        planner::HostPlan plan(l);
        PlanArgs pa{};
        pa.layout = l;
        pa.rank = r;
        pa.num_tokens = s;
        pa.topk_idx = s > 0 ? in.topk[r].data() : nullptr;
        pa.index_bytes = 4;
        pa.planner = spec.planner;
        pa.placement = table.empty() ? nullptr : table.data();
        for (int p = 0; p < R; ++p) pa.peers[p] = reg.peers[p];
        pa.plan = plan.view;
        pa.sync = sync;
        check_plan_args(pa);
        runtime::run_host_plan(pa);

        o.recv_w.assign(size_t(nvs), 0.0f);
        DispatchArgs da{};
        da.layout = l;
        da.rank = r;
        da.x = s > 0 ? in.x[r].data() : nullptr;
        da.topk_weights = spec.weighted && s > 0 ? in.weights[r].data() : nullptr;
        da.plan = plan.view;
        for (int p = 0; p < R; ++p) da.peers[p] = reg.peers[p];
        da.recv_x = region_at<uint16_t>(reg.local, sym.recv_x_offset);
        da.recv_w = o.recv_w.data();
        da.plan_ordered = spec.step_ordered;
        da.sync = sync;
        check_dispatch_args(da, s);
        host::run(da);

        if (spec.prefetch) {  // every projection in one op, as ExpertPools::prefetch runs it
            PrefetchArgs fa{};
            fa.rank = r;
            fa.num_ranks = R;
            fa.experts_per_rank = l.experts_per_rank;
            fa.num_slots = B;
            fa.slot_expert = plan.view.slot_expert;
            fa.pull = !spec.prefetch_push;
            fa.plan_ordered = fa.pull && spec.plan_ordered;
            fa.num_projections = P;
            for (int p = 0; p < P; ++p) {
                PrefetchProjection& pp = fa.projections[p];
                pp.expert_bytes = int64_t(in.own[p][r].size()) / l.experts_per_rank;
                pp.weights = in.own[p][r].data();
                for (int q = 0; q < R; ++q) {
                    pp.owners[q] = fa.pull ? in.own[p][q].data() : nullptr;
                    pp.slot_pools[q] = fa.pull && q != r ? nullptr : outs[q].slots[p].data();
                }
            }
            fa.sync = sync;
            check_prefetch_args(fa);
            host::run(fa);
        }

        o.out.assign(size_t((s + DeviceCase::kCanaryRows) * H), kOutCanary);
        CombineArgs ca{};
        ca.layout = l;
        ca.rank = r;
        ca.y = in.y[r].data();
        ca.weights = spec.weighted ? o.recv_w.data() : nullptr;
        ca.plan = plan.view;
        for (int p = 0; p < R; ++p) ca.peers[p] = reg.peers[p];
        ca.out = s > 0 ? o.out.data() : nullptr;
        ca.plan_ordered = spec.step_ordered;
        ca.sync = sync;
        check_combine_args(ca, s);
        host::run(ca);

        sync::host::barrier(sync, sync::kOpNone);  // every rank is done with every region
        const uint16_t* recv = region_at<const uint16_t>(reg.local, sym.recv_x_offset);
        o.recv_x.assign(recv, recv + nvs * H);
        o.plan.assign(plan.view.tpe_all, plan.view.tpe_all + make_plan_sizes(l).total_words);
        std::memcpy(o.status, reg.local + sym.status_offset, 16);
        sync::host::barrier(sync, sync::kOpNone);
        t->release(reg);
    });
    return outs;
}

ServingDevice::ServingDevice(const ServingSpec& spec, const Layout& l, testing::LocalDeviceGroup& group,
                             DevicePools& pools)
    : spec_(spec), layout_(l), sym_(make_symmetric_layout(l)), group_(group), pools_(pools) {
    const int R = l.num_ranks;
    FLATEP_CHECK(int(spec.tokens.size()) == R, "ServingDevice: ", spec.tokens.size(), " token counts for R=", R);
    FLATEP_CHECK(pools.num_ranks == R && pools.experts_per_rank == l.experts_per_rank && pools.num_slots >= l.num_slots,
                 "ServingDevice: pools of R=", pools.num_ranks, " epn=", pools.experts_per_rank, " with ",
                 pools.num_slots, " slots for a layout of R=", R, " epn=", l.experts_per_rank, " B=", l.num_slots);
    const int64_t H = l.hidden, nvs = l.num_recv_rows;
    regions_ = group.allocate(size_t(sym_.total_bytes));
    ranks_.resize(R);
    for (int r = 0; r < R; ++r) {
        PerRank& p = ranks_[r];
        const int64_t s = spec.tokens[r];
        FLATEP_CHECK(s >= 0 && s <= l.num_tokens, "ServingDevice: rank ", r, " passes ", s,
                     " tokens, S=", l.num_tokens);
        FLATEP_CUDA_CHECK(cudaMalloc(&p.plan, size_t(make_plan_sizes(l).total_words) * 4));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.workspace, runtime::plan_workspace_bytes(l)));
        if (s > 0) {
            FLATEP_CUDA_CHECK(cudaMalloc(&p.topk, size_t(s) * l.topk * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.x, size_t(s * H) * 2));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.weights, size_t(s) * l.topk * 4));
            FLATEP_CUDA_CHECK(cudaMalloc(&p.out, size_t((s + DeviceCase::kCanaryRows) * H) * 2));
        }
        p.recv_x = region_at<uint16_t>(regions_[r].local, sym_.recv_x_offset);
        FLATEP_CUDA_CHECK(cudaMalloc(&p.recv_w, size_t(nvs) * 4));
        FLATEP_CUDA_CHECK(cudaMalloc(&p.y, size_t(nvs * H) * 2));
    }
    if (spec.planner == PlannerKind::kStatic) {  // as Buffer::set_placement: the table in device memory, once
        const std::vector<int32_t> table = planner::make_placement_table(l, spec.placement);
        FLATEP_CUDA_CHECK(cudaMalloc(&placement_, table.size() * sizeof(int32_t)));
        FLATEP_CUDA_CHECK(cudaMemcpy(placement_, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
}

ServingDevice::~ServingDevice() {
    cudaDeviceSynchronize();
    for (PerRank& p : ranks_) {
        for (void* ptr : {(void*)p.plan, p.workspace, (void*)p.topk, (void*)p.x, (void*)p.weights, (void*)p.recv_w,
                          (void*)p.y, (void*)p.out})
            if (ptr != nullptr) cudaFree(ptr);
    }
    if (placement_ != nullptr) cudaFree(placement_);
    group_.release(regions_);
}

void ServingDevice::upload(const ServingInputs& in) {
    const int R = layout_.num_ranks;
    const int64_t H = layout_.hidden, nvs = layout_.num_recv_rows;
    group_.synchronize();
    marks_set_ = false;  // the upload may write receive rows: the next dispatch trusts no mark
    for (int r = 0; r < R; ++r) {
        PerRank& p = ranks_[r];
        const int64_t s = spec_.tokens[r];
        if (s > 0) {
            FLATEP_CUDA_CHECK(
                cudaMemcpy(p.topk, in.topk[r].data(), size_t(s) * layout_.topk * 4, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(p.x, in.x[r].data(), size_t(s * H) * 2, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(
                cudaMemcpy(p.weights, in.weights[r].data(), size_t(s) * layout_.topk * 4, cudaMemcpyHostToDevice));
            const std::vector<uint16_t> canary(size_t((s + DeviceCase::kCanaryRows) * H), kOutCanary);
            FLATEP_CUDA_CHECK(cudaMemcpy(p.out, canary.data(), canary.size() * 2, cudaMemcpyHostToDevice));
        }
        FLATEP_CUDA_CHECK(cudaMemcpy(p.y, in.y[r].data(), size_t(nvs * H) * 2, cudaMemcpyHostToDevice));
        FLATEP_CUDA_CHECK(cudaMemset(p.recv_w, 0, size_t(nvs) * 4));
        FLATEP_CUDA_CHECK(cudaMemset(p.plan, 0, size_t(make_plan_sizes(layout_).total_words) * 4));
        FLATEP_CUDA_CHECK(cudaMemset(regions_[r].local + sym_.status_offset, 0, 16));
        for (int q = 0; q < pools_.num_projections(); ++q) {
            if (size_t(q) < in.own.size())
                FLATEP_CUDA_CHECK(
                    cudaMemcpy(pools_.own[q][r], in.own[q][r].data(), in.own[q][r].size(), cudaMemcpyHostToDevice));
            if (pools_.num_slots > 0)
                FLATEP_CUDA_CHECK(cudaMemset(pools_.slots[q][r], kSlotCanary,
                                             size_t(pools_.num_slots) * size_t(pools_.expert_bytes[q])));
        }
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

sync::SyncArgs ServingDevice::sync(int r) const {
    return group_.sync_args(r, regions_, sym_.barrier_offset, sym_.status_offset);
}

void ServingDevice::enqueue_plan(int phases) {
    for (int r = 0; r < layout_.num_ranks; ++r) {
        PlanArgs a{};
        a.layout = layout_;
        a.rank = r;
        a.num_tokens = spec_.tokens[r];
        a.topk_idx = ranks_[r].topk;
        a.index_bytes = 4;
        a.planner = spec_.planner;
        a.placement = placement_;
        for (int p = 0; p < layout_.num_ranks; ++p) a.peers[p] = regions_[r].peers[p];
        a.plan = make_plan_view(layout_, ranks_[r].plan);
        a.sync = sync(r);
        a.workspace = ranks_[r].workspace;
        check_plan_args(a);
        if (phases >= 3) {
            runtime::launch_plan(a, group_.stream(r), group_.num_sms());
            continue;
        }
        uint8_t* ws = static_cast<uint8_t*>(a.workspace);
        kernels::launch_plan_counts(a, ws, group_.stream(r), group_.num_sms());
        if (phases >= 2)
            planner::launch_planner(layout_, a.planner, a.plan, ws + runtime::plan_kernels_part(layout_),
                                    planner::planner_engine(), group_.stream(r), a.placement);
    }
}

void ServingDevice::enqueue_dispatch() {
    for (int r = 0; r < layout_.num_ranks; ++r) {
        DispatchArgs a{};
        a.layout = layout_;
        a.rank = r;
        a.x = ranks_[r].x;
        a.topk_weights = spec_.weighted ? ranks_[r].weights : nullptr;
        a.plan = make_plan_view(layout_, ranks_[r].plan);
        for (int p = 0; p < layout_.num_ranks; ++p) a.peers[p] = regions_[r].peers[p];
        a.recv_x = ranks_[r].recv_x;
        a.recv_w = ranks_[r].recv_w;
        a.marks_valid = spec_.trust_marks && marks_set_;
        a.plan_ordered = spec_.step_ordered;
        a.sync = sync(r);
        check_dispatch_args(a, spec_.tokens[r]);
        kernels::launch(a, group_.stream(r), group_.num_sms());
    }
    marks_set_ = true;  // stream order: the next dispatch of every rank sees the marks this one wrote
}

PrefetchArgs ServingDevice::prefetch_args(int r, int first, int count, bool push) const {
    const int R = layout_.num_ranks;
    PrefetchArgs a{};
    a.rank = r;
    a.num_ranks = R;
    a.experts_per_rank = layout_.experts_per_rank;
    a.num_slots = layout_.num_slots;
    a.slot_expert = make_plan_view(layout_, ranks_[r].plan).slot_expert;
    a.pull = !push;
    a.plan_ordered = !push && spec_.plan_ordered;
    a.num_projections = count;
    for (int i = 0; i < count; ++i) {
        const int projection = first + i;
        PrefetchProjection& pp = a.projections[i];
        pp.expert_bytes = pools_.expert_bytes[projection];
        pp.weights = pools_.own[projection][r];
        for (int q = 0; q < R; ++q) {
            pp.owners[q] = push ? nullptr : pools_.own[projection][q];
            pp.slot_pools[q] = push || q == r ? pools_.slots[projection][q] : nullptr;
        }
    }
    a.sync = sync(r);
    check_prefetch_args(a);
    return a;
}

void ServingDevice::enqueue_prefetch(int first, int count, bool push, bool op_per_projection) {
    if (count < 0) count = pools_.num_projections() - first;
    const int step = op_per_projection ? 1 : count;
    for (int q = first; q < first + count; q += step)
        for (int r = 0; r < layout_.num_ranks; ++r)
            kernels::launch(prefetch_args(r, q, step, push), group_.stream(r), group_.num_sms());
}

void ServingDevice::enqueue_combine() {
    for (int r = 0; r < layout_.num_ranks; ++r) {
        CombineArgs a{};
        a.layout = layout_;
        a.rank = r;
        a.y = ranks_[r].y;
        a.weights = spec_.weighted ? ranks_[r].recv_w : nullptr;
        a.plan = make_plan_view(layout_, ranks_[r].plan);
        for (int p = 0; p < layout_.num_ranks; ++p) a.peers[p] = regions_[r].peers[p];
        a.out = ranks_[r].out;
        a.plan_ordered = spec_.step_ordered;
        a.sync = sync(r);
        check_combine_args(a, spec_.tokens[r]);
        kernels::launch(a, group_.stream(r), group_.num_sms());
    }
}

void ServingDevice::enqueue_step(int prefetch_count, int prefetch_first) {
    enqueue_plan();
    enqueue_dispatch();
    if (spec_.prefetch && prefetch_count != 0) enqueue_prefetch(prefetch_first, prefetch_count, spec_.prefetch_push);
    enqueue_combine();
}

std::vector<int32_t> ServingDevice::download_plan(int r) const {
    std::vector<int32_t> plan(size_t(make_plan_sizes(layout_).total_words));
    FLATEP_CUDA_CHECK(cudaMemcpy(plan.data(), ranks_[r].plan, plan.size() * 4, cudaMemcpyDeviceToHost));
    return plan;
}

std::vector<ServingOutputs> ServingDevice::download() {
    group_.synchronize();
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    const int R = layout_.num_ranks, B = layout_.num_slots;
    const int64_t H = layout_.hidden, nvs = layout_.num_recv_rows;
    std::vector<ServingOutputs> outs(R);
    for (int r = 0; r < R; ++r) {
        ServingOutputs& o = outs[r];
        const PerRank& p = ranks_[r];
        const int64_t s = spec_.tokens[r];
        o.plan = download_plan(r);
        o.recv_x.resize(size_t(nvs * H));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.recv_x.data(), p.recv_x, o.recv_x.size() * 2, cudaMemcpyDeviceToHost));
        o.recv_w.resize(size_t(nvs));
        FLATEP_CUDA_CHECK(cudaMemcpy(o.recv_w.data(), p.recv_w, o.recv_w.size() * 4, cudaMemcpyDeviceToHost));
        o.out.assign(size_t((s + DeviceCase::kCanaryRows) * H), kOutCanary);
        if (s > 0) FLATEP_CUDA_CHECK(cudaMemcpy(o.out.data(), p.out, o.out.size() * 2, cudaMemcpyDeviceToHost));
        o.slots.resize(size_t(pools_.num_projections()));
        for (int q = 0; q < pools_.num_projections(); ++q) {
            o.slots[q].resize(size_t(B * pools_.expert_bytes[q]));
            if (B > 0)
                FLATEP_CUDA_CHECK(
                    cudaMemcpy(o.slots[q].data(), pools_.slots[q][r], o.slots[q].size(), cudaMemcpyDeviceToHost));
        }
        FLATEP_CUDA_CHECK(cudaMemcpy(o.status, regions_[r].local + sym_.status_offset, 16, cudaMemcpyDeviceToHost));
    }
    return outs;
}

std::string ServingDevice::wait_failure() const {
    for (int r = 0; r < group_.num_ranks(); ++r) {
        const sync::WaitRecord& w = group_.wait_record(r);
        if (w.code != 0)
            return "timeout: op " + std::to_string(w.op) + " rank " + std::to_string(w.rank) + " waited for peer " +
                   std::to_string(w.peer) + " (expected " + std::to_string(w.expected) + " observed " +
                   std::to_string(w.observed) + ")";
    }
    return "";
}

}  // namespace flatep::gpu_test
