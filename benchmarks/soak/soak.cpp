// flatep-soak: a long run of the CPU backend with one process per rank (run_forked + the ipc transport on host
// memory). Every step: plan, dispatch, prefetch, combine (weighted), reduce_grad, with a new routing whose
// popularity skew sigma is drawn per step (so maxvio varies from ~0 to > 10) and, every 7th step, a ragged token count.
// It checks that
//   * outputs are bitwise deterministic: each rank hashes every step's outputs (combine output, used receive rows and
//     weights, prefetched slots, reduced gradients; steps do not depend on earlier ones), then replays every
//     --replay-every-th step, in reverse order, after the run and compares the hashes;
//   * memory and descriptors stay flat: anonymous RSS (/proc/self/status; shared RSS reported) and open fds after the
//     warm-up vs at the end (and the anonymous RSS over the second half);
//   * no step takes more than --max-step-ratio times the median step (per step: the slowest rank).
// Slow steps are attributed, not excused: each rank also records its run-queue delay per step (time runnable but not
// running, /proc/thread-self/schedstat), and a step over the ratio whose excess is covered by the largest delay of
// any rank in it is counted as "held off the CPU by the OS" (oversubscription, other load, kernel threads). The check
// fails on every step over the ratio either way. The same processes then run a baseline without FlatEP: each repeats
// a fixed compute loop once per measured step (no communication), sized to its median step times its CPU share
// (min(1, CPUs/R)), and the same statistics are printed for it: how many slow steps the machine makes on its own.
// Prints the figures, appends one CSV row (--csv), exits 1 when a check fails. Its long runs are not part of CI
// (CTest runs a short --serving one: bench.soak_serving_plan_ordered_replays).
//
// --serving B (B in [0, epn)): a serving engine's steps instead, over serving pools of B slots and one layer, with two
// Buffers over the same pools: a balanced one of S tokens (prefill: plan, dispatch, pull prefetch, combine; every
// --prefill-every-th step) and an owner one of --decode-tokens (decode: plan, dispatch, combine). Every step runs its
// dispatch, prefetch and combine plan-ordered (no entry barriers, as flatep.nn.MoE serves; odd steps read their rows in
// place from the receive region, even steps from a copy), its "expert" adds the first H weights of its group's row of
// the [R*Q+B] weights view to each received row (so replicas read in place and pulled slots both count; the layer also
// holds an e4m3 copy and its fp32 scales, pulled with it), and the replay runs the sampled steps again with every
// barrier: the hashes must match. The step-time check then compares each step with the median of its own kind.
//
//   flatep-soak [--ranks 4] [--experts 32] [--tokens 64] [--topk 4] [--hidden 64] [--ffn 32] [--align 8]
//               [--capacity-factor 1.0] [--steps 10000] [--warmup 200] [--replay-every 97] [--sigma-max 3.0]
//               [--seed 1] [--max-step-ratio 3] [--timeout 30] [--baseline 1] [--csv soak.csv]
//               [--serving -1] [--decode-tokens 8] [--prefill-every 4]
// (benchmarks/common/flags.hpp: the flag set every driver shares; --warmup counts steps here.)
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/flags.hpp"
#include "common/run_main.hpp"
#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    flatep::Config config;
    int ffn = 32;
    int steps = 10000;
    int warmup = 200;
    int replay_every = 97;
    double sigma_max = 3.0;
    uint64_t seed = 1;
    double max_step_ratio = 3.0;
    double timeout_s = 30.0;
    bool baseline = true;
    std::string csv = "soak.csv";
    int serving = -1;  // B: serving steps over B slots (-1: training steps)
    int decode_tokens = 8;
    int prefill_every = 4;
    // Serving: whether step `step` is a prefill (the balanced Buffer) or a decode (the owner Buffer).
    bool prefill(int step) const { return step % prefill_every == 0; }
};

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "flatep-soak: error: %s\n", message.c_str());
    std::exit(2);
}

