// Serving steps on the GPU (issues 43, 47 and 60), R virtual ranks on one GPU, bitwise against the CPU backend: plan,
// dispatch, the pull prefetch of every rank's B slots (two projections: weights and a small companion, as FP8 block
// scales travel) and combine, for B in {0, 1, 4, epn} with the greedy, balanced, owner and static planners, ragged
// token counts with empty ranks (s = 0, null token inputs and outputs), pad rows in the view (Q > epn), and
// graph-captured steps replayed with new routing (bitwise equal to the CPU backend and to the same step run eagerly).
// Before the GPU runs, the CPU backend's step is held to what serving promises, independently of the kernels: no
// plan uses more than B slots (none with the owner planner, which hosts nothing remote), every slot holds its
// owner's bytes of the plan's slot expert after the pull, every remote expert without a slot sits in its view-row
// group, every entry lands on a host of its expert with its token's row and weight, check_plan accepts every plan,
// and the cases meant to need more remote experts than B on some destination do.
// Plain main: PASS/FAIL per case with the first mismatch and a reproducing command; exit 0 with "SKIP: no CUDA
// device" where no GPU exists (after the CPU checks, which run everywhere).
//
//   test_gpu_serving             every case
//   test_gpu_serving --quick     the small cases only
//   test_gpu_serving --case NAME
//   test_gpu_serving --host-only the CPU backend's checks only (no GPU needed)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_harness.hpp"
#include "planner/planner.hpp"
#include "serving_harness.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first failure of the current case

template <typename T>
bool same(const char* what, int rank, const T* got, const T* want, int64_t n, int64_t row_len) {
    for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
            uint64_t g = 0, w = 0;
            std::memcpy(&g, &got[i], sizeof(T));
            std::memcpy(&w, &want[i], sizeof(T));
            char buf[256];
            std::snprintf(buf, sizeof(buf), "%s: rank %d row %lld col %lld: got 0x%llx expected 0x%llx", what, rank,
                          (long long)(i / row_len), (long long)(i % row_len), (unsigned long long)g,
                          (unsigned long long)w);
            g_first = buf;
            return false;
        }
    }
    return true;
}

bool fail(const std::string& why) {
    g_first = why;
    return false;
}

std::string str(int v) { return std::to_string(v); }

// Every output of `got` bitwise equal to `want`'s: plan allocation, status, receive rows up to the last group end,
// their weights, combine's rows (with the canary rows after them), every slot of every projection.
bool compare(const Layout& l, const std::vector<ServingOutputs>& got, const std::vector<ServingOutputs>& want) {
    const int64_t H = l.hidden;
    for (int r = 0; r < l.num_ranks; ++r) {
        const ServingOutputs &g = got[r], &w = want[r];
        if (!same("plan word", r, g.plan.data(), w.plan.data(), int64_t(w.plan.size()), 1)) return false;
        if (!same("status", r, g.status, w.status, 4, 4)) return false;
        const PlanView pv = make_plan_view(l, const_cast<int32_t*>(w.plan.data()));
        const int64_t end = pv.cu_seqlens[int64_t(r) * l.num_groups() + l.num_groups() - 1];
        if (!same("dispatch recv_x", r, g.recv_x.data(), w.recv_x.data(), end * H, H)) return false;
        if (!same("dispatch recv_w", r, g.recv_w.data(), w.recv_w.data(), end, 1)) return false;
        if (g.out.size() != w.out.size()) return fail("combine out: sizes differ on rank " + str(r));
        if (!same("combine out (rows past s: canary)", r, g.out.data(), w.out.data(), int64_t(w.out.size()), H))
            return false;
        for (size_t q = 0; q < w.slots.size(); ++q) {
            const std::string what = "prefetch slots of projection " + std::to_string(q);
            if (g.slots[q].size() != w.slots[q].size()) return fail(what + ": sizes differ on rank " + str(r));
            if (!same(what.c_str(), r, g.slots[q].data(), w.slots[q].data(), int64_t(w.slots[q].size()), 16))
                return false;
        }
    }
    return true;
}

struct Entry {
    ServingSpec spec;
    double sigma = 1.0;
    int hot_ranks = 4;  // make_serving_inputs: the experts of ranks [0, 4) hot
    bool graph = false;
    bool small = true;
    bool needs_overflow = false;  // some destination must host more remote experts than B
};

