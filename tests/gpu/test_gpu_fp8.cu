// L1/L1b GPU test of FP8 rows (design §6): the CUDA dispatch_fp8 bitwise against the CPU backend on R virtual ranks,
// both input forms (bf16 rows quantised in the kernel, pre-quantised rows) and both scale modes, with canary rows
// around separate receive buffers, a zero-copy case, and the rule's device build against its host build (every fp32
// value through the e4m3 conversion, every bf16 amax through both scale modes). Plain main: PASS/FAIL per case with
// the first mismatch, non-zero exit on failure, "SKIP: no CUDA device" (exit 0) where no GPU exists.
//
//   test_gpu_fp8            all cases
//   test_gpu_fp8 --quick    the small cases, and a sample of the fp32 values
//   test_gpu_fp8 --case NAME
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/fp8.hpp"
#include "device_test_util.hpp"
#include "gpu_harness.hpp"
#include "ops/dispatch_fp8_args.hpp"
#include "planner/planner.hpp"
#include "sync/barrier_host.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first mismatch of the current case

constexpr int kCanaryRows = 3;
constexpr uint8_t kCanaryQ = 0xa5;
constexpr uint32_t kCanaryF32 = 0x7fa5a5a5;  // an fp32 NaN pattern nothing writes

const char* mode_name(Fp8Scale mode) { return mode == Fp8Scale::kUe8m0 ? "ue8m0" : "float"; }

// ---- the rule: device build against host build ----

// The kernels' conversion (e4m3x4_from_floats, four values at a time) of every stride-th fp32 pattern.
__global__ void e4m3_all_kernel(uint32_t* out, uint64_t stride) {
    const uint64_t n = (uint64_t(1) << 32) / stride / 4;
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
        const uint64_t v = 4 * i * stride;
        out[i] = fp8::e4m3x4_from_floats(fp8::float_from_bits(uint32_t(v)), fp8::float_from_bits(uint32_t(v + stride)),
                                         fp8::float_from_bits(uint32_t(v + 2 * stride)),
                                         fp8::float_from_bits(uint32_t(v + 3 * stride)));
    }
}

// The kernels' two-lane amax (word_amax_bits) against bf16_amax_bits of each half, for every 32-bit word.
__global__ void word_amax_kernel(unsigned long long* mismatches) {
    unsigned long long bad = 0;
    for (uint64_t w = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < (uint64_t(1) << 32);
         w += uint64_t(gridDim.x) * blockDim.x) {
        const uint32_t a = fp8::bf16_amax_bits(uint16_t(w & 0xffffu)), b = fp8::bf16_amax_bits(uint16_t(w >> 16));
        bad += fp8::word_amax_bits(uint32_t(w)) != (a > b ? a : b);
    }
    if (bad != 0) atomicAdd(mismatches, bad);
}

// Every bf16 magnitude (finite or not), both modes: scales in out[0, 0x10000), their inverses in out[0x10000, ...).
__global__ void scales_kernel(float* out) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 0x8000u) {
        const uint32_t amax = fp8::bf16_amax_bits(uint16_t(i));
        const Fp8Scale modes[2] = {Fp8Scale::kFloat, Fp8Scale::kUe8m0};
        for (int m = 0; m < 2; ++m) {
            const float scale = fp8::block_scale(amax, modes[m]);
            out[0x8000u * m + i] = scale;
            out[0x10000u + 0x8000u * m + i] = fp8::block_inverse(amax, scale, modes[m]);
        }
    }
}

__global__ void quantize_values_kernel(const float* scales, const float* inverses, int num_scales,
                                       uint32_t* out) {  // every bf16 x, four at a time (the kernels' quantize_words)
    const int64_t n = int64_t(num_scales) << 14;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const uint32_t x = uint32_t(4 * i) & 0xffffu;
        out[i] = fp8::quantize_words(x | (x + 1) << 16, (x + 2) | (x + 3) << 16, scales[i >> 14], inverses[i >> 14]);
    }
}

template <typename F>
void parallel_for(int64_t n, const F& fn) {
    const int workers = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
        threads.emplace_back([&, w] {
            for (int64_t i = n * w / workers; i < n * (w + 1) / workers; ++i) fn(i);
        });
    }
    for (auto& t : threads) t.join();
}