Options parse(int argc, char** argv) {
    Options o;
    flatep::bench::Shape shape;
    shape.ranks = 4;
    shape.experts = 32;
    shape.tokens = 64;
    shape.topk = 4;
    shape.hidden = 64;
    shape.ffn = o.ffn;
    shape.align = 8;
    int baseline = 1;
    flatep::bench::Flags flags("flatep-soak", "Soak test of the CPU backend over processes");
    flags.add_shape(&shape);
    flags.add("--steps", &o.steps, "steps in all (warm-up included)", 1);
    flags.add("--warmup", &o.warmup, "steps before the drift and time baselines", 0);
    flags.add("--replay-every", &o.replay_every, "replay every n-th step at the end", 1);
    flags.add("--sigma-max", &o.sigma_max, "per-step routing sigma drawn from [0, this]");
    flags.add("--seed", &o.seed, "run seed");
    flags.add("--max-step-ratio", &o.max_step_ratio, "fail a step slower than this times the median");
    flags.add("--timeout", &o.timeout_s, "timeout of every wait (s)");
    flags.add("--baseline", &baseline, "1: also run the no-FlatEP compute baseline", 0, 1);
    flags.add("--serving", &o.serving, "B slots a rank: serving steps, prefill and decode (-1: training steps)", -1);
    flags.add("--decode-tokens", &o.decode_tokens, "serving: S of the owner Buffer's decode steps", 1);
    flags.add("--prefill-every", &o.prefill_every, "serving: every n-th step is a prefill, the others decode", 1);
    flags.add_csv(&o.csv);
    flags.parse(argc, argv);
    o.config = flags.validated(shape);
    o.ffn = shape.ffn;
    o.baseline = baseline != 0;
    if (o.warmup >= o.steps) usage_error("need --warmup < --steps");
    const int epn = o.config.num_experts / o.config.num_ranks;
    if (o.serving >= epn)
        usage_error("--serving must be below experts per rank (" + std::to_string(epn) + "), got " +
                    std::to_string(o.serving));
    return o;
}

uint64_t fnv(uint64_t h, const void* data, size_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

// Resident memory from /proc/self/status: anonymous (heap, stacks: a leak shows here) and shared (the memfd regions of
// every rank mapped here: grows as this process first touches pages of peers' buffers, bounded by their size).
struct Rss {
    long anon_kib = 0, shmem_kib = 0;
};

Rss rss_now() {
    std::ifstream status("/proc/self/status");
    std::string line;
    Rss r;
    while (std::getline(status, line)) {
        if (line.rfind("RssAnon:", 0) == 0) r.anon_kib = std::atol(line.c_str() + 8);
        if (line.rfind("RssShmem:", 0) == 0) r.shmem_kib = std::atol(line.c_str() + 9);
    }
    return r;
}

// Run-queue delay of the calling thread in seconds: time it was runnable but not running (the second field of
// /proc/thread-self/schedstat, in ns). One descriptor per rank, opened before the warm-up ends and read with pread.
class RunQueueDelay {
  public:
    RunQueueDelay() : fd_(::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC)) {}
    ~RunQueueDelay() {
        if (fd_ >= 0) ::close(fd_);
    }
    RunQueueDelay(const RunQueueDelay&) = delete;
    RunQueueDelay& operator=(const RunQueueDelay&) = delete;
    bool available() const { return fd_ >= 0; }
    double seconds() const {
        char text[128];
        const ssize_t n = fd_ < 0 ? -1 : ::pread(fd_, text, sizeof(text) - 1, 0);
        if (n <= 0) return 0;
        text[n] = '\0';
        unsigned long long on_cpu_ns = 0, waiting_ns = 0;
        return std::sscanf(text, "%llu %llu", &on_cpu_ns, &waiting_ns) == 2 ? double(waiting_ns) * 1e-9 : 0;
    }

  private:
    int fd_;
};

int open_fds() {
    int count = 0;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return -1;
    while (dirent* entry = ::readdir(dir))
        if (entry->d_name[0] != '.') ++count;
    ::closedir(dir);
    return count - 1;  // the directory stream's own descriptor
}

// Per-rank results, in a page shared with the parent.
struct RankResult {
    Rss rss_start, rss_mid, rss_end;
    int fds_start, fds_end;
    int replayed, replay_mismatches, first_mismatch_step;
    double maxvio_min, maxvio_max, maxvio_sum;
    long replicas_total;
    int run_queue_available;
    int done;
};

// A fixed amount of integer work (a linear congruential chain the compiler cannot shorten).
uint32_t busy_work(uint64_t iterations) {
    volatile uint32_t sink = 1;
    uint32_t x = sink;
    for (uint64_t i = 0; i < iterations; ++i) x = x * 1664525u + 1013904223u;
    sink = x;
    return sink;
}

// The baseline of the step-time check: `count` repetitions of busy_work sized to take `target_s` (calibrated here,
// fastest of 5), each timed into loop_seconds. No FlatEP call, no communication.
void run_baseline(double target_s, int count, double* loop_seconds) {
    const uint64_t probe = 20000;
    double fastest = 1e300;
    for (int i = 0; i < 5; ++i) {
        const auto start = Clock::now();
        busy_work(probe);
        fastest = std::min(fastest, std::chrono::duration<double>(Clock::now() - start).count());
    }
    const uint64_t iterations = uint64_t(double(probe) * target_s / std::max(fastest, 1e-9)) + 1;
    for (int i = 0; i < count; ++i) {
        const auto start = Clock::now();
        busy_work(iterations);
        loop_seconds[i] = std::chrono::duration<double>(Clock::now() - start).count();
    }
}

