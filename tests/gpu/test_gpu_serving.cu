// Serving steps on the GPU (issues 43, 47 and 60) through Buffer and serving ExpertPools, R virtual ranks on one GPU,
// bitwise against the CPU backend: plan, dispatch, the pull prefetch of every rank's B slots (two projections: weights
// and a small companion, as FP8 block scales travel) and combine, for B in {0, 1, 4, epn} with the greedy, balanced
// and owner planners, and the static planner over a fixed placement (set_placement), ragged token counts with empty
// ranks (s = 0, null token inputs and outputs), pad rows in the view (Q > epn, as the device's mapping granularity
// needs), plan-ordered ops, and graph-captured steps replayed with new routing (bitwise equal to the CPU backend and to
// the same step run eagerly). Before the GPU runs, the CPU backend's step is held to what serving promises,
// independently of the kernels: no plan uses more than B slots (none with the owner planner, which hosts nothing
// remote), every slot holds its owner's bytes of the plan's slot expert after the pull, every remote expert without a
// slot sits in its view-row group, every entry lands on a host of its expert with its token's row and weight,
// check_plan accepts every plan, and the cases meant to need more remote experts than B on some destination do. Plain
// main: PASS/FAIL per case with the first mismatch and a reproducing command; exit 0 with "SKIP: no CUDA device" where
// no GPU exists (after the CPU checks, which run everywhere).
//
//   test_gpu_serving             every case
//   test_gpu_serving --quick     the small cases only
//   test_gpu_serving --case NAME
//   test_gpu_serving --host-only the CPU backend's checks only (no GPU needed)
//   test_gpu_serving --cpu       the CPU checks, and the step's "device" side on the CPU backend (no GPU needed)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_harness.hpp"

using namespace flatep;
using namespace flatep::gpu_test;