// What the CPU backend's step must satisfy whatever the kernels do (see the header comment).
bool check_host_step(const Entry& e, const Layout& l, const ServingInputs& in, const std::vector<ServingOutputs>& h) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank, B = l.num_slots, K = l.topk;
    const int64_t H = l.hidden;
    const PlanView p0 = make_plan_view(l, const_cast<int32_t*>(h[0].plan.data()));
    {
        planner::HostPlan copy(l);
        std::copy(h[0].plan.begin(), h[0].plan.end(), copy.view.tpe_all);
        const bool placed = e.spec.planner == PlannerKind::kStatic;
        const std::string bad = planner::check_plan(l, copy.view, placed ? e.spec.placement.data() : nullptr);
        if (!bad.empty()) return fail("check_plan: " + bad);
    }
    int most_remote = 0;
    for (int d = 0; d < R; ++d) {
        const int32_t* cu = p0.cu_seqlens + int64_t(d) * l.num_groups();
        auto group_start = [&](int g) { return g == 0 ? 0 : cu[g - 1]; };
        int used = 0, remote = 0;
        for (int j = 0; j < epn; ++j) {
            const int x = p0.slot_expert[d * epn + j];
            if (x < 0) continue;
            ++used;
            if (j >= B) return fail("rank " + str(d) + " slot " + str(j) + " holds expert " + str(x) + ", B=" + str(B));
            if (l.home_rank(x) == d) return fail("rank " + str(d) + " slots its own expert " + str(x));
        }
        if (e.spec.planner == PlannerKind::kOwner && used > 0)
            return fail("owner plan slots experts on rank " + str(d));
        for (int x = 0; x < E; ++x) {
            const int rows = p0.alloc[d * E + x];
            if (rows == 0) continue;
            const bool own = l.home_rank(x) == d;
            if (e.spec.planner == PlannerKind::kOwner && !own)
                return fail("owner plan puts rows of expert " + str(x) + " on rank " + str(d));
            int slot = -1;
            for (int j = 0; j < B; ++j)
                if (p0.slot_expert[d * epn + j] == x) slot = j;
            remote += !own;
            int group = own ? (l.serving ? l.expert_view_row(x) : l.local_expert(x)) : -1;
            if (!own) {
                if (slot >= 0) {
                    group = l.first_slot_group() + slot;
                } else if (l.serving) {
                    group = l.expert_view_row(x);  // read in place from the home rank's weights
                } else {
                    return fail("training layout: rank " + str(d) + " hosts expert " + str(x) + " without a slot");
                }
            }
            if (p0.group_row[d * E + x] != group_start(group) || cu[group] - group_start(group) != l.padded(rows))
                return fail("rank " + str(d) + " expert " + str(x) + ": rows not in group " + str(group));
        }
        if (l.serving)
            for (int g = 0; g < R * l.view_stride; ++g)
                if (g % l.view_stride >= epn && cu[g] != group_start(g))
                    return fail("rank " + str(d) + " pad row group " + str(g) + " is not empty");
        most_remote = std::max(most_remote, remote);
        // The pull: every slot holds its owner's bytes of the plan's expert; the others were not written.
        for (size_t q = 0; q < in.own.size(); ++q) {
            const int64_t bytes = int64_t(in.own[q][0].size()) / epn;
            for (int j = 0; j < B; ++j) {
                const int x = p0.slot_expert[d * epn + j];
                const uint8_t* got = h[d].slots[q].data() + j * bytes;
                if (x >= 0 && e.spec.prefetch) {
                    const uint8_t* want = in.own[q][l.home_rank(x)].data() + l.local_expert(x) * bytes;
                    if (std::memcmp(got, want, size_t(bytes)) != 0)
                        return fail("rank " + str(d) + " slot " + str(j) + " (expert " + str(x) + ", projection " +
                                    std::to_string(q) + ") does not hold its owner's weights");
                } else if (std::count(got, got + bytes, kSlotCanary) != bytes) {
                    return fail("rank " + str(d) + " slot " + str(j) + " without an expert was written");
                }
            }
        }
    }
    if (e.needs_overflow && most_remote <= B)
        return fail("the case should make a destination host more than B=" + str(B) + " remote experts; the most is " +
                    str(most_remote) + " (change its routing)");
    // Dispatch: every entry of every source on a host of its expert, in that expert's rows, with its token's row.
    for (int r = 0; r < R; ++r) {
        const PlanView pr = make_plan_view(l, const_cast<int32_t*>(h[r].plan.data()));
        for (int t = 0; t < e.spec.tokens[r]; ++t) {
            for (int k = 0; k < K; ++k) {
                const int x = in.topk[r][size_t(t) * K + k], d = pr.entry_rank[t * K + k],
                          row = pr.entry_row[t * K + k];
                const std::string at = "rank " + str(r) + " token " + str(t) + " k " + str(k);
                if (d < 0 || d >= R || p0.alloc[d * E + x] == 0) return fail(at + ": sent to a non-host");
                const int first = p0.group_row[d * E + x];
                if (row < first || row >= first + p0.alloc[d * E + x]) return fail(at + ": row outside its group");
                if (std::memcmp(h[d].recv_x.data() + int64_t(row) * H, in.x[r].data() + int64_t(t) * H, size_t(H) * 2))
                    return fail(at + ": received row differs from the token's");
                if (e.spec.weighted && h[d].recv_w[size_t(row)] != in.weights[r][size_t(t) * K + k])
                    return fail(at + ": received weight differs");
            }
        }
        if (std::count(h[r].out.begin() + int64_t(e.spec.tokens[r]) * H, h[r].out.end(), kOutCanary) !=
            DeviceCase::kCanaryRows * H)
            return fail("combine wrote past the tokens of rank " + str(r));
    }
    return true;
}