bool run_rule(bool quick) {
    const uint64_t stride = quick ? 257 : 1;  // quick: every 257th fp32 pattern
    const uint64_t n = (uint64_t(1) << 32) / stride / 4 * 4;
    uint8_t* d_out = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&d_out, n));
    e4m3_all_kernel<<<4096, 256>>>(reinterpret_cast<uint32_t*>(d_out), stride);
    FLATEP_CUDA_CHECK_LAUNCH();
    std::vector<uint8_t> got(n);
    FLATEP_CUDA_CHECK(cudaMemcpy(got.data(), d_out, n, cudaMemcpyDeviceToHost));
    cudaFree(d_out);
    std::vector<uint8_t> want(n);
    parallel_for(int64_t(n), [&](int64_t i) {
        want[i] = fp8::float_to_e4m3(fp8::float_from_bits(uint32_t(uint64_t(i) * stride)));
    });
    for (uint64_t i = 0; i < n; ++i) {
        if (got[i] != want[i]) {
            char buf[160];
            std::snprintf(buf, sizeof(buf), "e4m3 conversion (bits 0x%08x): device 0x%02x host 0x%02x",
                          unsigned(i * stride), got[i], want[i]);
            g_first = buf;
            return false;
        }
    }
    if (!quick) {
        unsigned long long* d_bad = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&d_bad, sizeof(*d_bad)));
        FLATEP_CUDA_CHECK(cudaMemset(d_bad, 0, sizeof(*d_bad)));
        word_amax_kernel<<<4096, 256>>>(d_bad);
        FLATEP_CUDA_CHECK_LAUNCH();
        unsigned long long bad = 0;
        FLATEP_CUDA_CHECK(cudaMemcpy(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost));
        cudaFree(d_bad);
        if (bad != 0) {
            g_first = "word_amax_bits differs from bf16_amax_bits on " + std::to_string(bad) + " words";
            return false;
        }
    }
    float* d_scales = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&d_scales, 0x20000 * sizeof(float)));
    scales_kernel<<<0x8000 / 256, 256>>>(d_scales);
    FLATEP_CUDA_CHECK_LAUNCH();
    std::vector<float> scales(0x20000);  // scales, then their inverses
    FLATEP_CUDA_CHECK(cudaMemcpy(scales.data(), d_scales, scales.size() * 4, cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < 0x10000u; ++i) {
        const Fp8Scale mode = i < 0x8000u ? Fp8Scale::kFloat : Fp8Scale::kUe8m0;
        const uint32_t amax = fp8::bf16_amax_bits(uint16_t(i & 0x7fffu));
        const float want_scale = fp8::block_scale(amax, mode);
        const float want_inverse = fp8::block_inverse(amax, want_scale, mode);
        if (fp8::float_bits(scales[i]) != fp8::float_bits(want_scale) ||
            fp8::float_bits(scales[0x10000u + i]) != fp8::float_bits(want_inverse)) {
            char buf[200];
            std::snprintf(buf, sizeof(buf),
                          "block_scale / block_inverse(amax 0x%04x, %s): device 0x%08x 0x%08x host 0x%08x 0x%08x",
                          i & 0x7fffu, mode_name(mode), fp8::float_bits(scales[i]),
                          fp8::float_bits(scales[0x10000u + i]), fp8::float_bits(want_scale),
                          fp8::float_bits(want_inverse));
            g_first = buf;
            return false;
        }
    }
    // Every bf16 value quantised with the scale and inverse of every 64th amax of both modes (subnormal scales and
    // non-finite inverses, where the rule divides, included).
    std::vector<float> picked, picked_inverse;
    for (uint32_t i = 0; i < 0x10000u; i += 64) {
        picked.push_back(scales[i]);
        picked_inverse.push_back(scales[0x10000u + i]);
    }
    for (uint32_t i : {1u, 2u, 3u, 0x8001u, 0x8003u}) {  // tiny amax: inverses that overflow
        picked.push_back(scales[i]);
        picked_inverse.push_back(scales[0x10000u + i]);
    }
    const int num_scales = int(picked.size());
    float* d_picked = nullptr;
    uint8_t* d_q = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&d_picked, picked.size() * 8));
    FLATEP_CUDA_CHECK(cudaMalloc(&d_q, size_t(num_scales) << 16));
    FLATEP_CUDA_CHECK(cudaMemcpy(d_picked, picked.data(), picked.size() * 4, cudaMemcpyHostToDevice));
    FLATEP_CUDA_CHECK(
        cudaMemcpy(d_picked + picked.size(), picked_inverse.data(), picked.size() * 4, cudaMemcpyHostToDevice));
    quantize_values_kernel<<<2048, 256>>>(d_picked, d_picked + picked.size(), num_scales,
                                          reinterpret_cast<uint32_t*>(d_q));
    FLATEP_CUDA_CHECK_LAUNCH();
    std::vector<uint8_t> q(size_t(num_scales) << 16);
    FLATEP_CUDA_CHECK(cudaMemcpy(q.data(), d_q, q.size(), cudaMemcpyDeviceToHost));
    cudaFree(d_picked);
    cudaFree(d_q);
    cudaFree(d_scales);
    std::vector<uint8_t> want_q(q.size());
    parallel_for(int64_t(q.size()), [&](int64_t i) {
        want_q[i] = fp8::quantize_value(uint16_t(i & 0xffff), picked[size_t(i >> 16)], picked_inverse[size_t(i >> 16)]);
    });
    for (size_t i = 0; i < q.size(); ++i) {
        if (q[i] != want_q[i]) {
            char buf[200];
            std::snprintf(buf, sizeof(buf), "quantize_value(x 0x%04x, scale bits 0x%08x): device 0x%02x host 0x%02x",
                          unsigned(i & 0xffff), fp8::float_bits(picked[i >> 16]), q[i], want_q[i]);
            g_first = buf;
            return false;
        }
    }
    std::printf("  rule: %llu fp32 values%s, 65536 amax, %d x 65536 quotients: device == host\n", (unsigned long long)n,
                quick ? "" : ", every bf16 pair's amax", num_scales);
    return true;
}