namespace {

std::string g_first;  // first failure of the current case

bool fail(const std::string& why) {
    g_first = why;
    return false;
}

std::string str(int v) { return std::to_string(v); }

// One serving step's shape: the config, B (the pools'), the planner, the tokens of each rank.
struct ServingSpec {
    std::string name;
    Config config;
    ViewShape view;  // num_slots B (-1: epn, the training pools' push)
    PlannerKind planner = PlannerKind::kBalanced;
    std::vector<int> tokens;  // [R] tokens each rank passes (0 .. S)
    bool weighted = true;
    bool prefetch = true;            // the step pulls the slots (the owner planner's step has none to pull)
    bool plan_ordered = false;       // the pull without its barrier, as nn.MoE serves
    bool step_ordered = false;       // dispatch and combine without their entry barriers, as nn.MoE serves
    std::vector<int32_t> placement;  // the static planner's [R][B] (set_placement once, before the steps)
};

// Inputs of one step (identical on both backends).
struct ServingInputs {
    std::vector<std::vector<int32_t>> topk;              // [R][s_r*K]
    std::vector<std::vector<uint16_t>> x;                // [R][s_r*H]
    std::vector<std::vector<float>> weights;             // [R][s_r*K]
    std::vector<std::vector<uint16_t>> y;                // [R][NvS*H] expert outputs
    std::vector<std::vector<std::vector<uint8_t>>> own;  // [P][R][epn*expert_bytes] own experts' weights
};

// Outputs of one step of one rank (host copies).
struct ServingOutputs {
    std::vector<int32_t> plan;                // the plan's words
    std::vector<uint16_t> recv_x;             // [end*H]: the receive rows up to the last group end
    std::vector<float> recv_w;                // [NvS]
    std::vector<uint16_t> out;                // [(s + kCanaryRows)*H]: s rows, then canary rows nobody may write
    std::vector<std::vector<uint8_t>> slots;  // [P][B*expert_bytes] (slots without an expert keep kSlotCanary)
    std::string status;
};
constexpr uint8_t kSlotCanary = 0xa5;
const std::vector<int64_t> kProjectionBytes = {3072, 112};  // weights, and a small companion (FP8 block scales)

// Routing with popularity sigma (seeded; every rank its own draw), the experts homed on the first `hot_ranks` ranks
// 32x as popular (their home ranks overflow, so each other rank takes rows of many of them), random data of every
// input.
ServingInputs make_serving_inputs(const ServingSpec& spec, const Layout& l, double sigma, uint64_t seed,
                                  int hot_ranks) {
    const int R = l.num_ranks, K = l.topk;
    const int64_t H = l.hidden, nvs = l.num_recv_rows;
    ServingInputs in;
    in.topk.resize(R);
    in.x.resize(R);
    in.weights.resize(R);
    in.y.resize(R);
    in.own.assign(kProjectionBytes.size(), std::vector<std::vector<uint8_t>>(size_t(R)));
    std::vector<double> pop = routing::popularity(l.num_experts, sigma, seed);
    for (int e = 0; e < l.num_experts; ++e)
        if (l.home_rank(e) < hot_ranks) pop[size_t(e)] *= 32.0;
    for (int r = 0; r < R; ++r) {
        const int s = spec.tokens[r];
        const uint64_t base = seed * 1000 + uint64_t(r) * 16;
        in.topk[r].resize(size_t(s) * K);
        routing::sample_topk(pop, s, K, seed, r, in.topk[r].data());
        in.x[r] = random_bf16(s * H, base + 1);
        in.weights[r] = random_f32(int64_t(s) * K, base + 2, -1.f, 1.f);
        in.y[r] = random_bf16(nvs * H, base + 3);
        for (size_t p = 0; p < kProjectionBytes.size(); ++p) {
            const int64_t n = l.experts_per_rank * kProjectionBytes[p];
            in.own[p][r].resize(size_t(n));
            const std::vector<uint16_t> w = random_bf16(n / 2, base + 4 + p);
            std::memcpy(in.own[p][r].data(), w.data(), size_t(n));
        }
    }
    return in;
}

// The step on a World through Buffer and ExpertPools (B < epn: serving pools, the pull; B = epn: training pools, the
// push), the receive rows zero copy. Ranks with s = 0 pass null token inputs and outputs.
class ServingStep {
  public:
    ServingStep(const ServingSpec& spec, World& world, int view_stride) : spec_(spec), world_(world) {
        const int R = world.num_ranks();
        std::vector<ProjectionShape> shapes;
        for (int64_t bytes : kProjectionBytes) shapes.push_back({1, bytes / 2});
        for (RankObjects& o : make_rank_objects(world, spec.config, spec.view, spec.planner, shapes, view_stride))
            ranks_.push_back(Rank{std::move(o)});
        const int64_t H = spec.config.hidden, K = spec.config.topk, nvs = ranks_[0].buffer->num_recv_rows();
        for (int r = 0; r < R; ++r) {
            Rank& k = ranks_[size_t(r)];
            const int64_t s = spec.tokens[size_t(r)];
            if (s > 0) {
                k.topk = world.alloc<int32_t>(s * K);
                k.x = world.alloc<uint16_t>(s * H);
                k.weights = world.alloc<float>(s * K);
                k.out = world.alloc<uint16_t>((s + kCanaryRows) * H);
            }
            k.recv_w = world.alloc<float>(nvs);
            k.y = world.alloc<uint16_t>(nvs * H);
        }
        if (spec.planner ==
            PlannerKind::kStatic) {  // collective over the bootstrap: a thread a rank, as at construction
            run_threads(R, [&](int r) { ranks_[size_t(r)].buffer->set_placement(spec.placement, world.launch(r)); });
            world.synchronize();
        }
    }
    ~ServingStep() { world_.synchronize(); }
    const Layout& layout() const { return internal::layout(*ranks_[0].buffer); }
    int view_stride() const { return ranks_[0].buffer->view_stride(); }