const std::vector<int64_t> kProjectionBytes = {3072, 112};  // weights, and a small companion (FP8 block scales)

// Captures enqueue() on every rank's stream as one graph (forked from and joined into rank 0's stream).
cudaGraphExec_t capture(testing::LocalDeviceGroup& group, ServingDevice& dev) {
    cudaStream_t s0 = group.stream(0);
    cudaEvent_t fork, join[kMaxRanks];
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    FLATEP_CUDA_CHECK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
    FLATEP_CUDA_CHECK(cudaEventRecord(fork, s0));
    for (int r = 1; r < group.num_ranks(); ++r) FLATEP_CUDA_CHECK(cudaStreamWaitEvent(group.stream(r), fork));
    dev.enqueue_step();
    for (int r = 1; r < group.num_ranks(); ++r) {
        FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
        FLATEP_CUDA_CHECK(cudaEventRecord(join[r], group.stream(r)));
        FLATEP_CUDA_CHECK(cudaStreamWaitEvent(s0, join[r]));
    }
    FLATEP_CUDA_CHECK(cudaStreamEndCapture(s0, &graph));
    FLATEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaGraphDestroy(graph);
    return exec;
}

bool run_case(const Entry& e, bool host_only) {
    const Layout l = make_layout(e.spec.config, e.spec.planner);
    const int steps = e.graph ? 3 : 1;
    std::vector<ServingInputs> inputs;
    std::vector<std::vector<ServingOutputs>> hosts;
    for (int step = 0; step < steps; ++step) {
        inputs.push_back(
            make_serving_inputs(e.spec, l, kProjectionBytes, e.sigma, 7 + 101 * uint64_t(step), e.hot_ranks));
        hosts.push_back(run_serving_host(e.spec, l, inputs.back()));
        if (!check_host_step(e, l, inputs.back(), hosts.back())) {
            g_first = "CPU backend, step " + str(step) + ": " + g_first;
            return false;
        }
    }
    if (host_only) return true;
    const char* timeout_env = std::getenv("FLATEP_GPU_TEST_TIMEOUT");
    testing::LocalDeviceGroup group(l.num_ranks, false, timeout_env != nullptr ? std::atof(timeout_env) : 20.0);
    DevicePools pools(l.num_ranks, l.experts_per_rank, l.num_slots, kProjectionBytes);
    ServingDevice dev(e.spec, l, group, pools);
    cudaGraphExec_t exec = nullptr;
    for (int step = 0; step < steps; ++step) {
        dev.upload(inputs[step]);
        const bool replay = step > 0;  // step 0 eager (and captured after), then replays with new routing
        if (replay) {
            FLATEP_CUDA_CHECK(cudaGraphLaunch(exec, group.stream(0)));
        } else {
            dev.enqueue_step();
        }
        const std::vector<ServingOutputs> gpu = dev.download();
        const std::string stuck = dev.wait_failure();
        if (!stuck.empty()) return fail(stuck);
        if (!compare(l, gpu, hosts[step])) {
            g_first += replay ? " (graph replay " + str(step) + ")" : " (eager)";
            return false;
        }
        if (e.graph && step == 0) exec = capture(group, dev);
        if (replay && step == steps - 1) {  // the same inputs eagerly: the replay's bits again
            dev.upload(inputs[step]);
            dev.enqueue_step();
            if (!compare(l, dev.download(), gpu)) {
                g_first += " (eager against graph replay)";
                return false;
            }
        }
    }
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    return true;
}