// ---- dispatch_fp8 ----

// bf16 rows of finite values (the harness's) with special blocks: zeros, a NaN, +-Inf, bf16 subnormals, huge values,
// and blocks of (16 + j)/16 * 2^k under an amax of 448 * 2^k, whose UE8M0 quotients are exact e4m3 ties.
void fill_rows(uint16_t* x, int64_t rows, int H, uint64_t seed) {
    fill_bf16(x, rows * H, seed);
    const int64_t num_blocks = rows * H / kFp8BlockSize;
    for (int64_t b = 0; b < num_blocks; ++b) {
        uint16_t* block = x + b * kFp8BlockSize;
        const uint64_t h = mix(seed * 31 + uint64_t(b));
        switch (h % 13) {
            case 0:
                std::memset(block, 0, kFp8BlockSize * 2);
                break;
            case 1:
                block[h % 128] = (h & 256) ? 0xffc3 : 0x7fc0;  // NaN
                break;
            case 2:
                block[h % 128] = (h & 256) ? 0xff80 : 0x7f80;  // -Inf / +Inf
                break;
            case 3:
                for (int i = 0; i < kFp8BlockSize; ++i) block[i] = uint16_t(mix(h + i) & 0x807f);  // subnormals
                break;
            case 4:
                for (int i = 0; i < kFp8BlockSize; ++i) block[i] = uint16_t(mix(h + i) & 0xff7f) | 0x7000;  // huge
                break;
            case 5: {
                const int k = int(h >> 8) % 40 - 20;
                for (int i = 0; i < kFp8BlockSize; ++i)
                    block[i] = float_to_bf16(std::ldexp(float(16 + i % 16) / 16.0f, k) * ((i & 16) ? -1.0f : 1.0f));
                block[h % 128] = float_to_bf16(std::ldexp(448.0f, k));
                break;
            }
            default:
                break;
        }
    }
}

struct Inputs {
    std::vector<std::vector<int64_t>> topk;  // [R][s*K]
    std::vector<std::vector<uint16_t>> x;    // [R][s*H]
    std::vector<std::vector<float>> weights;
};