    void upload(const ServingInputs& in) {
        const int64_t H = spec_.config.hidden, nvs = ranks_[0].buffer->num_recv_rows();
        for (int r = 0; r < world_.num_ranks(); ++r) {
            Rank& k = ranks_[size_t(r)];
            const int64_t s = spec_.tokens[size_t(r)];
            if (k.storage != nullptr) world_.fill(k.storage, k.buffer->plan_words(), 0);
            if (s > 0) {
                world_.put(k.topk, in.topk[size_t(r)]);
                world_.put(k.x, in.x[size_t(r)]);
                world_.put(k.weights, in.weights[size_t(r)]);
                world_.fill(k.out, (s + kCanaryRows) * H, kCanary);
            }
            world_.put(k.y, in.y[size_t(r)]);
            world_.fill(k.recv_w, nvs, 0.0f);
            for (int p = 0; p < k.pools->num_projections(); ++p) {
                world_.put(reinterpret_cast<uint8_t*>(k.layer.own_weights(p)), in.own[size_t(p)][size_t(r)]);
                const int64_t slot_bytes = k.pools->num_slots() * kProjectionBytes[size_t(p)];
                if (slot_bytes > 0)
                    world_.fill(reinterpret_cast<uint8_t*>(k.pools->slot_pool(p)), slot_bytes, kSlotCanary);
            }
        }
    }
    // plan, dispatch, prefetch (when the spec has one), combine on every rank (device: enqueued, capturable)
    void run() {
        world_.run([&](int r) {
            Rank& k = ranks_[size_t(r)];
            Buffer& b = *k.buffer;
            const int s = spec_.tokens[size_t(r)];
            k.plan = b.plan(k.topk, 4, s, k.storage, world_.launch(r));
            b.dispatch(k.plan, k.x, spec_.weighted ? k.weights : nullptr, b.symmetric_recv_x(), k.recv_w,
                       world_.launch(r, spec_.step_ordered));
            if (spec_.prefetch)
                k.pools->prefetch(k.plan, k.layer, world_.launch(r, spec_.plan_ordered && k.pools->serving()));
            b.combine(k.plan, k.y, spec_.weighted ? k.recv_w : nullptr, k.out, world_.launch(r, spec_.step_ordered));
        });
    }
    std::vector<ServingOutputs> download() {
        world_.synchronize();
        std::vector<ServingOutputs> outs(size_t(world_.num_ranks()));
        const int64_t H = spec_.config.hidden, nvs = ranks_[0].buffer->num_recv_rows();
        for (int r = 0; r < world_.num_ranks(); ++r) {
            Rank& k = ranks_[size_t(r)];
            ServingOutputs& o = outs[size_t(r)];
            o.status = status_of(*k.buffer, world_.launch(r));
            o.plan = plan_words(world_, *k.buffer, k.plan, k.storage);
            const int G = k.buffer->num_groups();
            const int64_t end = make_plan_view(layout(), o.plan.data()).cu_seqlens[int64_t(r) * G + G - 1];
            o.recv_x = world_.get(k.buffer->symmetric_recv_x(), end * H);
            o.recv_w = world_.get(k.recv_w, nvs);
            o.out = k.out != nullptr ? world_.get(k.out, (spec_.tokens[size_t(r)] + kCanaryRows) * H)
                                     : std::vector<uint16_t>{};
            for (int p = 0; p < k.pools->num_projections(); ++p)
                o.slots.push_back(world_.get(reinterpret_cast<const uint8_t*>(k.pools->slot_pool(p)),
                                             k.pools->num_slots() * kProjectionBytes[size_t(p)]));
        }
        return outs;
    }

  private:
    struct Rank : RankObjects {
        int32_t* topk = nullptr;
        uint16_t *x = nullptr, *y = nullptr, *out = nullptr;
        float *weights = nullptr, *recv_w = nullptr;
    };
    ServingSpec spec_;
    World& world_;
    std::vector<Rank> ranks_;
};

// Every output of `got` bitwise equal to `want`'s: status, plan words, receive rows up to the last group end, their
// weights, combine's rows (with the canary rows after them), every slot of every projection.
bool compare(const Layout& l, const std::vector<ServingOutputs>& got, const std::vector<ServingOutputs>& want) {
    auto blobs = [&](const std::vector<ServingOutputs>& outs) {
        Outputs b(outs.size());
        for (size_t r = 0; r < outs.size(); ++r) {
            const ServingOutputs& o = outs[r];
            b[r] = {blob("status", std::vector<char>(o.status.begin(), o.status.end()), 1),
                    blob("plan word", o.plan, 1), blob("dispatch recv_x", o.recv_x, l.hidden),
                    blob("dispatch recv_w", o.recv_w, 1), blob("combine out (rows past s: canary)", o.out, l.hidden)};
            for (size_t q = 0; q < o.slots.size(); ++q)
                b[r].push_back(blob("prefetch slots of projection " + std::to_string(q), o.slots[q], 16));
        }
        return b;
    };
    g_first = gpu_test::compare(blobs(got), blobs(want));
    return g_first.empty();
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
    for (int r = 0; r < l.num_ranks; ++r)
        if (!h[size_t(r)].status.empty()) return fail("rank " + str(r) + ": " + h[size_t(r)].status);
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
        if (e.spec.tokens[r] > 0 &&
            std::count(h[r].out.begin() + int64_t(e.spec.tokens[r]) * H, h[r].out.end(), kCanary) != kCanaryRows * H)
            return fail("combine wrote past the tokens of rank " + str(r));
    }
    return true;
}

