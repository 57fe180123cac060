// L1c: the GPU data plane through flatep::Buffer with R processes sharing one GPU over the ipc transport (CUDA VMM
// regions passed as file descriptors), against the CPU backend (R threads, host memory) on the same inputs:
// plan arrays, dispatch rows and weights, weighted and unweighted combine and entry_values must be bitwise equal.
// With --gpu-per-rank (L2), rank r runs on GPU r % device count, so rows cross NVLink between the processes' GPUs.
// Plain main (the device machine has no GoogleTest); exits 0 with "SKIP" where there is no GPU.
//
//   ipc_buffer_gpu_main [--gpu-per-rank] [R ...]     (default: 2 4)
//
// The parent computes the CPU reference before forking and never initialises CUDA; each child checks its own rank.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "device_test_util.hpp"
#include "flatep/buffer.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"

namespace {

using namespace flatep;

struct RankData {
    std::vector<int32_t> idx;      // [S][K]
    std::vector<uint16_t> x;       // [s][H]
    std::vector<float> w;          // [s][K]
    std::vector<uint16_t> recv_x;  // [NvS][H] (after dispatch)
    std::vector<float> recv_w;     // [NvS]
    std::vector<uint16_t> out_w;   // weighted combine of recv_x rows
    std::vector<uint16_t> out_u;   // unweighted combine
    std::vector<float> values;     // entry_values of recv_w
    std::vector<int32_t> plan_words;
};

Config config_for(int R, int rank) {
    Config c;
    c.num_ranks = R;
    c.rank = rank;
    c.num_experts = 8 * R;
    c.num_tokens = 96;
    c.topk = 4;
    c.hidden = 256;
    c.align = 16;
    return c;
}

// Ragged: ranks pass different s <= S; rank 3 (of R >= 4) passes none, with null token pointers on both backends (a
// decode batch often leaves a rank empty).
int num_tokens_of(int rank) { return rank == 3 ? 0 : 96 - 7 * (rank % 3); }

// The token-side pointer of a rank's inputs or outputs: null when it has no tokens (empty() data is null too).
template <typename T>
T* or_null(T* p, int s) {
    return s == 0 ? nullptr : p;
}

void make_inputs(int R, std::vector<RankData>& data) {
    const Config c = config_for(R, 0);
    const std::vector<double> pop = routing::popularity(c.num_experts, 1.5, 7);  // skewed: replicas get placed
    for (int r = 0; r < R; ++r) {
        RankData& d = data[r];
        const int s = num_tokens_of(r);
        d.idx.resize(size_t(s) * c.topk);
        routing::sample_topk(pop, s, c.topk, 7, r, d.idx.data());
        d.x.resize(size_t(s) * c.hidden);
        for (size_t i = 0; i < d.x.size(); ++i)
            d.x[i] = uint16_t(0x3c00u + ((routing::mix64(r * 1000003u + i) >> 40) & 0x3ff));
        d.w.resize(size_t(s) * c.topk);
        for (size_t i = 0; i < d.w.size(); ++i) d.w[i] = float(routing::uniform(r + 99, i));
    }
}

// Runs every op of one rank through `buffer` (host or device pointers come from the caller's `io`).
template <typename Io>
void run_ops(Buffer& buffer, Io& io, RankData& out, const Launch& on = {}) {
    const Layout& l = internal::layout(buffer);
    Plan plan = buffer.plan(io.idx, 4, io.s, nullptr, on);
    buffer.dispatch(plan, io.x, io.w, io.recv_x, io.recv_w, on);
    buffer.combine(plan, io.recv_x, io.recv_w, io.out_w, on);
    buffer.combine(plan, io.recv_x, nullptr, io.out_u, on);
    buffer.entry_values(plan, io.recv_w, io.values, on);
    buffer.check_status(on);
    io.copy_back(l, out);
    const planner::HostPlan& h = internal::host_plan(plan);
    out.plan_words.assign(h.view.tpe_all, h.view.tpe_all + make_plan_sizes(l).total_words);  // from the view base
}

struct HostIo {
    const int32_t* idx;
    int s;
    const uint16_t* x;
    const float* w;
    uint16_t* recv_x;
    float* recv_w;
    uint16_t *out_w, *out_u;
    float* values;
    void copy_back(const Layout&, RankData&) {}
};

using gpu_test::from_device;
using gpu_test::to_device;

struct DeviceIo {
    const int32_t* idx;
    int s;
    const uint16_t* x;
    const float* w;
    uint16_t* recv_x;
    float* recv_w;
    uint16_t *out_w, *out_u;
    float* values;
    void copy_back(const Layout& l, RankData& out) {
        CUDA_OK(cudaDeviceSynchronize());
        out.recv_x = from_device(recv_x, int64_t(l.num_recv_rows) * l.hidden);
        out.recv_w = from_device(recv_w, int64_t(l.num_recv_rows));
        out.out_w = from_device(out_w, int64_t(s) * l.hidden);
        out.out_u = from_device(out_u, int64_t(s) * l.hidden);
        out.values = from_device(values, int64_t(s) * l.topk);
    }
};

void host_reference(int R, std::vector<RankData>& data) {
    transport::LocalHostWorld world(R, 60.0);
    std::vector<std::string> errors(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
        threads.emplace_back([&, r] {
            try {
                Buffer buffer(config_for(R, r), world.transport(r));
                const Layout& l = internal::layout(buffer);
                RankData& d = data[r];
                const int s = num_tokens_of(r);
                d.recv_x.assign(size_t(l.num_recv_rows) * l.hidden, 0);
                d.recv_w.assign(l.num_recv_rows, 0.0f);
                d.out_w.assign(size_t(s) * l.hidden, 0);
                d.out_u.assign(size_t(s) * l.hidden, 0);
                d.values.assign(size_t(s) * l.topk, 0.0f);
                HostIo io{d.idx.data(),    s,
                          d.x.data(),      d.w.data(),
                          d.recv_x.data(), d.recv_w.data(),
                          d.out_w.data(),  d.out_u.data(),
                          d.values.data()};
                run_ops(buffer, io, d);
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < R; ++r) {
        if (!errors[r].empty()) throw std::runtime_error("host reference rank " + std::to_string(r) + ": " + errors[r]);
    }
}

// Rows past the last group end are unspecified: compare only rows inside the groups.
int first_mismatch_rows(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int rows_end, int H) {
    for (int64_t i = 0; i < int64_t(rows_end) * H; ++i) {
        if (a[i] != b[i]) return int(i / H);
    }
    return -1;
}

int child(int R, int rank, std::shared_ptr<Bootstrap> boot, const RankData& ref, bool gpu_per_rank) {
    const int device = gpu_test::use_rank_device(rank, gpu_per_rank);
    auto transport = make_ipc_transport(boot, MemoryKind::kDevice, 60.0);
    Buffer buffer(config_for(R, rank), std::shared_ptr<Transport>(std::move(transport)));
    const Layout& l = internal::layout(buffer);
    const int s = num_tokens_of(rank);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const size_t rows = size_t(l.num_recv_rows);
    DeviceIo io{or_null(to_device(ref.idx), s),
                s,
                or_null(to_device(ref.x), s),
                or_null(to_device(ref.w), s),
                to_device(std::vector<uint16_t>(rows * l.hidden, 0xffff)),
                to_device(std::vector<float>(rows, -1.0f)),
                or_null(to_device(std::vector<uint16_t>(size_t(s) * l.hidden, 0xffff)), s),
                or_null(to_device(std::vector<uint16_t>(size_t(s) * l.hidden, 0xffff)), s),
                or_null(to_device(std::vector<float>(size_t(s) * l.topk, -1.0f)), s)};
    CUDA_OK(cudaDeviceSynchronize());  // the inputs' copies ran on the legacy stream, which `stream` does not wait for
    RankData got;
    run_ops(buffer, io, got, Launch{stream});
    int failures = 0;
    auto report = [&](const char* what, bool ok, const std::string& detail) {
        if (!ok) {
            std::fprintf(stderr, "R=%d rank %d: FAIL %s %s\n", R, rank, what, detail.c_str());
            ++failures;
        }
    };
    report("plan", got.plan_words.size() == ref.plan_words.size(), "size");
    {
        // Header words carry the generation only on the host path; compare every array before the header.
        const int64_t header_at = make_plan_sizes(l).header;
        int64_t bad = -1;
        for (int64_t i = 0; i < header_at && bad < 0; ++i) {
            if (got.plan_words[i] != ref.plan_words[i]) bad = i;
        }
        report("plan", bad < 0, "first differing word " + std::to_string(bad));
    }
    const int32_t rows_end =
        ref.plan_words[make_plan_sizes(l).cu_seqlens + int64_t(rank) * l.num_groups() + l.num_groups() - 1];
    const int bad_row = first_mismatch_rows(got.recv_x, ref.recv_x, rows_end, l.hidden);
    if (bad_row >= 0) {
        // Describe the damage: how many rows differ and whether they were never written (0xffff poison).
        int differing = 0, poisoned = 0;
        for (int r = 0; r < rows_end; ++r) {
            const bool same = std::memcmp(got.recv_x.data() + int64_t(r) * l.hidden,
                                          ref.recv_x.data() + int64_t(r) * l.hidden, size_t(l.hidden) * 2) == 0;
            differing += !same;
            poisoned += !same && got.recv_x[int64_t(r) * l.hidden] == 0xffff;
        }
        const int32_t head = ref.plan_words[make_plan_sizes(l).row_head + bad_row];
        std::fprintf(
            stderr, "R=%d rank %d: %d of %d rows differ (%d never written); row %d head %d got %04x ref %04x\n", R,
            rank, differing, rows_end, poisoned, bad_row, head, unsigned(got.recv_x[int64_t(bad_row) * l.hidden]),
            unsigned(ref.recv_x[int64_t(bad_row) * l.hidden]));
    }
    report("dispatch rows", bad_row < 0, "first differing row " + std::to_string(bad_row));
    report("dispatch weights", std::memcmp(got.recv_w.data(), ref.recv_w.data(), size_t(rows_end) * 4) == 0, "");
    report("combine weighted", got.out_w == ref.out_w, "");
    report("combine unweighted", got.out_u == ref.out_u, "");
    report("entry_values", got.values == ref.values, "");
    const PlanStats& st = *reinterpret_cast<const PlanStats*>(ref.plan_words.data() + make_plan_sizes(l).stats);
    if (failures == 0) {
        std::printf(
            "R=%d rank %d (GPU %d): PASS (rows %d, replicas %d, P %d; plan, dispatch, combine x2, entry_values "
            "bitwise equal to the CPU backend)\n",
            R, rank, device, rows_end, st.total_replicas, st.makespan);
    }
    return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    gpu_test::IpcTestArgs args;
    if (!gpu_test::parse_ipc_test_args(argc, argv, {2, 4}, args)) return 2;
    if (access("/dev/nvidiactl", F_OK) != 0) {
        std::printf("SKIP: no CUDA device (/dev/nvidiactl missing)\n");
        return 0;
    }
    const std::vector<int>& sizes = args.rank_counts;
    int failed = 0;
    for (int R : sizes) {
        std::vector<RankData> data(R);
        make_inputs(R, data);
        host_reference(R, data);
        failed += gpu_test::run_rank_processes("ipc_buffer_gpu_main", R, args.gpu_per_rank,
                                               [&](int rank, std::shared_ptr<Bootstrap> boot) {
                                                   return child(R, rank, boot, data[rank], args.gpu_per_rank);
                                               });
    }
    std::printf("%s\n", failed == 0 ? "ipc_buffer_gpu_main: all PASS" : "ipc_buffer_gpu_main: FAILED");
    return failed == 0 ? 0 : 1;
}