// The wall time and run-queue delay of a step's ops (start() right before the first, stop() right after the last).
class StepClock {
  public:
    explicit StepClock(const RunQueueDelay& run_queue) : run_queue_(run_queue) {}
    void start() {
        delay_ = run_queue_.seconds();
        start_ = Clock::now();
    }
    void stop() {
        seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
        delay_ = run_queue_.seconds() - delay_;
    }
    double seconds() const { return seconds_; }
    double delay() const { return delay_; }

  private:
    const RunQueueDelay& run_queue_;
    Clock::time_point start_;
    double seconds_ = 0, delay_ = 0;
};

// A step's inputs on one rank: a routing of popularity skew drawn per step, token rows and routing weights; every 7th
// step a ragged token count in [0, max_tokens].
struct StepInputs {
    std::vector<int32_t> idx;
    std::vector<float> topk_weights;
    std::vector<uint16_t> x;
    int s = 0;
    uint64_t seed = 0;

    void make(const Options& o, int step, int rank, int max_tokens) {
        const flatep::Config& cfg = o.config;
        const int K = cfg.topk, H = cfg.hidden;
        idx.resize(size_t(max_tokens) * K);
        topk_weights.resize(idx.size());
        x.resize(size_t(max_tokens) * H);
        seed = flatep::routing::mix64(o.seed * 0x9e3779b97f4a7c15ull + uint64_t(step));
        const double sigma = flatep::routing::uniform(seed, 0) * o.sigma_max;
        s = max_tokens;
        if (step % 7 == 3)
            s = int(flatep::routing::uniform(seed ^ uint64_t(rank + 1), 1) * (max_tokens + 1)) % (max_tokens + 1);
        flatep::routing::sample_topk(flatep::routing::popularity(cfg.num_experts, sigma, seed), s, K, seed, rank,
                                     idx.data());
        for (size_t i = 0; i < size_t(s) * H; ++i)
            x[i] = flatep::float_to_bf16(float(flatep::routing::uniform(seed + uint64_t(rank) * 7919, i) * 8.0 - 4.0));
        for (size_t i = 0; i < size_t(s) * K; ++i)
            topk_weights[i] = float(flatep::routing::uniform(seed + uint64_t(rank) * 104729, i));
    }
};

// What a step's ops produced that the run checks: the hash of its outputs, and the plan's skew and replicas.
struct StepResult {
    uint64_t hash = 0;
    double maxvio = 0;
    long replicas = 0;
};

// A layer's own bf16 weights of projection 0, `elems` of them: fixed for the run, a function of rank and position.
void fill_own_weights(const flatep::ExpertLayer& layer, int rank, int64_t elems) {
    uint16_t* own = layer.own_weights(0);
    for (int64_t i = 0; i < elems; ++i)
        own[i] = flatep::float_to_bf16(float(flatep::routing::uniform(uint64_t(1000 + rank), uint64_t(i)) * 2.0 - 1.0));
}

// Training steps: plan, dispatch, push prefetch, combine (weighted), reduce_grad. replay is not used (the replay runs
// the same ops).
std::function<StepResult(int, bool, StepClock&)> training_steps(const Options& o, int rank,
                                                                const std::shared_ptr<flatep::Transport>& transport) {
    using namespace flatep;
    Config cfg = o.config;
    cfg.rank = rank;
    auto buffer = std::make_shared<Buffer>(cfg, transport);
    const int H = cfg.hidden, epn = buffer->experts_per_rank(), nvs = buffer->num_recv_rows();
    const ProjectionShape shape{H, o.ffn};
    auto pools = std::make_shared<ExpertPools>(transport, epn, std::vector<ProjectionShape>{shape});
    auto layer = std::make_shared<ExpertLayer>(pools->register_layer());
    const int64_t expert_elems = shape.elems();
    fill_own_weights(*layer, rank, epn * expert_elems);
    auto in = std::make_shared<StepInputs>();
    auto out = std::make_shared<std::vector<uint16_t>>(size_t(cfg.num_tokens) * H);
    auto recv_x = std::make_shared<std::vector<uint16_t>>(size_t(nvs) * H);
    auto recv_w = std::make_shared<std::vector<float>>(size_t(nvs));
    return [=, &o](int step, bool, StepClock& clock) {
        in->make(o, step, rank, cfg.num_tokens);
        const int s = in->s;
        // Gradients: own grads start at zero each step (steps stay independent); replica grads are a function of
        // (step, rank, slot).
        float* own_grads = layer->own_grads(0);
        std::memset(own_grads, 0, sizeof(float) * size_t(epn * expert_elems));
        float* slot_grads = layer->grads(0) + epn * expert_elems;

        clock.start();
        const Plan plan = buffer->plan(in->idx.data(), 4, s);
        buffer->dispatch(plan, in->x.data(), in->topk_weights.data(), recv_x->data(), recv_w->data());
        pools->prefetch(plan, *layer);
        // "Expert compute": y = the received rows themselves, combined with the received routing weights.
        buffer->combine(plan, recv_x->data(), recv_w->data(), out->data());
        const std::span<const int32_t> slots = plan.slot_expert(rank);
        for (int j = 0; j < epn; ++j) {
            if (slots[j] < 0) continue;
            for (int64_t i = 0; i < expert_elems; ++i)
                slot_grads[j * expert_elems + i] = float(routing::uniform(in->seed + uint64_t(rank * epn + j), i));
        }
        pools->reduce_grad(plan, *layer);
        buffer->check_status();
        clock.stop();

        uint64_t h = 0xcbf29ce484222325ull;
        h = fnv(h, out->data(), sizeof(uint16_t) * size_t(s) * H);
        const int32_t rows = plan.cu_seqlens(rank).back();
        h = fnv(h, recv_x->data(), sizeof(uint16_t) * size_t(rows) * H);
        h = fnv(h, recv_w->data(), sizeof(float) * size_t(rows));
        h = fnv(h, plan.alloc().data(), plan.alloc().size_bytes());
        const uint16_t* slot_weights = layer->weights(0) + epn * expert_elems;
        for (int j = 0; j < epn; ++j)
            if (slots[j] >= 0) h = fnv(h, slot_weights + j * expert_elems, sizeof(uint16_t) * size_t(expert_elems));
        h = fnv(h, own_grads, sizeof(float) * size_t(epn * expert_elems));
        return StepResult{h, routing::maxvio(plan.tpe_all().data(), cfg.num_ranks, cfg.num_experts),
                          long(plan.stats().total_replicas)};
    };
}

