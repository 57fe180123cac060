// L1/L1b GPU test of FP8 rows (design §6): Buffer::dispatch_fp8 on the GPU bitwise against the CPU backend on R
// virtual ranks, both input forms (bf16 rows quantised in the kernel, pre-quantised rows) and both scale modes, with
// canary rows around separate receive buffers, a zero-copy case, and the rule's device build against its host build
// (every fp32 value through the e4m3 conversion, every bf16 amax through both scale modes). Plain main: PASS/FAIL per
// case with the first mismatch, non-zero exit on failure, "SKIP: no CUDA device" (exit 0) where no GPU exists.
//
//   test_gpu_fp8            all cases
//   test_gpu_fp8 --quick    the small cases, and a sample of the fp32 values
//   test_gpu_fp8 --case NAME
//   test_gpu_fp8 --cpu      the dispatch cases with the "device" side on the CPU backend (no GPU needed; no rule)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/fp8.hpp"
#include "gpu_harness.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first mismatch of the current case

bool fail(const std::string& why) {
    g_first = why;
    return false;
}

constexpr uint8_t kCanaryQ = 0xa5;

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
    for (int64_t i = 0; i < rows * H; ++i) x[i] = routing::finite_bf16(seed, uint64_t(i));
    const int64_t num_blocks = rows * H / kFp8BlockSize;
    for (int64_t b = 0; b < num_blocks; ++b) {
        uint16_t* block = x + b * kFp8BlockSize;
        const uint64_t h = routing::mix64(seed * 31 + uint64_t(b));
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
                for (int i = 0; i < kFp8BlockSize; ++i)
                    block[i] = uint16_t(routing::mix64(h + i) & 0x807f);  // subnormals
                break;
            case 4:
                for (int i = 0; i < kFp8BlockSize; ++i)
                    block[i] = uint16_t(routing::mix64(h + i) & 0xff7f) | 0x7000;  // huge
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

// dispatch_fp8 of one case on a World: per rank, plan, dispatch_fp8 of the bf16 rows (quantised in the op), a bf16
// dispatch (it rewrites the staging region in between), dispatch_fp8 of the same rows quantised on the host. Outputs:
// the plan, each dispatch_fp8's receive rows, scales and weights (separate buffers: with the canary rows around them;
// zero copy: rows [0, end), what the region holds past them is unspecified).
// Both forms must give the same rows [0, end) (the rule is the same, wherever the rows are quantised): else *problem.
Outputs run_fp8(const CaseSpec& c, World& world, Fp8Scale mode, std::string* problem) {
    const int R = c.config.num_ranks, s = c.tokens_of(), H = c.config.hidden, K = c.config.topk;
    const int nb = H / kFp8BlockSize;
    const std::vector<std::vector<int64_t>> topk = make_routing(c, c.seed);
    std::vector<std::unique_ptr<Buffer>> buffers(static_cast<size_t>(R));
    run_threads(R, [&](int r) {
        Config cfg = c.config;
        cfg.rank = r;
        buffers[size_t(r)] = std::make_unique<Buffer>(cfg, world.transport(r), c.planner, 0);
    });
    const int nvs = buffers[0]->num_recv_rows();
    const int rows = c.separate_recv ? nvs + 2 * kCanaryRows : nvs, at = c.separate_recv ? kCanaryRows : 0;
    struct Rank {
        int32_t* storage;
        int64_t* topk;
        uint16_t *x, *recv16;
        float *weights, *xs, *scales[2], *w[2];
        uint8_t *xq, *q[2];
        Plan plan;
    };
    std::vector<Rank> ranks(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
        Rank& k = ranks[size_t(r)];
        std::vector<uint16_t> x(size_t(s) * H);
        fill_rows(x.data(), s, H, c.seed * 1000 + uint64_t(r));
        std::vector<uint8_t> xq(size_t(s) * H);
        std::vector<float> xs(size_t(s) * nb);
        quantize_fp8_rows(x.data(), s, H, mode, xq.data(), xs.data());
        k.storage = world.on_device() ? world.alloc<int32_t>(buffers[size_t(r)]->plan_words()) : nullptr;
        k.topk = world.alloc<int64_t>(int64_t(s) * K);
        world.put(k.topk, topk[size_t(r)]);
        k.x = world.alloc<uint16_t>(int64_t(s) * H);
        world.put(k.x, x);
        k.weights = world.alloc<float>(int64_t(s) * K);
        world.put(k.weights, random_f32(int64_t(s) * K, c.seed * 1000 + 500 + uint64_t(r), -1.f, 1.f));
        k.xq = world.alloc<uint8_t>(int64_t(s) * H);
        world.put(k.xq, xq);
        k.xs = world.alloc<float>(int64_t(s) * nb);
        world.put(k.xs, xs);
        k.recv16 = world.alloc<uint16_t>(int64_t(nvs) * H);
        for (int v = 0; v < 2; ++v) {
            k.q[v] = world.alloc<uint8_t>(int64_t(rows) * H);
            world.fill(k.q[v], int64_t(rows) * H, kCanaryQ);
            k.scales[v] = world.alloc<float>(int64_t(rows) * nb);
            world.fill(k.scales[v], int64_t(rows) * nb, canary_f32());
            k.w[v] = world.alloc<float>(rows);
            world.fill(k.w[v], rows, canary_f32());
        }
    }
    Outputs outs(static_cast<size_t>(R));
    auto fp8 = [&](int r, int v) {  // v 0: quantised in the op; 1: pre-quantised
        Rank& k = ranks[size_t(r)];
        Buffer& b = *buffers[size_t(r)];
        uint8_t* q = c.separate_recv ? k.q[v] + int64_t(at) * H : b.symmetric_recv_x_fp8();
        float* sc = c.separate_recv ? k.scales[v] + int64_t(at) * nb : b.symmetric_recv_scales();
        b.dispatch_fp8(k.plan, v == 0 ? k.x : nullptr, v == 0 ? nullptr : k.xq, v == 0 ? nullptr : k.xs,
                       c.weighted ? k.weights : nullptr, q, sc, k.w[v] + at, mode, world.launch(r));
    };
    auto download = [&](int v) {  // zero copy: before the next ops rewrite the region
        for (int r = 0; r < R; ++r) {
            Rank& k = ranks[size_t(r)];
            Buffer& b = *buffers[size_t(r)];
            const std::string tag =
                std::string(v == 0 ? " (bf16 input, " : " (pre-quantised, ") + mode_name(mode) + ")";
            const std::vector<int32_t> words = plan_words(world, b, k.plan, k.storage);
            const int G = b.num_groups();
            if (v == 0) outs[size_t(r)].push_back(blob("plan", words, int64_t(words.size())));
            const int64_t end = make_plan_view(internal::layout(b), const_cast<int32_t*>(words.data()))
                                    .cu_seqlens[int64_t(r) * G + G - 1];
            const int64_t first = c.separate_recv ? kCanaryRows : 0, n = c.separate_recv ? rows : end;
            outs[size_t(r)].push_back(
                blob("recv_x" + tag, world.get(c.separate_recv ? k.q[v] : b.symmetric_recv_x_fp8(), n * H), H));
            outs[size_t(r)].push_back(blob(
                "recv_scales" + tag, world.get(c.separate_recv ? k.scales[v] : b.symmetric_recv_scales(), n * nb), nb));
            outs[size_t(r)].push_back(blob("recv_w" + tag, world.get(k.w[v], rows), 1));
            if (v == 0) continue;
            const std::vector<Blob>& o = outs[size_t(r)];  // plan, then recv_x, scales, w of each form
            for (const int a : {1, 2}) {
                const size_t from = size_t(first * o[size_t(a)].row_bytes), len = size_t(end * o[size_t(a)].row_bytes);
                if (std::memcmp(o[size_t(a)].bytes.data() + from, o[size_t(a) + 3].bytes.data() + from, len) != 0)
                    *problem = "pre-quantised rows differ from rows quantised in the op (rank " + std::to_string(r) +
                               tag + ")";
            }
        }
    };
    world.run([&](int r) {
        ranks[size_t(r)].plan =
            buffers[size_t(r)]->plan(ranks[size_t(r)].topk, 8, s, ranks[size_t(r)].storage, world.launch(r));
    });
    world.run([&](int r) { fp8(r, 0); });
    download(0);
    world.run([&](int r) {
        Rank& k = ranks[size_t(r)];
        buffers[size_t(r)]->dispatch(k.plan, k.x, nullptr, k.recv16, nullptr, world.launch(r));
    });
    world.run([&](int r) { fp8(r, 1); });
    download(1);
    for (int r = 0; r < R; ++r) {
        const std::string status = status_of(*buffers[size_t(r)], world.launch(r));
        outs[size_t(r)].push_back(blob("status", std::vector<char>(status.begin(), status.end()), 1));
    }
    world.synchronize();
    return outs;
}

// The "device" side on the GPU (or, with --cpu, the CPU backend) against the CPU backend, both scale modes.
bool run_case(const CaseSpec& c, bool cpu) {
    World world(c.config.num_ranks, !cpu);
    for (Fp8Scale mode : {Fp8Scale::kFloat, Fp8Scale::kUe8m0}) {
        World host_world(c.config.num_ranks, false);
        std::string host_problem, problem;
        const Outputs host = run_fp8(c, host_world, mode, &host_problem);
        if (!host_problem.empty()) return fail("host: " + host_problem);
        g_first = compare(run_fp8(c, world, mode, &problem), host);
        if (g_first.empty() && !problem.empty()) g_first = problem;
        if (!g_first.empty()) return false;
    }
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    bool quick = false, cpu = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) quick = true;
        if (std::strcmp(argv[i], "--cpu") == 0) cpu = true;
        if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) only = argv[++i];
    }
    int num_devices = 0;
    if (!cpu && (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0)) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
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
            std::printf("  reproduce: test_gpu_fp8 --case %s%s\n", name.c_str(), cpu ? " --cpu" : "");
            ++failed;
        }
        std::fflush(stdout);
    };
    if (!cpu && (only.empty() || only == "rule")) report("rule", [&] { return run_rule(quick); });
    for (const Entry& e : cases) {
        if ((only.empty() && (!quick || e.small)) || only == e.spec.name) {
            report(e.spec.name, [&] { return run_case(e.spec, cpu); });
        }
    }
    std::printf("%d of %d cases passed\n", run - failed, run);
    return failed == 0 ? 0 : 1;
}