Config serving_config(int R, int E, int S, int K, int H, int align, int num_slots, int view_stride = 0) {
    Config c = make_config(R, E, S, K, H, align);
    c.num_slots = num_slots;
    c.view_stride = view_stride;
    return c;
}

// A static placement of B slots a rank (B = -1: epn): slot j of rank d holds an expert of rank d + 1 + j % (R - 1)
// (mod R), local (j / (R - 1) * 5 + d) mod epn, so no rank holds its own expert or one twice (5 is odd, epn <= 64);
// every third slot empty. Hot experts (the first ranks') land on some ranks, cold ones (copies without rows) on others.
std::vector<int32_t> placement_of(const Config& c) {
    const int R = c.num_ranks, epn = c.num_experts / R, B = c.num_slots < 0 ? epn : c.num_slots;
    std::vector<int32_t> placement(size_t(R) * B, -1);
    for (int d = 0; d < R && R > 1; ++d)
        for (int j = 0; j < B; ++j)
            if (j % 3 != 1)
                placement[size_t(d) * B + j] = ((d + 1 + j % (R - 1)) % R) * epn + (j / (R - 1) * 5 + d) % epn;
    return placement;
}

std::vector<Entry> make_cases() {
    std::vector<Entry> cases;
    // 8 ranks, E=256 (epn 32), S=128, K=8: an empty rank and a rank of one token; the experts of ranks 0-3 hot, so
    // that those ranks hold more than S*K rows and each of the others takes rows of more than 4 of their experts.
    const std::vector<int> ragged = {128, 0, 128, 128, 1, 128, 128, 128};
    const struct {
        const char* name;
        PlannerKind kind;
    } planners[] = {
        {"greedy", PlannerKind::kGreedy}, {"balanced", PlannerKind::kBalanced}, {"owner", PlannerKind::kOwner}};
    for (int B : {0, 1, 4, -1}) {
        for (const auto& pk : planners) {
            Entry e;
            e.spec.name = "serving_b" + (B < 0 ? std::string("epn") : std::to_string(B)) + "_" + pk.name;
            e.spec.config = serving_config(8, 256, 128, 8, 128, 8, B);
            e.spec.planner = pk.kind;
            e.spec.tokens = ragged;
            e.needs_overflow = B >= 0 && pk.kind != PlannerKind::kOwner;
            cases.push_back(e);
        }
    }
    Entry e;
    e.spec.name = "serving_bepn_balanced_push";  // training's push at B = epn: the same slots as the pull
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8, -1);
    e.spec.tokens = ragged;
    e.spec.prefetch_push = true;
    cases.push_back(e);
    e = Entry{};
    e.spec.name = "serving_b0_pad_rows_greedy_unweighted";  // Q = epn + 3: pad rows between the ranks' view rows
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16, 0, 11);
    e.spec.planner = PlannerKind::kGreedy;
    e.spec.tokens = {0, 128, 5, 64};
    e.hot_ranks = 2;
    e.spec.weighted = false;
    e.needs_overflow = true;
    cases.push_back(e);
    e.spec.name = "serving_b1_pad_rows_balanced_rank0_empty";
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16, 1, 9);
    e.spec.planner = PlannerKind::kBalanced;
    e.spec.weighted = true;
    cases.push_back(e);
    // The pull, dispatch and combine without their entry barriers, ordered by the plan op's (as nn.MoE serves): the
    // same slots and rows, bitwise.
    e = Entry{};
    e.spec.name = "serving_b4_balanced_plan_ordered";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8, 4);
    e.spec.tokens = ragged;
    e.spec.plan_ordered = true;
    e.spec.step_ordered = true;
    e.needs_overflow = true;
    cases.push_back(e);
    // Graph-captured steps replayed with new routing.
    e = Entry{};
    e.spec.name = "serving_b4_balanced_graph";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8, 4);
    e.spec.tokens = ragged;
    e.spec.plan_ordered = true;  // replays: each step's pull reads the weights after that step's plan
    e.spec.step_ordered = true;  // and each step's dispatch and combine rewrite what the last step's ops read
    e.graph = true;
    e.needs_overflow = true;
    cases.push_back(e);
    e.spec.name = "serving_b0_greedy_graph";
    e.spec.config.num_slots = 0;
    e.spec.planner = PlannerKind::kGreedy;
    cases.push_back(e);
    e.spec.name = "serving_b1_owner_graph";
    e.spec.config.num_slots = 1;
    e.spec.planner = PlannerKind::kOwner;
    e.needs_overflow = false;
    cases.push_back(e);
    // The static planner (issue 60): a fixed placement, its copies split evenly (empty copies too), pulled (serving) or
    // pushed (the training layout), graph replays with new routing over the same placement.
    for (int B : {4, 1}) {
        e = Entry{};
        e.spec.name = "static_b" + std::to_string(B) + "_graph";
        e.spec.config = serving_config(8, 256, 128, 8, 128, 8, B);
        e.spec.planner = PlannerKind::kStatic;
        e.spec.placement = placement_of(e.spec.config);
        e.spec.tokens = ragged;
        e.spec.plan_ordered = true;
        e.spec.step_ordered = true;
        e.graph = true;
        cases.push_back(e);
    }
    e = Entry{};
    e.spec.name = "static_bepn_push";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8, -1);
    e.spec.planner = PlannerKind::kStatic;
    e.spec.placement = placement_of(e.spec.config);
    e.spec.tokens = ragged;
    e.spec.prefetch_push = true;
    cases.push_back(e);
    e = Entry{};
    e.spec.name = "static_b2_pad_rows_unweighted";  // Q = epn + 3
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16, 2, 11);
    e.spec.planner = PlannerKind::kStatic;
    e.spec.placement = placement_of(e.spec.config);
    e.spec.tokens = {0, 128, 5, 64};
    e.hot_ranks = 2;
    e.spec.weighted = false;
    cases.push_back(e);
    // Decode at DeepEP's E and H: S=128, one rank empty, one of one token.
    e = Entry{};
    e.spec.name = "serving_b4_deepep_decode_h7168";
    e.spec.config = serving_config(8, 256, 128, 8, 7168, 128, 4);
    e.spec.tokens = {128, 128, 0, 128, 128, 1, 128, 128};
    e.graph = true;
    e.small = false;
    e.needs_overflow = true;
    cases.push_back(e);
    return cases;
}

}  // namespace