// Serving steps (--serving B): a prefill on the balanced Buffer (plan, dispatch, pull prefetch, combine) every
// --prefill-every-th step, a decode on the owner Buffer (plan, dispatch, combine) otherwise, both over one layer of
// serving pools; dispatch, prefetch and combine plan-ordered, or (replay) with their barriers.
std::function<StepResult(int, bool, StepClock&)> serving_steps(const Options& o, int rank,
                                                               const std::shared_ptr<flatep::Transport>& transport) {
    using namespace flatep;
    const int R = o.config.num_ranks, H = o.config.hidden, B = o.serving;
    const int epn = o.config.num_experts / R;
    // A layer as FP8-weight serving holds it: bf16 [H][F] (what the "expert" reads), an e4m3 copy [H][F] and its fp32
    // block scales [H][ceil(F/128)]; the pull moves all three as bytes.
    const std::vector<ProjectionShape> shapes = {{H, o.ffn}, {H, o.ffn, 1}, {H, (o.ffn + 127) / 128, 4}};
    auto pools = std::make_shared<ExpertPools>(transport, epn, shapes, B);
    Config prefill_cfg = o.config;
    prefill_cfg.rank = rank;
    Config decode_cfg = prefill_cfg;
    decode_cfg.num_tokens = o.decode_tokens;
    // Both made from the pools: they take its B and view stride.
    auto prefill = std::make_shared<Buffer>(prefill_cfg, *pools, PlannerKind::kBalanced);
    auto decode = std::make_shared<Buffer>(decode_cfg, *pools, PlannerKind::kOwner);
    const int64_t view_rows = pools->view_rows();
    for (const Buffer* b : {prefill.get(), decode.get()})
        if (b->num_groups() != view_rows)
            throw std::runtime_error("flatep-soak: a serving layout has " + std::to_string(b->num_groups()) +
                                     " groups, the weights view " + std::to_string(view_rows) + " rows");
    auto layer = std::make_shared<ExpertLayer>(pools->register_layer());
    const int64_t expert_elems = shapes[0].elems();
    // Own weights, written before the first plan op: the bf16 projection's as training's, the others as bytes (a
    // function of rank, projection and position).
    fill_own_weights(*layer, rank, epn * expert_elems);
    for (size_t q = 1; q < shapes.size(); ++q) {
        auto* bytes = reinterpret_cast<uint8_t*>(layer->own_weights(int(q)));
        for (int64_t i = 0; i < epn * shapes[q].expert_bytes(); ++i)
            bytes[i] = uint8_t(routing::uniform(uint64_t(1000 + 64 * q + rank), uint64_t(i)) * 256.0);
    }
    const int64_t max_rows = std::max(prefill->num_recv_rows(), decode->num_recv_rows());
    auto in = std::make_shared<StepInputs>();
    auto out = std::make_shared<std::vector<uint16_t>>(size_t(std::max(o.config.num_tokens, o.decode_tokens)) * H);
    auto recv_x = std::make_shared<std::vector<uint16_t>>(size_t(max_rows) * H);
    auto recv_w = std::make_shared<std::vector<float>>(size_t(max_rows));
    auto y = std::make_shared<std::vector<uint16_t>>(size_t(max_rows) * H);
    return [=, &o](int step, bool replay, StepClock& clock) {
        const bool is_prefill = o.prefill(step);
        Buffer& buffer = is_prefill ? *prefill : *decode;
        in->make(o, step, rank, is_prefill ? o.config.num_tokens : o.decode_tokens);
        const int s = in->s;
        const Launch ordered{.options = {.plan_ordered = !replay}};
        const uint16_t* view = layer->weights(0);
        // Odd steps read their rows in place from the receive region (zero copy), which is what a dispatch's entry
        // barrier guarded: without it only the next plan op keeps a fast peer's next rows out while a slow rank reads.
        const bool zero_copy = step % 2 == 1;
        uint16_t* rx = zero_copy ? buffer.symmetric_recv_x() : recv_x->data();
        float* rw = zero_copy ? buffer.symmetric_recv_w() : recv_w->data();

        clock.start();
        const Plan plan = buffer.plan(in->idx.data(), 4, s);
        buffer.dispatch(plan, in->x.data(), in->topk_weights.data(), rx, rw, ordered);
        if (is_prefill) pools->prefetch(plan, *layer, ordered);
        // "Expert compute": each real group's rows plus the first H weights of its row of the view (its own expert
        // in place, a replica's home row read in place, or a pulled slot).
        const std::span<const int32_t> cu = plan.cu_seqlens(rank);
        int32_t begin = 0;
        for (size_t g = 0; g < cu.size(); ++g) {
            const uint16_t* w = view + int64_t(g) * expert_elems;
            for (int32_t row = begin; row < cu[g]; ++row)
                for (int i = 0; i < H; ++i) {
                    const size_t at = size_t(row) * H + size_t(i);
                    (*y)[at] = float_to_bf16(bf16_to_float(rx[at]) + bf16_to_float(w[i]));
                }
            begin = std::max(begin, cu[g]);
        }
        buffer.combine(plan, y->data(), rw, out->data(), ordered);
        buffer.check_status();
        clock.stop();

        uint64_t h = 0xcbf29ce484222325ull;
        h = fnv(h, out->data(), sizeof(uint16_t) * size_t(s) * H);
        const int32_t rows = cu.back();
        h = fnv(h, y->data(), sizeof(uint16_t) * size_t(rows) * H);  // the rows as read (rx may change after combine)
        h = fnv(h, rw, sizeof(float) * size_t(rows));
        h = fnv(h, plan.alloc().data(), plan.alloc().size_bytes());
        const std::span<const int32_t> slots = plan.slot_expert(rank);
        for (size_t q = 0; q < shapes.size(); ++q) {  // every projection's pulled slots
            const auto* slot_bytes = reinterpret_cast<const uint8_t*>(layer->weights(int(q)));
            const int64_t expert_bytes = shapes[q].expert_bytes();
            for (int j = 0; j < B; ++j)
                if (slots[j] >= 0) h = fnv(h, slot_bytes + (view_rows - B + j) * expert_bytes, size_t(expert_bytes));
        }
        return StepResult{h, routing::maxvio(plan.tpe_all().data(), R, o.config.num_experts),
                          long(plan.stats().total_replicas)};
    };
}

