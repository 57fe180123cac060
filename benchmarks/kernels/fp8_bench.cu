// FP8 dispatch against bf16 dispatch, R virtual ranks on one GPU (issue 19, design §6 "FP8 rows"). Per case, on the
// same plan of the same routing: bf16 dispatch, FP8 dispatch of bf16 rows (quantised in the sender's kernel), FP8
// dispatch of pre-quantised rows; each the median over iterations (CUDA events, after warm-up) from a common start of
// every rank to the end of the last, its time against the bf16 dispatch's, and the bytes per rank: pushed to the
// destinations (rows, scales, weights; local rows included), of them to other ranks (what crosses NVLink with one rank
// per GPU), and all device-memory bytes read or written (the sources' rows, the pushes, the fan-out). Receive rows go
// to the symmetric region (no copy-out), as in ops_bench.
//
//   fp8_bench [--preset moonep,deepep] [shape and skew flags] [--iters 20] [--warmup 3] [--csv fp8_bench.csv]
//             [--memory-gib G]
//
// Default: the MoonEP config at maxvio 1 (the preset's other targets with --maxvio) and the DeepEP config. Flags and
// presets: benchmarks/common/flags.hpp. Before it allocates anything it prints every case's estimate of device memory
// (common/memory.hpp) and refuses, exit status 2 and one line, one that does not fit the GPU's free memory
// (--memory-gib G: G GiB instead).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/csv.hpp"
#include "common/cuda_timing.cuh"
#include "common/device_memory.cuh"
#include "common/flags.hpp"
#include "common/kernel_step.cuh"
#include "common/routing_cases.hpp"
#include "internal/api.hpp"

using namespace flatep;