Inputs make_fp8_inputs(const CaseSpec& c, const Layout& l) {
    const int s = c.num_tokens < 0 ? l.num_tokens : c.num_tokens;
    Inputs in;
    in.topk = make_routing(c, c.seed);
    in.x.resize(l.num_ranks);
    in.weights.resize(l.num_ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < l.num_ranks; ++r) {
        threads.emplace_back([&, r] {
            in.x[r].resize(size_t(s) * l.hidden);
            fill_rows(in.x[r].data(), s, l.hidden, c.seed * 1000 + uint64_t(r));
            in.weights[r].resize(size_t(s) * l.topk);
            fill_f32(in.weights[r].data(), int64_t(s) * l.topk, c.seed * 1000 + 500 + uint64_t(r), -1.f, 1.f);
        });
    }
    for (auto& t : threads) t.join();
    return in;
}

// One rank's outputs of one dispatch_fp8 (host copies): receive rows [0, NvS) (separate buffers: with the canary rows
// around them), the plan.
struct Fp8Out {
    std::vector<uint8_t> q;
    std::vector<float> scales, w;
};
struct RankResult {
    std::vector<int32_t> plan;
    Fp8Out from_bf16, pre;  // bf16 input quantised in the op; the host-quantised rows
};

// The CPU backend (R threads): plan, dispatch_fp8 of the bf16 rows, a bf16 dispatch (rewrites the staging),
// dispatch_fp8 of the same rows quantised on the host.
std::vector<RankResult> run_host_fp8(const CaseSpec& c, const Layout& l, const Inputs& in, Fp8Scale mode) {
    const int R = l.num_ranks, s = c.num_tokens < 0 ? l.num_tokens : c.num_tokens, H = l.hidden;
    const int nvs = l.num_recv_rows, nb = H / kFp8BlockSize;
    const SymmetricLayout sym = make_symmetric_layout(l);
    transport::LocalHostWorld world(R, 120.0);
    std::vector<RankResult> out(R);
    std::vector<uint64_t> epochs(R, 0);
    std::vector<std::string> errors(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
        threads.emplace_back([&, r] {
            try {
                auto t = world.transport(r);
                SymmetricRegion reg = t->allocate(size_t(sym.total_bytes));
                sync::SyncArgs sync{};
                for (int p = 0; p < R; ++p)
                    sync.flags[p] = reinterpret_cast<uint64_t*>(reg.peers[p] + sym.barrier_offset);
                sync.epoch = &epochs[r];
                sync.status = reinterpret_cast<int32_t*>(reg.local + sym.status_offset);
                sync.rank = r;
                sync.num_ranks = R;
                sync.timeout_s = 120.0;
                planner::HostPlan plan(l);
                PlanArgs pa{};
                pa.layout = l;
                pa.rank = r;
                pa.num_tokens = s;
                pa.topk_idx = in.topk[r].data();
                pa.index_bytes = 8;
                pa.planner = c.planner;
                for (int p = 0; p < R; ++p) pa.peers[p] = reg.peers[p];
                pa.plan = plan.view;
                pa.sync = sync;
                runtime::run_host_plan(pa);
                DispatchFp8Args a{};
                a.layout = l;
                a.rank = r;
                a.x_bf16 = in.x[r].data();
                a.topk_weights = c.weighted ? in.weights[r].data() : nullptr;
                a.scale_mode = mode;
                a.plan = plan.view;
                for (int p = 0; p < R; ++p) a.peers[p] = reg.peers[p];
                a.sync = sync;
                auto run = [&](Fp8Out& o) {
                    const int rows = !c.separate_recv ? nvs : nvs + 2 * kCanaryRows;
                    o.q.assign(size_t(rows) * H, kCanaryQ);
                    o.scales.assign(size_t(rows) * nb, 0.0f);
                    o.w.assign(size_t(rows), 0.0f);
                    for (float& v : o.scales) std::memcpy(&v, &kCanaryF32, 4);
                    for (float& v : o.w) std::memcpy(&v, &kCanaryF32, 4);
                    const int at = !c.separate_recv ? 0 : kCanaryRows;
                    a.recv_w = o.w.data() + at;
                    if (!c.separate_recv) {
                        a.recv_x = reg.local + fp8_recv_x_offset(sym);
                        a.recv_scales = reinterpret_cast<float*>(reg.local + fp8_recv_scales_offset(l, sym));
                    } else {
                        a.recv_x = o.q.data() + at * H;
                        a.recv_scales = o.scales.data() + at * nb;
                    }
                    host::run(a);
                    if (!c.separate_recv) {
                        std::memcpy(o.q.data(), a.recv_x, size_t(nvs) * H);
                        std::memcpy(o.scales.data(), a.recv_scales, size_t(nvs) * nb * 4);
                    }
                };
                run(out[r].from_bf16);
                std::vector<uint16_t> recv16(size_t(nvs) * H);
                DispatchArgs da{};
                da.layout = l;
                da.rank = r;
                da.x = in.x[r].data();
                da.plan = plan.view;
                for (int p = 0; p < R; ++p) da.peers[p] = reg.peers[p];
                da.recv_x = recv16.data();
                da.sync = sync;
                host::run(da);
                std::vector<uint8_t> xq(size_t(s) * H);
                std::vector<float> xs(size_t(s) * nb);
                quantize_fp8_rows(in.x[r].data(), s, H, mode, xq.data(), xs.data());
                a.x_bf16 = nullptr;
                a.x_fp8 = xq.data();
                a.x_scales = xs.data();
                run(out[r].pre);
                out[r].plan.assign(plan.view.tpe_all, plan.view.tpe_all + make_plan_sizes(l).total_words);
                sync::host::barrier(sync, sync::kOpNone);  // every peer is done with this rank's region
                t->release(reg);
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < R; ++r) FLATEP_CHECK_RUNTIME(errors[r].empty(), "host rank ", r, ": ", errors[r]);
    return out;
}

// The same sequence on the GPU (virtual ranks of one LocalDeviceGroup).
std::vector<RankResult> run_device_fp8(const CaseSpec& c, const Layout& l, const Inputs& in, Fp8Scale mode,
                                       testing::LocalDeviceGroup& group) {
    const int R = l.num_ranks, s = c.num_tokens < 0 ? l.num_tokens : c.num_tokens, H = l.hidden;
    const int nvs = l.num_recv_rows, nb = H / kFp8BlockSize;
    const SymmetricLayout sym = make_symmetric_layout(l);
    std::vector<SymmetricRegion> regions = group.allocate(size_t(sym.total_bytes));
    const size_t plan_words = size_t(make_plan_sizes(l).total_words);
    const int rows = !c.separate_recv ? nvs : nvs + 2 * kCanaryRows, at = !c.separate_recv ? 0 : kCanaryRows;
    struct Dev {
        int32_t* plan;
        void* workspace;
        int64_t* topk;
        uint16_t *x, *recv16;
        float *weights, *xs, *scales[2], *w[2];
        uint8_t *xq, *q[2];
    };
    std::vector<Dev> dev(R);
    for (int r = 0; r < R; ++r) {
        Dev& d = dev[r];
        std::vector<uint8_t> xq(size_t(s) * H);
        std::vector<float> xs(size_t(s) * nb);
        quantize_fp8_rows(in.x[r].data(), s, H, mode, xq.data(), xs.data());
        d.plan = to_device(std::vector<int32_t>(plan_words, 0));
        FLATEP_CUDA_CHECK(cudaMalloc(&d.workspace, runtime::plan_workspace_bytes(l)));
        d.topk = to_device(in.topk[r], 1);
        d.x = to_device(in.x[r], 8);
        d.weights = to_device(in.weights[r], 1);
        d.xq = to_device(xq, 16);
        d.xs = to_device(xs, 1);
        FLATEP_CUDA_CHECK(cudaMalloc(&d.recv16, size_t(nvs) * H * 2));
        for (int v = 0; v < 2; ++v) {
            d.q[v] = to_device(std::vector<uint8_t>(size_t(rows) * H, kCanaryQ));
            d.scales[v] = to_device(std::vector<float>(size_t(rows) * nb, fp8::float_from_bits(kCanaryF32)));
            d.w[v] = to_device(std::vector<float>(size_t(rows), fp8::float_from_bits(kCanaryF32)));
        }
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    auto sync = [&](int r) { return group.sync_args(r, regions, sym.barrier_offset, sym.status_offset); };
    for (int r = 0; r < R; ++r) {
        PlanArgs a{};
        a.layout = l;
        a.rank = r;
        a.num_tokens = s;
        a.topk_idx = dev[r].topk;
        a.index_bytes = 8;
        a.planner = c.planner;
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.plan = make_plan_view(l, dev[r].plan);
        a.sync = sync(r);
        a.workspace = dev[r].workspace;
        runtime::launch_plan(a, group.stream(r), group.num_sms());
    }
    auto fp8_args = [&](int r, int v) {
        DispatchFp8Args a{};
        a.layout = l;
        a.rank = r;
        a.x_bf16 = v == 0 ? dev[r].x : nullptr;
        a.x_fp8 = v == 0 ? nullptr : dev[r].xq;
        a.x_scales = v == 0 ? nullptr : dev[r].xs;
        a.topk_weights = c.weighted ? dev[r].weights : nullptr;
        a.scale_mode = mode;
        a.plan = make_plan_view(l, dev[r].plan);
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.recv_x = !c.separate_recv ? regions[r].local + fp8_recv_x_offset(sym) : dev[r].q[v] + int64_t(at) * H;
        a.recv_scales = !c.separate_recv ? reinterpret_cast<float*>(regions[r].local + fp8_recv_scales_offset(l, sym))
                                         : dev[r].scales[v] + int64_t(at) * nb;
        a.recv_w = dev[r].w[v] + at;
        a.sync = sync(r);
        return a;
    };
    std::vector<RankResult> out(R);
    auto download = [&](int v) {
        group.synchronize();
        for (int r = 0; r < R; ++r) {
            Fp8Out& o = v == 0 ? out[r].from_bf16 : out[r].pre;
            const uint8_t* q = !c.separate_recv ? regions[r].local + fp8_recv_x_offset(sym) : dev[r].q[v];
            const float* sc = !c.separate_recv
                                  ? reinterpret_cast<const float*>(regions[r].local + fp8_recv_scales_offset(l, sym))
                                  : dev[r].scales[v];
            o.q = from_device(q, int64_t(rows) * H);
            o.scales = from_device(sc, int64_t(rows) * nb);
            o.w = from_device(dev[r].w[v], rows);
        }
    };
    for (int r = 0; r < R; ++r) kernels::launch(fp8_args(r, 0), group.stream(r), group.num_sms());
    download(0);                   // (zero copy: the next ops rewrite the region)
    for (int r = 0; r < R; ++r) {  // a bf16 dispatch rewrites the staging region in between
        DispatchArgs a{};
        a.layout = l;
        a.rank = r;
        a.x = dev[r].x;
        a.plan = make_plan_view(l, dev[r].plan);
        for (int p = 0; p < R; ++p) a.peers[p] = regions[r].peers[p];
        a.recv_x = dev[r].recv16;
        a.sync = sync(r);
        kernels::launch(a, group.stream(r), group.num_sms());
    }
    for (int r = 0; r < R; ++r) kernels::launch(fp8_args(r, 1), group.stream(r), group.num_sms());
    download(1);
    for (int r = 0; r < R; ++r) out[r].plan = from_device(dev[r].plan, int64_t(plan_words));
    for (Dev& d : dev) {
        for (void* p : {(void*)d.plan, d.workspace, (void*)d.topk, (void*)d.x, (void*)d.recv16, (void*)d.weights,
                        (void*)d.xs, (void*)d.xq, (void*)d.q[0], (void*)d.q[1], (void*)d.scales[0], (void*)d.scales[1],
                        (void*)d.w[0], (void*)d.w[1]})
            cudaFree(p);
    }
    group.release(regions);
    return out;
}

template <typename T>
bool same_bytes(const char* what, int rank, const T* got, const T* want, int64_t n, int64_t row_len,
                int64_t row_offset) {
    for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
            uint32_t g = 0, w = 0;
            std::memcpy(&g, &got[i], sizeof(T));
            std::memcpy(&w, &want[i], sizeof(T));
            char buf[240];
            std::snprintf(buf, sizeof(buf), "%s: rank %d row %lld col %lld: got 0x%x expected 0x%x", what, rank,
                          (long long)(i / row_len + row_offset), (long long)(i % row_len), g, w);
            g_first = buf;
            return false;
        }
    }
    return true;
}

// GPU against CPU: receive rows [0, end) bitwise, and (separate buffers) the canary rows before and every row from
// the last group end on untouched.
bool compare(const CaseSpec& c, const Layout& l, Fp8Scale mode, const std::vector<RankResult>& gpu,
             const std::vector<RankResult>& cpu) {
    const int H = l.hidden, nb = H / kFp8BlockSize;
    const int64_t rows = !c.separate_recv ? l.num_recv_rows : l.num_recv_rows + 2 * kCanaryRows;
    for (int r = 0; r < l.num_ranks; ++r) {
        if (gpu[r].plan != cpu[r].plan) {
            g_first = "plan of rank " + std::to_string(r) + " differs from the host planner's";
            return false;
        }
        const PlanView pv = make_plan_view(l, const_cast<int32_t*>(cpu[r].plan.data()));
        const int64_t end = pv.cu_seqlens[int64_t(r) * l.num_groups() + l.num_groups() - 1];
        const int64_t first = !c.separate_recv ? 0 : kCanaryRows;
        for (int v = 0; v < 2; ++v) {
            const Fp8Out& g = v == 0 ? gpu[r].from_bf16 : gpu[r].pre;
            const Fp8Out& h = v == 0 ? cpu[r].from_bf16 : cpu[r].pre;
            const std::string tag = std::string(v == 0 ? "bf16 input" : "pre-quantised") + ", " + mode_name(mode);
            const int64_t n = !c.separate_recv ? end : rows;  // zero copy: rows past the end are unspecified
            const int64_t off = !c.separate_recv ? 0 : -kCanaryRows;
            if (!same_bytes(("recv_x (" + tag + ")").c_str(), r, g.q.data(), h.q.data(), n * H, H, off) ||
                !same_bytes(("recv_scales (" + tag + ")").c_str(), r, g.scales.data(), h.scales.data(), n * nb, nb,
                            off) ||
                !same_bytes(("recv_w (" + tag + ")").c_str(), r, g.w.data(), h.w.data(), rows, 1, off))
                return false;
            if (!!c.separate_recv) {  // the host run's canaries are the untouched pattern: compare against it directly
                std::vector<uint8_t> canary_q(size_t(rows - first - end) * H, kCanaryQ);
                if (!same_bytes(("recv_x past the end (" + tag + ")").c_str(), r, g.q.data() + (first + end) * H,
                                canary_q.data(), int64_t(canary_q.size()), H, end))
                    return false;
            }
        }
        // The host's two input forms agree (rows [0, end): in the zero-copy case the region past them holds what the
        // bf16 dispatch in between staged there).
        const Fp8Out &hb = cpu[r].from_bf16, &hp = cpu[r].pre;
        if (std::memcmp(hb.q.data() + first * H, hp.q.data() + first * H, size_t(end) * H) != 0 ||
            std::memcmp(hb.scales.data() + first * nb, hp.scales.data() + first * nb, size_t(end) * nb * 4) != 0) {
            g_first = "host: pre-quantised rows differ from rows quantised in the op (rank " + std::to_string(r) + ")";
            return false;
        }
    }
    return true;
}

bool run_case(const CaseSpec& c) {
    const Layout l = make_layout(c.config);
    const char* timeout_env = std::getenv("FLATEP_GPU_TEST_TIMEOUT");
    testing::LocalDeviceGroup group(l.num_ranks, false, timeout_env != nullptr ? std::atof(timeout_env) : 20.0);
    const Inputs in = make_fp8_inputs(c, l);
    for (Fp8Scale mode : {Fp8Scale::kFloat, Fp8Scale::kUe8m0}) {
        const std::vector<RankResult> cpu = run_host_fp8(c, l, in, mode);
        const std::vector<RankResult> gpu = run_device_fp8(c, l, in, mode, group);
        for (int r = 0; r < l.num_ranks; ++r) {
            const sync::WaitRecord& w = group.wait_record(r);
            if (w.code != 0) {
                g_first = "wait failed: op " + std::string(sync::op_name(sync::OpId(w.op))) + " rank " +
                          std::to_string(w.rank) + " peer " + std::to_string(w.peer);
                return false;
            }
        }
        if (!compare(c, l, mode, gpu, cpu)) return false;
    }
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    bool quick = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) quick = true;
        if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) only = argv[++i];
    }
    struct Entry {
        CaseSpec spec;
        bool small = true;
    };
    std::vector<Entry> cases;
    {
        CaseSpec s;
        s.name = "r1_single_rank";
        s.config = Config{.num_ranks = 1, .num_experts = 8, .num_tokens = 128, .topk = 2, .hidden = 128, .align = 8};
        cases.push_back({s});
        s.name = "r2_small_weighted_h384";
        s.config = Config{.num_ranks = 2, .num_experts = 8, .num_tokens = 64, .topk = 2, .hidden = 384, .align = 8};
        cases.push_back({s});
        s = CaseSpec{};
        s.name = "r4_slack_ragged_zero_copy_unweighted";
        s.config = Config{.num_ranks = 4,
                          .num_experts = 16,
                          .num_tokens = 200,
                          .topk = 4,
                          .hidden = 256,
                          .align = 16,
                          .capacity_factor = 1.25};
        s.num_tokens = 150;
        s.weighted = false;
        s.separate_recv = false;
        s.sigma = 1.5;
        cases.push_back({s});
        s = CaseSpec{};
        s.name = "r8_greedy_bad_ids";
        s.config = Config{.num_ranks = 8, .num_experts = 64, .num_tokens = 512, .topk = 8, .hidden = 256, .align = 128};
        s.planner = PlannerKind::kGreedy;
        s.routing = RoutingKind::kBadIds;
        s.sigma = 2.0;
        cases.push_back({s});
        s = CaseSpec{};
        s.name = "r8_one_expert_k1_h640";  // H/16 = 40 chunks: one partial warp step
        s.config = Config{.num_ranks = 8, .num_experts = 64, .num_tokens = 512, .topk = 1, .hidden = 640, .align = 32};
        s.routing = RoutingKind::kOneExpert;
        cases.push_back({s});
        s = CaseSpec{};
        s.name = "r8_deepep_like_h7168";  // test_gpu_ops' DeepEP-like config
        s.config =
            Config{.num_ranks = 8, .num_experts = 256, .num_tokens = 1024, .topk = 8, .hidden = 7168, .align = 128};
        s.sigma = 0.0;
        cases.push_back({s, false});
        s = CaseSpec{};
        s.name = "r8_moonep_s8192_e384_h7168_k8";  // test_gpu_ops' MoonEP config
        s.config =
            Config{.num_ranks = 8, .num_experts = 384, .num_tokens = 8192, .topk = 8, .hidden = 7168, .align = 128};
        s.sigma = 1.0;
        cases.push_back({s, false});
    }
    int failed = 0, run = 0;
    // One line per case: PASS, or FAIL with the first mismatch and the command that reproduces it.
    auto report = [&](const std::string& name, const std::function<bool()>& body) {
        ++run;
        g_first.clear();
        bool ok = false;
        try {
            ok = body();
        } catch (const std::exception& e) {
            g_first = e.what();
        }
        std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), ok ? "" : ": ", ok ? "" : g_first.c_str());
        if (!ok) {
            std::printf("  reproduce: test_gpu_fp8 --case %s\n", name.c_str());
            ++failed;
        }
        std::fflush(stdout);
    };
    if (only.empty() || only == "rule") report("rule", [&] { return run_rule(quick); });
    for (const Entry& e : cases) {
        if ((only.empty() && (!quick || e.small)) || only == e.spec.name) {
            report(e.spec.name, [&] { return run_case(e.spec); });
        }
    }
    std::printf("%d of %d cases passed\n", run - failed, run);
    return failed == 0 ? 0 : 1;
}