// One rank's run. step_seconds, step_delay: [steps] this rank's wall time and run-queue delay per step;
// loop_seconds: [steps - warmup] the baseline's loop times.
int run_rank(const Options& o, int rank, std::shared_ptr<flatep::Bootstrap> boot, RankResult* result,
             double* step_seconds, double* step_delay, double* loop_seconds) {
    using namespace flatep;
    std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, o.timeout_s);
    const auto run_ops = o.serving < 0 ? training_steps(o, rank, transport) : serving_steps(o, rank, transport);
    std::vector<uint64_t> hashes(size_t(o.steps), 0);
    const RunQueueDelay run_queue;
    result->run_queue_available = run_queue.available() ? 1 : 0;

    auto run_step = [&](int step, bool replay) -> uint64_t {
        StepClock clock(run_queue);
        const StepResult r = run_ops(step, replay, clock);
        if (!replay) {
            step_seconds[step] = clock.seconds();
            step_delay[step] = clock.delay();
            result->maxvio_min = std::min(result->maxvio_min, r.maxvio);
            result->maxvio_max = std::max(result->maxvio_max, r.maxvio);
            result->maxvio_sum += r.maxvio;
            result->replicas_total += r.replicas;
        }
        return r.hash;
    };

    result->maxvio_min = 1e300;
    result->maxvio_max = 0;
    for (int step = 0; step < o.steps; ++step) {
        if (step == o.warmup) {
            result->rss_start = rss_now();
            result->fds_start = open_fds();
        }
        if (step == o.warmup + (o.steps - o.warmup) / 2) result->rss_mid = rss_now();
        hashes[size_t(step)] = run_step(step, false);
    }
    result->rss_end = rss_now();
    result->fds_end = open_fds();
    // Replay a sample of steps, last first (so each replayed step follows a different step than in the run).
    result->first_mismatch_step = -1;
    for (int step = (o.steps - 1) / o.replay_every * o.replay_every; step >= 0; step -= o.replay_every) {
        const uint64_t again = run_step(step, true);
        ++result->replayed;
        if (again != hashes[size_t(step)]) {
            if (result->first_mismatch_step < 0) result->first_mismatch_step = step;
            ++result->replay_mismatches;
        }
    }
    if (o.baseline) {
        std::vector<double> own(step_seconds + o.warmup, step_seconds + o.steps);
        std::nth_element(own.begin(), own.begin() + own.size() / 2, own.end());
        cpu_set_t cpus;
        CPU_ZERO(&cpus);
        const int num_cpus = ::sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
        const double cpu_share = std::min(1.0, double(num_cpus) / o.config.num_ranks);
        run_baseline(own[own.size() / 2] * cpu_share, o.steps - o.warmup, loop_seconds);
    }
    result->done = 1;
    return result->replay_mismatches == 0 ? 0 : 1;
}