bool run_case(const Entry& e, bool host_only, bool cpu) {
    const int R = e.spec.config.num_ranks, steps = e.graph ? 3 : 1;
    std::unique_ptr<World> world;
    std::unique_ptr<ServingStep> dev;
    if (!host_only) {
        world = std::make_unique<World>(R, !cpu);
        dev = std::make_unique<ServingStep>(e.spec, *world, 0);  // the smallest view stride its pools allow
    }
    World host_world(R, false);
    ServingStep host(e.spec, host_world, dev != nullptr ? dev->view_stride() : 0);  // the same groups
    const Layout& l = host.layout();
    std::vector<ServingInputs> inputs;
    std::vector<std::vector<ServingOutputs>> hosts;
    for (int step = 0; step < steps; ++step) {
        inputs.push_back(make_serving_inputs(e.spec, l, e.sigma, 7 + 101 * uint64_t(step), e.hot_ranks));
        host.upload(inputs.back());
        host.run();
        hosts.push_back(host.download());
        if (!check_host_step(e, l, inputs.back(), hosts.back())) {
            g_first = "CPU backend, step " + str(step) + ": " + g_first;
            return false;
        }
    }
    if (host_only) return true;
    cudaGraphExec_t exec = nullptr;
    const bool graph = e.graph && !cpu;
    for (int step = 0; step < steps; ++step) {
        dev->upload(inputs[step]);
        const bool replay = graph && step > 0;  // step 0 eager (and captured after), then replays with new routing
        if (replay) {
            world->replay(exec);
        } else {
            dev->run();
        }
        const std::vector<ServingOutputs> got = dev->download();
        if (!compare(l, got, hosts[step])) {
            g_first += replay ? " (graph replay " + str(step) + ")" : " (eager)";
            return false;
        }
        if (graph && step == 0) exec = world->capture([&] { dev->run(); });
        if (replay && step == steps - 1) {  // the same inputs eagerly: the replay's bits again
            dev->upload(inputs[step]);
            dev->run();
            if (!compare(l, dev->download(), got)) {
                g_first += " (eager against graph replay)";
                return false;
            }
        }
    }
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    return true;
}

Config serving_config(int R, int E, int S, int K, int H, int align) { return make_config(R, E, S, K, H, align); }