namespace {

// Bytes of one dispatch, all ranks together, from the plans: a row is row_bytes (bf16: 2H; FP8: H + H/32) plus the
// weights; source_row_bytes is what a source reads per token row.
struct Bytes {
    double pushed = 0, remote = 0, total = 0;
};
struct PlanCounts {
    int64_t tokens = 0, entries = 0, pairs = 0, remote_pairs = 0, real = 0, dups = 0, padding = 0;
};

PlanCounts count_plan(const Layout& l, int rank, const std::vector<int32_t>& words, int num_tokens) {
    const PlanView p = make_plan_view(l, const_cast<int32_t*>(words.data()));
    PlanCounts c;
    c.tokens = num_tokens;
    for (int t = 0; t < num_tokens; ++t) {
        for (int k = 0; k < l.topk; ++k) {
            const int d = p.entry_rank[t * l.topk + k];
            if (d < 0) continue;
            ++c.entries;
            bool seen = false;
            for (int k0 = 0; k0 < k && !seen; ++k0) seen = p.entry_rank[t * l.topk + k0] == d;
            if (!seen) {
                ++c.pairs;
                if (d != rank) ++c.remote_pairs;
            }
        }
    }
    const int32_t* cu = p.cu_seqlens + int64_t(rank) * l.num_groups();
    for (int32_t row = 0; row < cu[l.num_groups() - 1]; ++row) {
        const int32_t head = p.row_head[row];
        if (head < 0) {
            ++c.padding;
        } else {
            ++c.real;
            if (head != row) ++c.dups;
        }
    }
    return c;
}

Bytes bytes_of(const std::vector<PlanCounts>& counts, double row_bytes, double source_row_bytes) {
    Bytes b;
    for (const PlanCounts& c : counts) {
        b.pushed += c.pairs * row_bytes + c.entries * 4.0;
        b.remote += c.remote_pairs * row_bytes;  // (weights to other ranks left out: 4 bytes per entry)
        // sources: read the row and the weights, write the pushes; destinations: copy duplicates (read + write),
        // zero padding, read the staged weight and write recv_w of every real row.
        b.total += c.tokens * source_row_bytes + c.entries * 4.0 + c.pairs * row_bytes + c.entries * 4.0 +
                   2.0 * c.dups * row_bytes + c.padding * row_bytes + c.real * 8.0;
    }
    return b;
}

// A case's step buffers: no expert pools.
bench::KernelStepSpec case_spec(const bench::Case& c) {
    bench::KernelStepSpec spec;
    spec.layout = make_layout(c.shape.config());
    spec.tokens.assign(size_t(spec.layout.num_ranks), spec.layout.num_tokens);
    return spec;
}

// Every case's device memory: the step's buffers and each rank's pre-quantised rows and their scales.
std::vector<bench::MemoryEstimate> fp8_memory(const std::vector<bench::Case>& cases) {
    std::vector<bench::MemoryEstimate> all;
    for (const bench::Case& c : cases) {
        const bench::KernelStepSpec spec = case_spec(c);
        const Layout& l = spec.layout;
        bench::MemoryEstimate e = bench::kernel_step_memory(spec);
        e.what = "preset " + c.preset + " (" + c.shape.label() + ")";
        e.add("fp8 rows", int64_t(l.num_tokens) * l.hidden, l.num_ranks);
        e.add("fp8 scales", int64_t(l.num_tokens) * (l.hidden / kFp8BlockSize) * 4, l.num_ranks);
        all.push_back(e);
    }
    return all;
}

void run_case(const bench::Case& c, double sigma, int iters, int warmup, bench::CsvWriter& csv) {
    const bench::KernelStepSpec spec = case_spec(c);
    const Layout& l = spec.layout;
    const int R = l.num_ranks, S = l.num_tokens, H = l.hidden, nb = H / kFp8BlockSize;
    testing::LocalDeviceGroup group(R, false, 30.0);
    bench::KernelStep dev(spec, group);  // rows into the symmetric region
    const std::vector<double> pop = routing::popularity(l.num_experts, sigma, 42);
    std::vector<int32_t> all_counts(size_t(R) * l.num_experts, 0);
    std::vector<uint8_t*> xq(R);
    std::vector<float*> xs(R);
    {
        std::vector<std::vector<uint16_t>> x(R);
        std::vector<std::vector<uint8_t>> q(R);
        std::vector<std::vector<float>> scales(R), weights(R);
        std::vector<std::thread> threads;
        for (int r = 0; r < R; ++r) {  // rows and weights on the host, quantised there once for the pre-quantised op
            threads.emplace_back([&, r] {
                x[r].resize(size_t(S) * H);
                for (int64_t i = 0; i < int64_t(S) * H; ++i)
                    x[r][size_t(i)] = routing::finite_bf16(100 + r, uint64_t(i));
                q[r].resize(size_t(S) * H);
                scales[r].resize(size_t(S) * nb);
                quantize_fp8_rows(x[r].data(), S, H, Fp8Scale::kFloat, q[r].data(), scales[r].data());
                weights[r].resize(size_t(S) * l.topk);
                for (int64_t i = 0; i < int64_t(S) * l.topk; ++i)
                    weights[r][size_t(i)] = routing::data_float(200 + r, uint64_t(i), 0.f, 1.f);
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < R; ++r) {
            std::vector<int32_t> t32(size_t(S) * l.topk);
            routing::sample_topk(pop, S, l.topk, 42, r, t32.data());
            for (int32_t e : t32) ++all_counts[size_t(r) * l.num_experts + e];
            bench::KernelStep::Rank& p = dev.rank(r);
            FLATEP_CUDA_CHECK(cudaMemcpy(p.topk, t32.data(), t32.size() * 4, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(p.x, x[r].data(), x[r].size() * 2, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(p.weights, weights[r].data(), weights[r].size() * 4, cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMalloc(&xq[r], q[r].size()));
            FLATEP_CUDA_CHECK(cudaMalloc(&xs[r], scales[r].size() * 4));
            FLATEP_CUDA_CHECK(cudaMemcpy(xq[r], q[r].data(), q[r].size(), cudaMemcpyHostToDevice));
            FLATEP_CUDA_CHECK(cudaMemcpy(xs[r], scales[r].data(), scales[r].size() * 4, cudaMemcpyHostToDevice));
        }
    }
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    const double maxvio = routing::maxvio(all_counts.data(), R, l.num_experts);
    dev.enqueue_plan();
    group.synchronize();
    auto bf16_args = [&](int r) { return dev.dispatch_args(r); };
    auto fp8_args = [&](int r, bool pre) {
        DispatchFp8Args a = dev.data_args<DispatchFp8Args>(r);
        a.x_bf16 = pre ? nullptr : dev.rank(r).x;
        a.x_fp8 = pre ? xq[r] : nullptr;
        a.x_scales = pre ? xs[r] : nullptr;
        a.topk_weights = dev.rank(r).weights;
        a.scale_mode = Fp8Scale::kFloat;
        a.recv_x = dev.region(r).local + fp8_recv_x_offset(dev.symmetric_layout());
        a.recv_scales =
            reinterpret_cast<float*>(dev.region(r).local + fp8_recv_scales_offset(l, dev.symmetric_layout()));
        a.recv_w = dev.rank(r).recv_w;
        return a;
    };
    auto bf16_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(bf16_args(r), group.stream(r), group.num_sms());
    };
    auto fp8_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(fp8_args(r, false), group.stream(r), group.num_sms());
    };
    auto pre_all = [&] {
        for (int r = 0; r < R; ++r) kernels::launch(fp8_args(r, true), group.stream(r), group.num_sms());
    };
    const bench::Timing t_bf16 = bench::time_ranks(group, iters, warmup, bf16_all);
    const bench::Timing t_fp8 = bench::time_ranks(group, iters, warmup, fp8_all);
    const bench::Timing t_pre = bench::time_ranks(group, iters, warmup, pre_all);
    // Replayed as one graph of every rank's stream: without the one host thread's launch time (see time_ranks_graph).
    constexpr int kGraphBatch = 3;
    const bench::Timing g_bf16 = bench::time_ranks_graph(group, iters, warmup, kGraphBatch, bf16_all);
    const bench::Timing g_fp8 = bench::time_ranks_graph(group, iters, warmup, kGraphBatch, fp8_all);
    const bench::Timing g_pre = bench::time_ranks_graph(group, iters, warmup, kGraphBatch, pre_all);
    group.synchronize();
    const std::string stuck = dev.wait_failure();
    FLATEP_CHECK_RUNTIME(stuck.empty(), stuck);
    std::vector<PlanCounts> counts(R);
    for (int r = 0; r < R; ++r) counts[r] = count_plan(l, r, dev.download_plan(r), S);
    const double bf16_row = 2.0 * H, fp8_row = H + 4.0 * nb;
    struct Row {
        const char* op;
        bench::Timing t, graph;
        Bytes bytes;
    };
    const Row rows[] = {{"dispatch_bf16", t_bf16, g_bf16, bytes_of(counts, bf16_row, bf16_row)},
                        {"dispatch_fp8", t_fp8, g_fp8, bytes_of(counts, fp8_row, bf16_row)},
                        {"dispatch_fp8_prequantised", t_pre, g_pre, bytes_of(counts, fp8_row, fp8_row)}};
    for (const Row& row : rows) {
        const double ratio = row.t.median_us / t_bf16.median_us;
        const double graph_ratio = row.graph.median_us / g_bf16.median_us;
        const double gbps = row.bytes.total / (row.t.median_us * 1e-6) / 1e9;  // the CSV's agg_GBps: eager, as before
        const double graph_gbps = row.bytes.total / (row.graph.median_us * 1e-6) / 1e9;
        std::printf("%-7s %6.1f %6.2f %-26s %10.1f %7.3f %10.1f %7.3f %11.1f %11.1f %11.1f %9.0f\n", c.preset.c_str(),
                    c.skew.maxvio_target(), maxvio, row.op, row.t.median_us, ratio, row.graph.median_us, graph_ratio,
                    row.bytes.pushed / R / 1e6, row.bytes.remote / R / 1e6, row.bytes.total / R / 1e6, graph_gbps);
        csv.row(c.preset, bench::fixed(c.skew.maxvio_target(), 2), bench::fixed(maxvio, 4), row.op,
                bench::fixed(row.t.median_us, 2), bench::fixed(row.t.min_us, 2), bench::fixed(ratio, 4),
                bench::fixed(row.bytes.pushed / R, 0), bench::fixed(row.bytes.remote / R, 0),
                bench::fixed(row.bytes.total / R, 0), bench::fixed(gbps, 1), R, S, l.num_experts, H, l.topk,
                bench::fixed(row.graph.median_us, 2), bench::fixed(row.graph.min_us, 2), bench::fixed(graph_ratio, 4));
    }
    std::fflush(stdout);
    for (int r = 0; r < R; ++r) {
        cudaFree(xq[r]);
        cudaFree(xs[r]);
    }
}

}  // namespace

static int run(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    std::string csv_path = "fp8_bench.csv";
    int iters = 20, warmup = 3;
    double memory_gib = 0;
    bench::Flags flags("fp8_bench",
                       "FP8 dispatch (bf16 rows quantised in the kernel, pre-quantised rows) against bf16 "
                       "dispatch on R virtual ranks of one GPU");
    flags.add_sweep({"moonep", "deepep"});
    flags.add_timing(&iters, &warmup);
    flags.add_csv(&csv_path);
    flags.add_memory(&memory_gib);
    flags.parse(argc, argv);
    std::vector<bench::Case> cases = flags.cases();
    if (!flags.given("--maxvio") && !flags.given("--sigma")) {  // MoonEP at maxvio 1 unless asked otherwise
        std::erase_if(cases,
                      [](const bench::Case& c) { return c.preset == "moonep" && c.skew.maxvio_target() != 1.0; });
    }
    for (const bench::Case& c : cases) {
        const Config cfg = flags.validated(c.shape);
        if (cfg.num_ranks > kMaxRanks) flags.fail("--ranks: at most " + std::to_string(kMaxRanks) + " virtual ranks");
        if (cfg.hidden % kFp8BlockSize != 0)
            flags.fail("--hidden " + std::to_string(cfg.hidden) + ": FP8 rows need a multiple of 128");
    }
    // The estimate against --memory-gib before anything else (so also without a GPU), or the device's free memory.
    if (memory_gib > 0) bench::require_device_fit("fp8_bench", fp8_memory(cases), memory_gib);
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    if (memory_gib <= 0) bench::require_device_fit("fp8_bench", fp8_memory(cases), 0);
    bench::SigmaTable sigmas(/*bisection_ranks=*/8);
    sigmas.prepare(cases, {42});
    bench::CsvWriter csv(
        csv_path, {"config", "maxvio_target", "maxvio", "op", "time_us_median", "time_us_min", "ratio_to_bf16",
                   "pushed_bytes_per_rank", "remote_bytes_per_rank", "total_bytes_per_rank", "agg_GBps", "R", "S", "E",
                   "H", "K", "graph_us_median", "graph_us_min", "graph_ratio_to_bf16"});
    std::printf("%-7s %6s %6s %-26s %10s %7s %10s %7s %11s %11s %11s %9s\n", "config", "target", "maxvio", "op",
                "eager_us", "vs_bf16", "graph_us", "vs_bf16", "MB_pushed", "MB_remote", "MB_total", "agg_GB/s");
    std::printf(
        "(bytes per rank; pushed: rows, scales and weights written to destinations, local included; remote: "
        "rows to other ranks; total: every device-memory byte read or written; eager: one host thread launching every "
        "rank, its launch time included; graph: every rank replayed as one CUDA graph; agg_GB/s: graph-timed)\n");
    for (const bench::Case& c : cases) run_case(c, sigmas.sigma(c, 42), iters, warmup, csv);
    return 0;
}

int main(int argc, char** argv) {
    return bench::run_main("fp8_bench", [&] { return run(argc, argv); });
}