// Median, p99, max and the count over ratio*median of a series.
struct TimeStats {
    double median = 0, p99 = 0, max = 0;
    long over = 0;
};

TimeStats time_stats(const std::vector<double>& series, double ratio) {
    std::vector<double> sorted = series;
    std::sort(sorted.begin(), sorted.end());
    TimeStats t;
    t.median = sorted[sorted.size() / 2];
    t.p99 = sorted[std::min(sorted.size() - 1, sorted.size() * 99 / 100)];
    t.max = sorted.back();
    t.over = std::count_if(series.begin(), series.end(), [&](double x) { return x > ratio * t.median; });
    return t;
}

}  // namespace

static int run(int argc, char** argv) {
    const Options o = parse(argc, argv);
    const int R = o.config.num_ranks;
    const int num_measured = o.steps - o.warmup;
    const size_t shared_bytes =
        sizeof(RankResult) * R + sizeof(double) * size_t(R) * (2 * size_t(o.steps) + size_t(num_measured));
    void* shared = ::mmap(nullptr, shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) usage_error("mmap of the shared results failed");
    std::memset(shared, 0, shared_bytes);
    auto* results = static_cast<RankResult*>(shared);
    auto* times = reinterpret_cast<double*>(results + R);
    double* delays = times + size_t(R) * o.steps;  // [R][steps] run-queue delay per rank and step
    double* loops = delays + size_t(R) * o.steps;  // [R][steps - warmup] baseline loop times

    std::printf("flatep-soak: %s, F=%d, %d steps (warm-up %d), replay every %d, sigma in [0, %.2f], seed %llu\n",
                o.config.to_string().c_str(), o.ffn, o.steps, o.warmup, o.replay_every, o.sigma_max,
                (unsigned long long)o.seed);
    if (o.serving >= 0)
        std::printf(
            "serving: B=%d slots, a prefill (balanced, S=%d) every %d steps, decode (owner, S=%d) otherwise; "
            "plan-ordered ops, replayed with their barriers\n",
            o.serving, o.config.num_tokens, o.prefill_every, o.decode_tokens);
    std::fflush(stdout);
    const auto start = Clock::now();
    const std::vector<int> codes = flatep::run_forked(
        R,
        [&](int rank, std::shared_ptr<flatep::Bootstrap> boot) {
            return run_rank(o, rank, boot, &results[rank], times + size_t(rank) * o.steps,
                            delays + size_t(rank) * o.steps, loops + size_t(rank) * num_measured);
        },
        flatep::ForkOptions{o.timeout_s, 86400.0});  // no practical deadline: a day, the most run_forked takes
    const double total_s = std::chrono::duration<double>(Clock::now() - start).count();

    bool ok = true;
    for (int r = 0; r < R; ++r) {
        if (codes[r] != 0 || !results[r].done) {
            std::printf("rank %d: exit code %d%s\n", r, codes[r], results[r].done ? "" : " (did not finish)");
            ok = false;
        }
    }
    // Per step: the slowest rank (ranks meet at every op's barriers).
    std::vector<double> step_s(size_t(o.steps), 0.0);
    for (int s = 0; s < o.steps; ++s)
        for (int r = 0; r < R; ++r) step_s[size_t(s)] = std::max(step_s[size_t(s)], times[size_t(r) * o.steps + s]);
    const TimeStats steps_stats =
        time_stats(std::vector<double>(step_s.begin() + o.warmup, step_s.end()), o.max_step_ratio);
    const double median = steps_stats.median, p99 = steps_stats.p99, worst = steps_stats.max;
    // The step-time check by kind of step, each against its own median: training steps are one kind; serving steps
    // are decodes (kind 0) and prefills (kind 1).
    const int kinds = o.serving < 0 ? 1 : 2;
    auto kind_of = [&](int s) { return o.serving < 0 ? 0 : int(o.prefill(s)); };
    std::vector<TimeStats> kind_stats(static_cast<size_t>(kinds));
    std::vector<int> kind_steps(static_cast<size_t>(kinds), 0);
    long over = 0;
    for (int k = 0; k < kinds; ++k) {
        std::vector<double> series;
        for (int s = o.warmup; s < o.steps; ++s)
            if (kind_of(s) == k) series.push_back(step_s[size_t(s)]);
        kind_steps[size_t(k)] = int(series.size());
        if (!series.empty()) kind_stats[size_t(k)] = time_stats(series, o.max_step_ratio);
        over += kind_stats[size_t(k)].over;
    }
    auto limit = [&](int s) { return o.max_step_ratio * kind_stats[size_t(kind_of(s))].median; };
    // Baseline: per repetition, the slowest rank (as for steps).
    TimeStats base;
    if (o.baseline) {
        std::vector<double> loop_s(size_t(num_measured), 0.0);
        for (int i = 0; i < num_measured; ++i)
            for (int r = 0; r < R; ++r)
                loop_s[size_t(i)] = std::max(loop_s[size_t(i)], loops[size_t(r) * num_measured + i]);
        base = time_stats(loop_s, o.max_step_ratio);
    }
    const double worst_all = *std::max_element(step_s.begin(), step_s.end());
    // Slow steps held off the CPU: the step minus the largest run-queue delay of any rank in it is within the ratio.
    bool run_queue_available = true;
    for (int r = 0; r < R; ++r) run_queue_available = run_queue_available && results[r].run_queue_available;
    std::vector<double> step_delay(size_t(o.steps), 0.0);  // per step: the largest run-queue delay of a rank
    for (int s = 0; s < o.steps; ++s)
        for (int r = 0; r < R; ++r)
            step_delay[size_t(s)] = std::max(step_delay[size_t(s)], delays[size_t(r) * o.steps + s]);
    long over_held_off = 0;
    std::vector<int> slowest;  // indices of the slowest measured steps, slowest first (at most 5)
    for (int s = o.warmup; s < o.steps; ++s) {
        if (step_s[size_t(s)] <= limit(s)) continue;
        if (step_s[size_t(s)] - step_delay[size_t(s)] <= limit(s)) ++over_held_off;
        slowest.push_back(s);
    }
    std::sort(slowest.begin(), slowest.end(), [&](int a, int b) { return step_s[size_t(a)] > step_s[size_t(b)]; });
    if (slowest.size() > 5) slowest.resize(5);

    long anon_start = 0, anon_drift = 0, anon_second_half = 0, shmem_start = 0, shmem_drift = 0;
    int fds_drift_max = 0, replayed = 0, mismatches = 0;
    double maxvio_min = 1e300, maxvio_max = 0, maxvio_sum = 0;
    long replicas = 0;
    for (int r = 0; r < R; ++r) {
        const RankResult& x = results[r];
        anon_start = std::max(anon_start, x.rss_start.anon_kib);
        anon_drift = std::max(anon_drift, x.rss_end.anon_kib - x.rss_start.anon_kib);
        anon_second_half = std::max(anon_second_half, x.rss_end.anon_kib - x.rss_mid.anon_kib);
        shmem_start = std::max(shmem_start, x.rss_start.shmem_kib);
        shmem_drift = std::max(shmem_drift, x.rss_end.shmem_kib - x.rss_start.shmem_kib);
        fds_drift_max = std::max(fds_drift_max, std::abs(x.fds_end - x.fds_start));
        replayed += x.replayed;
        mismatches += x.replay_mismatches;
        if (x.replay_mismatches > 0)
            std::printf("rank %d: %d of %d replayed steps differ (first: step %d)\n", r, x.replay_mismatches,
                        x.replayed, x.first_mismatch_step);
        maxvio_min = std::min(maxvio_min, x.maxvio_min);
        maxvio_max = std::max(maxvio_max, x.maxvio_max);
        maxvio_sum += x.maxvio_sum;
        replicas += x.replicas_total;
    }
    const int measured_steps = o.steps;
    std::printf("total %.1f s; realised maxvio per step %.2f .. %.2f (mean %.2f); replicas per step %.2f\n", total_s,
                maxvio_min, maxvio_max, maxvio_sum / (double(R) * measured_steps),
                double(replicas) / (double(R) * measured_steps));
    std::printf("determinism: %d replayed rank-steps, %d mismatches\n", replayed, mismatches);
    std::printf(
        "RSS anon: %ld KiB after warm-up, drift %+ld KiB (second half %+ld KiB); RSS shmem: %ld KiB, drift "
        "%+ld KiB (max over ranks)\n",
        anon_start, anon_drift, anon_second_half, shmem_start, shmem_drift);
    std::printf("open fds: drift %d (max over ranks)\n", fds_drift_max);
    std::printf(
        "step time after warm-up: median %.3f ms, p99 %.3f ms, max %.3f ms (%.2fx median), %ld steps > %.1fx "
        "median; max incl. warm-up %.3f ms\n",
        median * 1e3, p99 * 1e3, worst * 1e3, worst / median, over, o.max_step_ratio, worst_all * 1e3);
    for (int k = 0; k < kinds && kinds > 1; ++k) {
        const TimeStats& t = kind_stats[size_t(k)];
        std::printf("  %s steps (%d): median %.3f ms, p99 %.3f ms, max %.3f ms (%.2fx median), %ld > %.1fx median\n",
                    k == 1 ? "prefill" : "decode", kind_steps[size_t(k)], t.median * 1e3, t.p99 * 1e3, t.max * 1e3,
                    t.median > 0 ? t.max / t.median : 0.0, t.over, o.max_step_ratio);
    }
    if (over > 0 && run_queue_available) {
        std::printf(
            "steps > %.1fx median held off the CPU by the OS (excess covered by a rank's run-queue delay): %ld of "
            "%ld\n",
            o.max_step_ratio, over_held_off, over);
        std::printf("slowest steps (step: time, largest run-queue delay of a rank):");
        for (int s : slowest)
            std::printf(" %d: %.3f ms, %.3f ms;", s, step_s[size_t(s)] * 1e3, step_delay[size_t(s)] * 1e3);
        std::printf("\n");
    } else if (over > 0) {
        std::printf("run-queue delay not available (/proc/thread-self/schedstat): slow steps not attributed\n");
    }
    if (o.baseline)
        std::printf(
            "baseline (same %d processes, no FlatEP: a compute loop of each rank's median step x its CPU share): "
            "median %.3f ms, p99 %.3f ms, max %.3f ms (%.2fx median), %ld of %d loops > %.1fx median\n",
            R, base.median * 1e3, base.p99 * 1e3, base.max * 1e3, base.max / base.median, base.over, num_measured,
            o.max_step_ratio);
    ok = ok && mismatches == 0 && fds_drift_max == 0 && over == 0;
    // Anonymous memory may settle by a few pages after the warm-up (allocator); growth in the second half, or more than
    // 256 KiB in all, is a leak. Shared memory only grows up to the mapped regions' size (reported, not checked).
    ok = ok && anon_drift <= 256 && anon_second_half <= 64;
    if (!o.csv.empty()) {
        const bool fresh = !std::ifstream(o.csv).good();
        std::ofstream csv(o.csv, std::ios::app);
        if (fresh)
            csv << "R,E,S,K,H,F,align,capacity_factor,steps,warmup,seed,total_s,maxvio_min,maxvio_max,replayed,"
                   "mismatches,rss_anon_start_kib,rss_anon_drift_kib,rss_anon_second_half_kib,rss_shmem_start_kib,"
                   "rss_shmem_drift_kib,fd_drift,median_ms,p99_ms,max_ms,max_"
                   "over_median,"
                   "steps_over_ratio,steps_over_ratio_held_off,baseline_median_ms,baseline_p99_ms,baseline_max_ms,"
                   "baseline_over_ratio,ok,serving_slots,decode_tokens,prefill_every\n";
        csv << R << ',' << o.config.num_experts << ',' << o.config.num_tokens << ',' << o.config.topk << ','
            << o.config.hidden << ',' << o.ffn << ',' << o.config.align << ',' << o.config.capacity_factor << ','
            << o.steps << ',' << o.warmup << ',' << o.seed << ',' << total_s << ',' << maxvio_min << ',' << maxvio_max
            << ',' << replayed << ',' << mismatches << ',' << anon_start << ',' << anon_drift << ',' << anon_second_half
            << ',' << shmem_start << ',' << shmem_drift << ',' << fds_drift_max << ',' << median * 1e3 << ','
            << p99 * 1e3 << ',' << worst * 1e3 << ',' << worst / median << ',' << over << ','
            << (run_queue_available ? over_held_off : -1) << ',' << base.median * 1e3 << ',' << base.p99 * 1e3 << ','
            << base.max * 1e3 << ',' << (o.baseline ? base.over : -1) << ',' << (ok ? 1 : 0) << ',' << o.serving << ','
            << (o.serving < 0 ? 0 : o.decode_tokens) << ',' << (o.serving < 0 ? 0 : o.prefill_every) << '\n';
    }
    std::string failed;  // every failed check, named
    if (mismatches != 0) failed += " determinism;";
    if (fds_drift_max != 0) failed += " open fds;";
    if (anon_drift > 256 || anon_second_half > 64) failed += " RSS;";
    if (over != 0) failed += " step time (" + std::to_string(over) + " steps over the ratio);";
    for (int r = 0; r < R; ++r)
        if (codes[r] != 0 || !results[r].done) failed += " rank " + std::to_string(r) + " exit;";
    if (ok)
        std::printf("soak: ok\n");
    else
        std::printf("soak: FAILED:%s\n", failed.c_str());
    return ok ? 0 : 1;
}

int main(int argc, char** argv) {
    return flatep::bench::run_main("flatep-soak", [&] { return run(argc, argv); });
}