// A static placement of B slots a rank (B = -1: epn): slot j of rank d holds an expert of rank d + 1 + j % (R - 1)
// (mod R), local (j / (R - 1) * 5 + d) mod epn, so no rank holds its own expert or one twice (5 is odd, epn <= 64);
// every third slot empty. Hot experts (the first ranks') land on some ranks, cold ones (copies without rows) on others.
std::vector<int32_t> placement_of(const Config& c, int num_slots) {
    const int R = c.num_ranks, epn = c.num_experts / R, B = num_slots < 0 ? epn : num_slots;
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
            e.spec.config = serving_config(8, 256, 128, 8, 128, 8);
            e.spec.view.num_slots = B;
            e.spec.planner = pk.kind;
            e.spec.tokens = ragged;
            e.needs_overflow = B >= 0 && pk.kind != PlannerKind::kOwner;
            cases.push_back(e);
        }
    }
    Entry e;
    e.spec.name = "serving_b0_pad_rows_greedy_unweighted";  // pad rows between the ranks' view rows (device: Q > epn)
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16);
    e.spec.view.num_slots = 0;
    e.spec.planner = PlannerKind::kGreedy;
    e.spec.tokens = {0, 128, 5, 64};
    e.hot_ranks = 2;
    e.spec.weighted = false;
    e.needs_overflow = true;
    cases.push_back(e);
    e.spec.name = "serving_b1_pad_rows_balanced_rank0_empty";
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16);
    e.spec.view.num_slots = 1;
    e.spec.planner = PlannerKind::kBalanced;
    e.spec.weighted = true;
    cases.push_back(e);
    // The pull, dispatch and combine without their entry barriers, ordered by the plan op's (as nn.MoE serves): the
    // same slots and rows, bitwise.
    e = Entry{};
    e.spec.name = "serving_b4_balanced_plan_ordered";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8);
    e.spec.view.num_slots = 4;
    e.spec.tokens = ragged;
    e.spec.plan_ordered = true;
    e.spec.step_ordered = true;
    e.needs_overflow = true;
    cases.push_back(e);
    // Graph-captured steps replayed with new routing.
    e = Entry{};
    e.spec.name = "serving_b4_balanced_graph";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8);
    e.spec.view.num_slots = 4;
    e.spec.tokens = ragged;
    e.spec.plan_ordered = true;  // replays: each step's pull reads the weights after that step's plan
    e.spec.step_ordered = true;  // and each step's dispatch and combine rewrite what the last step's ops read
    e.graph = true;
    e.needs_overflow = true;
    cases.push_back(e);
    e.spec.name = "serving_b0_greedy_graph";
    e.spec.view.num_slots = 0;
    e.spec.planner = PlannerKind::kGreedy;
    cases.push_back(e);
    e.spec.name = "serving_b1_owner_graph";
    e.spec.view.num_slots = 1;
    e.spec.planner = PlannerKind::kOwner;
    e.needs_overflow = false;
    cases.push_back(e);
    // The static planner (issue 60): a fixed placement, its copies split evenly (empty copies too), pulled (serving) or
    // pushed (training pools), graph replays with new routing over the same placement.
    for (int B : {4, 1}) {
        e = Entry{};
        e.spec.name = "static_b" + std::to_string(B) + "_graph";
        e.spec.config = serving_config(8, 256, 128, 8, 128, 8);
        e.spec.view.num_slots = B;
        e.spec.planner = PlannerKind::kStatic;
        e.spec.placement = placement_of(e.spec.config, B);
        e.spec.tokens = ragged;
        e.spec.plan_ordered = true;
        e.spec.step_ordered = true;
        e.graph = true;
        cases.push_back(e);
    }
    e = Entry{};
    e.spec.name = "static_bepn_push";
    e.spec.config = serving_config(8, 256, 128, 8, 128, 8);
    e.spec.view.num_slots = -1;
    e.spec.planner = PlannerKind::kStatic;
    e.spec.placement = placement_of(e.spec.config, -1);
    e.spec.tokens = ragged;
    cases.push_back(e);
    e = Entry{};
    e.spec.name = "static_b2_pad_rows_unweighted";  // device: Q > epn
    e.spec.config = serving_config(4, 32, 128, 4, 64, 16);
    e.spec.view.num_slots = 2;
    e.spec.planner = PlannerKind::kStatic;
    e.spec.placement = placement_of(e.spec.config, 2);
    e.spec.tokens = {0, 128, 5, 64};
    e.hot_ranks = 2;
    e.spec.weighted = false;
    cases.push_back(e);
    // Decode at DeepEP's E and H: S=128, one rank empty, one of one token.
    e = Entry{};
    e.spec.name = "serving_b4_deepep_decode_h7168";
    e.spec.config = serving_config(8, 256, 128, 8, 7168, 128);
    e.spec.view.num_slots = 4;
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
    bool quick = false, host_only = false, cpu = false;
    std::string only;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--host-only") == 0) {
            host_only = true;
        } else if (std::strcmp(argv[i], "--cpu") == 0) {
            cpu = true;
        } else if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) {
            only = argv[++i];
        } else {
            std::fprintf(stderr,
                         "test_gpu_serving: unknown argument '%s'\nusage: test_gpu_serving [--quick] "
                         "[--host-only | --cpu] [--case NAME]\n",
                         argv[i]);
            return 2;
        }
    }
    int num_devices = 0;
    const bool gpu = !host_only && !cpu && cudaGetDeviceCount(&num_devices) == cudaSuccess && num_devices > 0;
    const std::vector<Entry> cases = make_cases();
    int failed = 0, run = 0;
    for (const Entry& e : cases) {
        if (!only.empty() && only != e.spec.name) continue;
        if (quick && !e.small) continue;
        ++run;
        g_first.clear();
        bool ok = false;
        try {
            ok = run_case(e, !gpu && !cpu, cpu);
        } catch (const std::exception& ex) {
            g_first = ex.what();
        }
        std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", e.spec.name.c_str(), ok ? "" : ": ",
                    ok ? "" : g_first.c_str());
        if (!ok) {
            std::printf("  reproduce: test_gpu_serving --case %s%s\n", e.spec.name.c_str(),
                        gpu ? "" : (cpu ? " --cpu" : " --host-only"));
            ++failed;
        }
        std::fflush(stdout);
    }
    if (!only.empty() && run == 0) {
        std::printf("FAIL: no case named '%s'\n", only.c_str());
        return 1;
    }
    std::printf("%d of %d cases passed%s\n", run - failed, run,
                gpu ? "" : (cpu ? " (both sides on the CPU backend)" : " (CPU backend checks only)"));
    if (!gpu && !host_only && !cpu && failed == 0) std::printf("SKIP: no CUDA device\n");
    return failed == 0 ? 0 : 1;
}