int main(int argc, char** argv) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    bool quick = false, host_only = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--host-only") == 0) {
            host_only = true;
        } else if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) {
            only = argv[++i];
        } else {
            std::fprintf(stderr,
                         "test_gpu_serving: unknown argument '%s'\nusage: test_gpu_serving [--quick] "
                         "[--host-only] [--case NAME]\n",
                         argv[i]);
            return 2;
        }
    }
    int num_devices = 0;
    const bool gpu = !host_only && cudaGetDeviceCount(&num_devices) == cudaSuccess && num_devices > 0;
    const std::vector<Entry> cases = make_cases();
    int failed = 0, run = 0;
    for (const Entry& e : cases) {
        if (!only.empty() && only != e.spec.name) continue;
        if (quick && !e.small) continue;
        ++run;
        g_first.clear();
        bool ok = false;
        try {
            ok = run_case(e, !gpu);
        } catch (const std::exception& ex) {
            g_first = ex.what();
        }
        std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", e.spec.name.c_str(), ok ? "" : ": ",
                    ok ? "" : g_first.c_str());
        if (!ok) {
            std::printf("  reproduce: test_gpu_serving --case %s%s\n", e.spec.name.c_str(), gpu ? "" : " --host-only");
            ++failed;
        }
        std::fflush(stdout);
    }
    if (!only.empty() && run == 0) {
        std::printf("FAIL: no case named '%s'\n", only.c_str());
        return 1;
    }
    std::printf("%d of %d cases passed%s\n", run - failed, run, gpu ? "" : " (CPU backend checks only)");
    if (!gpu && !host_only && failed == 0) std::printf("SKIP: no CUDA device\n");
    return failed == 0 ? 0 : 1;
}
