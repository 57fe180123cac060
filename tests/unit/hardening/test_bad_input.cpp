// The bad-input table: every invalid argument of the C++ API, fed to the real entry point, with the exact error
// category and message it must produce. docs/errors.md's table is this list; print it as Markdown with
//   FLATEP_PRINT_BAD_INPUT_TABLE=1 flatep_hardening_tests --gtest_filter='BadInput.*'
// Everything runs in one process through the local host transport (R = 1, or 2 rank threads where a second rank is
// needed); every row is rejected before any collective starts, except the expert-id rows (skipped, recorded and
// reported by check_status).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/env.hpp"
#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ffn.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "ops/prefetch_args.hpp"
#include "planner/planner.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

struct Row {
    std::string input;  // what the caller did wrong (first column of the table)
    ErrorCategory category;
    std::string message;
    std::function<void()> call;
};

Config base_config() {
    Config c;
    c.num_ranks = 1;
    c.rank = 0;
    c.num_experts = 2;
    c.num_tokens = 4;
    c.topk = 1;
    c.hidden = 8;
    c.align = 1;
    return c;
}

// A Config row: base_config() with one change, through Config::validate (Buffer's constructor runs the same).
Row config_row(const std::string& input, const std::string& message, const std::function<void(Config&)>& change) {
    return Row{"Config: " + input, ErrorCategory::kInvalidArgument, message, [change] {
                   Config c = base_config();
                   change(c);
                   c.validate();
               }};
}

// A Config row of the serving layout or the owner planner: base_config() with E = 4 (epn = 4) and one change,
// validated for `planner` (what Buffer's constructor runs with its planner).
// A config and the view shape of its groups (B, Q: the pools' for a Buffer made from pools), through make_layout.
Row serving_config_row(const std::string& input, const std::string& message,
                       const std::function<void(Config&, ViewShape&)>& change,
                       PlannerKind planner = PlannerKind::kBalanced) {
    return Row{"Config: " + input, ErrorCategory::kInvalidArgument, message, [change, planner] {
                   Config c = base_config();
                   c.num_experts = 4;
                   ViewShape v;
                   change(c, v);
                   make_layout(c, planner, v);
               }};
}

using testing::ScopedEnv;

// A FLATEP_TIMEOUT_S row: the variable set to `text` while the process's timeout is read.
Row env_timeout_row(const std::string& text) {
    return Row{"FLATEP_TIMEOUT_S=" + text, ErrorCategory::kInvalidArgument,
               "FLATEP_TIMEOUT_S must be a number of seconds in (0, 86400], got '" + text + "'", [text] {
                   ScopedEnv env("FLATEP_TIMEOUT_S", text.c_str());
                   env::timeout_seconds();
               }};
}

// The one-rank bootstrap of a process (make_ipc_transport needs one; a bad timeout is rejected before it is used).
class SoloBootstrap final : public Bootstrap {
  public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    std::vector<std::string> all_gather(const std::string& blob) override { return {blob}; }
};

std::string escape_cell(const std::string& s) {
    std::string out;
    for (char ch : s) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
    return out;
}

// Runs every row; returns the failures (one line each).
std::string check_rows(const std::vector<Row>& rows) {
    std::string failures;
    const bool print = std::getenv("FLATEP_PRINT_BAD_INPUT_TABLE") != nullptr;
    for (const Row& row : rows) {
        bool thrown = false;
        try {
            row.call();
        } catch (const Error& e) {
            thrown = true;
            if (e.category() != row.category || e.message() != row.message) {
                failures += "  " + row.input + ":\n    got  [" + category_name(e.category()) + "] " + e.message() +
                            "\n    want [" + category_name(row.category) + "] " + row.message + "\n";
            }
        }
        if (!thrown) failures += "  " + row.input + ": no error\n";
        if (print) {
            std::printf("| %s | %s | `%s` |\n", escape_cell(row.input).c_str(), category_name(row.category),
                        escape_cell(row.message).c_str());
        }
    }
    return failures;
}

TEST(BadInput, ConfigFields) {
    constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
    const std::vector<Row> rows = {
        config_row("num_ranks = 0", "num_ranks (R) must be in [1, 64], got 0", [](Config& c) { c.num_ranks = 0; }),
        config_row("num_ranks = 65", "num_ranks (R) must be in [1, 64], got 65", [](Config& c) { c.num_ranks = 65; }),
        config_row("rank = -1", "rank must be in [0, num_ranks=1), got -1", [](Config& c) { c.rank = -1; }),
        config_row("rank = R", "rank must be in [0, num_ranks=2), got 2",
                   [](Config& c) { c.num_ranks = 2, c.rank = 2; }),
        config_row("num_experts = 0", "num_experts (E) must be positive, got 0", [](Config& c) { c.num_experts = 0; }),
        config_row("E % R != 0 (E=3, R=2)", "num_experts (E) must be a multiple of num_ranks (R): E=3 R=2",
                   [](Config& c) { c.num_ranks = 2, c.num_experts = 3; }),
        config_row("num_tokens = 0", "num_tokens (S) must be positive, got 0", [](Config& c) { c.num_tokens = 0; }),
        config_row("topk = 0", "topk (K) must be in [1, 32], got 0", [](Config& c) { c.topk = 0; }),
        config_row("topk = 33", "topk (K) must be in [1, 32], got 33",
                   [](Config& c) { c.num_experts = 64, c.topk = 33; }),
        config_row("topk > num_experts (K=4, E=2)", "topk (K) must not exceed num_experts (E): K=4 E=2",
                   [](Config& c) { c.topk = 4; }),
        config_row("hidden = 0", "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got 0",
                   [](Config& c) { c.hidden = 0; }),
        config_row("hidden = 12 (rows not 16-byte aligned)",
                   "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got 12",
                   [](Config& c) { c.hidden = 12; }),
        config_row("align = 0", "align must be in [1, 4096], got 0", [](Config& c) { c.align = 0; }),
        config_row("align = 4097", "align must be in [1, 4096], got 4097", [](Config& c) { c.align = 4097; }),
        config_row("capacity_factor = 0.5", "capacity_factor must be in [1, 4], got 0.5",
                   [](Config& c) { c.capacity_factor = 0.5; }),
        config_row("capacity_factor = 4.5", "capacity_factor must be in [1, 4], got 4.5",
                   [](Config& c) { c.capacity_factor = 4.5; }),
        config_row("capacity_factor = NaN", "capacity_factor must be in [1, 4], got nan",
                   [kNan](Config& c) { c.capacity_factor = kNan; }),
        config_row("S*K over int32 (S=2^30, K=4)", "num_tokens*topk (S*K) must fit int32, got 4294967296",
                   [](Config& c) { c.num_experts = 4, c.num_tokens = 1 << 30, c.topk = 4; }),
        config_row("capacity over int32 (S*K=2^30, capacity_factor=2)",
                   "capacity C = ceil(capacity_factor*S*K) must fit int32, got 2147483648",
                   [](Config& c) { c.num_tokens = 1 << 30, c.capacity_factor = 2.0; }),
        config_row("R*NvS over int32 (R=64, S=2^26)",
                   "num_ranks * receive rows (R*NvS) must fit int32, got 67108864*64",
                   [](Config& c) { c.num_ranks = 64, c.num_experts = 64, c.num_tokens = 1 << 26; }),
        config_row("receive buffer over 2^40 elements (S=2^20, H=2^21)",
                   "receive buffer NvS*H = 1048576*2097152 elements is too large",
                   [](Config& c) { c.num_tokens = 1 << 20, c.hidden = 1 << 21; }),
        // The int32 extremes: what Python's out-of-range ints (rejected before the binding) have as C++ neighbours.
        config_row("num_ranks = INT32_MAX", "num_ranks (R) must be in [1, 64], got 2147483647",
                   [](Config& c) { c.num_ranks = INT32_MAX; }),
        config_row("rank = INT32_MIN", "rank must be in [0, num_ranks=1), got -2147483648",
                   [](Config& c) { c.rank = INT32_MIN; }),
        config_row("num_experts = INT32_MIN", "num_experts (E) must be positive, got -2147483648",
                   [](Config& c) { c.num_experts = INT32_MIN; }),
        config_row("num_experts = INT32_MAX", "num_experts (E) too large: 2*R*E must fit int32, got 2*1*2147483647",
                   [](Config& c) { c.num_experts = INT32_MAX; }),
        config_row("num_tokens = INT32_MIN", "num_tokens (S) must be positive, got -2147483648",
                   [](Config& c) { c.num_tokens = INT32_MIN; }),
        config_row("num_tokens = INT32_MAX, topk = 2", "num_tokens*topk (S*K) must fit int32, got 4294967294",
                   [](Config& c) { c.num_tokens = INT32_MAX, c.topk = 2; }),
        config_row("topk = INT32_MAX", "topk (K) must be in [1, 32], got 2147483647",
                   [](Config& c) { c.topk = INT32_MAX; }),
        config_row("hidden = INT32_MAX",
                   "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got 2147483647",
                   [](Config& c) { c.hidden = INT32_MAX; }),
        config_row("hidden = 2^31 - 8, S = 2^20", "receive buffer NvS*H = 1048576*2147483640 elements is too large",
                   [](Config& c) { c.num_tokens = 1 << 20, c.hidden = INT32_MAX - 7; }),
        config_row("align = INT32_MIN", "align must be in [1, 4096], got -2147483648",
                   [](Config& c) { c.align = INT32_MIN; }),
        config_row("capacity_factor = inf", "capacity_factor must be in [1, 4], got inf",
                   [](Config& c) { c.capacity_factor = std::numeric_limits<double>::infinity(); }),
    };
    EXPECT_EQ(check_rows(rows), "");
}

TEST(BadInput, BufferAndPlanCalls) {
    LocalHostWorld world(1, 10.0);
    const Config cfg = base_config();
    Buffer buffer(cfg, world.transport(0));
    Buffer other(cfg, world.transport(0));
    const int32_t idx[4] = {0, 1, 1, 0};
    const Plan plan = buffer.plan(idx, 4, 4);
    const Plan foreign = other.plan(idx, 4, 4);
    const int nvs = buffer.num_recv_rows();
    std::vector<uint16_t> x(4 * 8), recv(size_t(nvs) * 8), out(4 * 8);
    std::vector<float> values(static_cast<size_t>(nvs)), entry_out(4);
    const std::string foreign_text = " plan was made by buffer " + std::to_string(other.id()) +
                                     ", not by this buffer (" + std::to_string(buffer.id()) + ")";
    const std::string empty_text = " plan is empty (default-constructed); get one from Buffer::plan()";
    LocalHostWorld world2(2, 10.0);

    const std::vector<Row> rows = {
        {"Buffer: transport = nullptr", ErrorCategory::kInvalidArgument, "Buffer: transport is null",
         [&] { Buffer b(cfg, nullptr); }},
        {"Buffer: planner = PlannerKind(7)", ErrorCategory::kInvalidArgument, "Buffer: unknown planner kind 7",
         [&] { Buffer b(cfg, world.transport(0), PlannerKind(7)); }},
        {"Buffer: config.num_ranks != transport's", ErrorCategory::kInvalidArgument,
         "Buffer: config.num_ranks (1) differs from the transport's (2)", [&] { Buffer b(cfg, world2.transport(0)); }},
        {"Buffer: config.rank != transport's", ErrorCategory::kInvalidArgument,
         "Buffer: config.rank (1) differs from the transport's rank (0)",
         [&] {
             Config c = cfg;
             c.num_ranks = 2, c.rank = 1;
             Buffer b(c, world2.transport(0));
         }},
        {"plan: index_bytes = 2", ErrorCategory::kInvalidArgument,
         "plan: index_bytes must be 4 (int32) or 8 (int64), got 2", [&] { buffer.plan(idx, 2, 4); }},
        {"plan: num_tokens = -1", ErrorCategory::kInvalidArgument, "plan: num_tokens must be in [0, S=4], got -1",
         [&] { buffer.plan(idx, 4, -1); }},
        {"plan: num_tokens = S + 1", ErrorCategory::kInvalidArgument, "plan: num_tokens must be in [0, S=4], got 5",
         [&] { buffer.plan(idx, 4, 5); }},
        {"plan: topk_idx = nullptr (num_tokens > 0)", ErrorCategory::kInvalidArgument, "plan: topk_idx is null",
         [&] { buffer.plan(nullptr, 4, 4); }},
        {"plan: expert id = E (int32), then check_status", ErrorCategory::kInvalidArgument,
         "rank 0: invalid expert id 2 at topk_idx flat index 2 (token 2, k 0); ids must be in [0, E=2); the entry "
         "was skipped",
         [&] {
             const int32_t bad[4] = {0, 1, 2, 0};
             buffer.plan(bad, 4, 4);
             buffer.check_status();
         }},
        {"plan: expert id = -1 (int64), then check_status", ErrorCategory::kInvalidArgument,
         "rank 0: invalid expert id -1 at topk_idx flat index 1 (token 1, k 0); ids must be in [0, E=2); the entry "
         "was skipped",
         [&] {
             const int64_t bad[4] = {0, -1, 7, 0};
             buffer.plan(bad, 8, 4);
             buffer.check_status();
         }},
        // The status word holds an int32: ids beyond int32 are reported as a bound.
        {"plan: expert id = 2^40 (int64), then check_status", ErrorCategory::kInvalidArgument,
         "rank 0: invalid expert id 2147483647 or above at topk_idx flat index 3 (token 3, k 0); ids must be in [0, "
         "E=2); "
         "the entry was skipped",
         [&] {
             const int64_t bad[4] = {0, 1, 1, int64_t(1) << 40};
             buffer.plan(bad, 8, 4);
             buffer.check_status();
         }},
        {"dispatch: empty Plan()", ErrorCategory::kInvalidArgument, "dispatch:" + empty_text,
         [&] { buffer.dispatch(Plan(), x.data(), nullptr, recv.data(), nullptr); }},
        {"dispatch: plan from another Buffer", ErrorCategory::kMismatch, "dispatch:" + foreign_text,
         [&] { buffer.dispatch(foreign, x.data(), nullptr, recv.data(), nullptr); }},
        {"dispatch: x = nullptr", ErrorCategory::kInvalidArgument, "dispatch: x is null",
         [&] { buffer.dispatch(plan, nullptr, nullptr, recv.data(), nullptr); }},
        {"dispatch: recv_x = nullptr", ErrorCategory::kInvalidArgument, "dispatch: recv_x is null",
         [&] { buffer.dispatch(plan, x.data(), nullptr, nullptr, nullptr); }},
        {"combine: empty Plan()", ErrorCategory::kInvalidArgument, "combine:" + empty_text,
         [&] { buffer.combine(Plan(), recv.data(), nullptr, out.data()); }},
        {"combine: plan from another Buffer", ErrorCategory::kMismatch, "combine:" + foreign_text,
         [&] { buffer.combine(foreign, recv.data(), nullptr, out.data()); }},
        {"combine: y = nullptr", ErrorCategory::kInvalidArgument, "combine: y is null",
         [&] { buffer.combine(plan, nullptr, nullptr, out.data()); }},
        {"combine: out = nullptr", ErrorCategory::kInvalidArgument, "combine: out is null",
         [&] { buffer.combine(plan, recv.data(), nullptr, nullptr); }},
        {"entry_values: empty Plan()", ErrorCategory::kInvalidArgument, "entry_values:" + empty_text,
         [&] { buffer.entry_values(Plan(), values.data(), entry_out.data()); }},
        {"entry_values: plan from another Buffer", ErrorCategory::kMismatch, "entry_values:" + foreign_text,
         [&] { buffer.entry_values(foreign, values.data(), entry_out.data()); }},
        {"entry_values: row_values = nullptr", ErrorCategory::kInvalidArgument, "entry_values: row_values is null",
         [&] { buffer.entry_values(plan, nullptr, entry_out.data()); }},
        {"entry_values: out = nullptr", ErrorCategory::kInvalidArgument, "entry_values: out is null",
         [&] { buffer.entry_values(plan, values.data(), nullptr); }},
        // An option an op does not take is refused, never ignored (flatep/launch.hpp).
        {"entry_values: options.plan_ordered = true", ErrorCategory::kInvalidArgument,
         "entry_values: options.plan_ordered must be false: only dispatch, dispatch_fp8, combine and a serving "
         "prefetch take it, got true",
         [&] { buffer.entry_values(plan, values.data(), entry_out.data(), {.options = {.plan_ordered = true}}); }},
        {"plan: options.plan_ordered = true", ErrorCategory::kInvalidArgument,
         "plan: options.plan_ordered must be false: only dispatch, dispatch_fp8, combine and a serving prefetch take "
         "it, got true",
         [&] { buffer.plan(idx, 4, 4, nullptr, {.options = {.plan_ordered = true}}); }},
        {"Plan accessor on an empty Plan()", ErrorCategory::kInvalidArgument,
         "plan is empty (default-constructed); get one from Buffer::plan()", [&] { Plan().generation(); }},
        {"Plan::slot_expert(rank = R)", ErrorCategory::kInvalidArgument, "slot_expert: rank must be in [0, 1), got 1",
         [&] { plan.slot_expert(1); }},
        {"Plan::cu_seqlens(rank = -1)", ErrorCategory::kInvalidArgument, "cu_seqlens: rank must be in [0, 1), got -1",
         [&] { plan.cu_seqlens(-1); }},
    };
    EXPECT_EQ(check_rows(rows), "");
    // Every rejected call left the Buffer usable: a full step still works and reports nothing.
    buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr);
    buffer.combine(plan, recv.data(), nullptr, out.data());
    EXPECT_NO_THROW(buffer.check_status());
}

TEST(BadInput, ExpertPoolsCalls) {
    const int R = 2;
    LocalHostWorld world(R, 10.0);
    // Rank threads: each makes a Buffer (epn = 2), pools and a plan; rank 0 then runs the table with rank 1's plan
    // at hand (plans are plain objects, so another rank's plan can be passed by mistake).
    std::vector<std::unique_ptr<Buffer>> buffers(R);
    std::vector<Plan> plans(R);
    const std::vector<std::string> errors = testing::run_ranks(R, [&](int rank) {
        Config c = base_config();
        c.num_ranks = R, c.rank = rank, c.num_experts = 4;
        buffers[rank] = std::make_unique<Buffer>(c, world.transport(rank));
        const int32_t idx[4] = {0, 1, 2, 3};
        plans[rank] = buffers[rank]->plan(idx, 4, 4);
    });
    ASSERT_EQ(testing::failures(errors), "");
    LocalHostWorld solo(1, 10.0);
    Buffer solo_buffer(base_config(), solo.transport(0));
    const int32_t idx[4] = {0, 1, 1, 0};
    const Plan solo_plan = solo_buffer.plan(idx, 4, 4);  // R=1, epn=2
    ExpertPools pools(solo.transport(0), 2, {{2, 4}});
    ExpertPools others(solo.transport(0), 2, {{2, 4}});
    ExpertPools narrow(solo.transport(0), 1, {{2, 4}});
    ExpertLayer layer = pools.register_layer();
    ExpertLayer other_layer = others.register_layer();
    ExpertLayer narrow_layer = narrow.register_layer();

    const std::vector<Row> rows = {
        {"ExpertPools: transport = nullptr", ErrorCategory::kInvalidArgument, "ExpertPools: transport is null",
         [&] {
             ExpertPools p(nullptr, 2, {{2, 4}});
         }},
        {"ExpertPools: experts_per_rank = 0", ErrorCategory::kInvalidArgument,
         "ExpertPools: experts_per_rank must be positive, got 0",
         [&] {
             ExpertPools p(solo.transport(0), 0, {{2, 4}});
         }},
        {"ExpertPools: no projections", ErrorCategory::kInvalidArgument,
         "ExpertPools: at least one projection is needed", [&] { ExpertPools p(solo.transport(0), 2, {}); }},
        {"ExpertPools: projection rows = 0", ErrorCategory::kInvalidArgument,
         "ExpertPools: projection 1 must have positive rows and cols, got [0][4]",
         [&] {
             ExpertPools p(solo.transport(0), 2, {{2, 4}, {0, 4}});
         }},
        {"ExpertLayer::weights(projection out of range)", ErrorCategory::kInvalidArgument,
         "projection must be in [0, 1), got 1", [&] { layer.weights(1); }},
        {"ExpertPools::shape(projection out of range)", ErrorCategory::kInvalidArgument,
         "projection must be in [0, 1), got -1", [&] { pools.shape(-1); }},
        {"prefetch: empty Plan()", ErrorCategory::kInvalidArgument,
         "prefetch: plan is empty (default-constructed); "
         "get one from Buffer::plan()",
         [&] { pools.prefetch(Plan(), layer); }},
        {"prefetch: layer registered with other pools", ErrorCategory::kMismatch,
         "prefetch: layer was registered with pools " + std::to_string(others.id()) + ", not with these pools (" +
             std::to_string(pools.id()) + ")",
         [&] { pools.prefetch(solo_plan, other_layer); }},
        {"reduce_grad: plan's E/R differs from the pools' experts_per_rank", ErrorCategory::kInvalidArgument,
         "reduce_grad: plan has R=1 epn=2 but the pools have R=1 epn=1",
         [&] { narrow.reduce_grad(solo_plan, narrow_layer); }},
        {"prefetch: plan of a Buffer with another R", ErrorCategory::kInvalidArgument,
         "prefetch: plan has R=2 epn=2 but the pools have R=1 epn=2", [&] { pools.prefetch(plans[1], layer); }},
    };
    EXPECT_EQ(check_rows(rows), "");

    // Another rank's plan (same R and epn): rank 0's pools get rank 1's plan.
    std::vector<std::string> messages(R);
    const std::vector<std::string> pool_errors = testing::run_ranks(R, [&](int rank) {
        ExpertPools p(world.transport(rank), 2, {{2, 4}});
        ExpertLayer l = p.register_layer();
        try {
            p.reduce_grad(plans[1 - rank], l);
        } catch (const Error& e) {
            messages[rank] = e.message();
        }
    });
    ASSERT_EQ(testing::failures(pool_errors), "");
    EXPECT_EQ(messages[0], "reduce_grad: plan belongs to rank 1, pools to rank 0");
    EXPECT_EQ(messages[1], "reduce_grad: plan belongs to rank 0, pools to rank 1");
    if (std::getenv("FLATEP_PRINT_BAD_INPUT_TABLE") != nullptr)
        std::printf("| reduce_grad: plan of another rank | invalid argument | `%s` |\n", messages[0].c_str());
}

// Serving (num_slots B < epn, design §5 "Serving layout") and the owner planner (design §4): Config, the planner
// entry points and ExpertPools. One rank (R = 1, E = 4: epn = 4) unless a row says otherwise.
TEST(BadInput, ServingAndOwner) {
    const std::string owner_fits = " must fit int32 (it is meant for decode-sized S)";
    const std::vector<Row> config_rows = {
        serving_config_row("num_slots = 5 (epn = 4)", "num_slots (B) must be -1 (= epn) or in [0, epn=4], got 5",
                           [](Config&, ViewShape& v) { v.num_slots = 5; }),
        serving_config_row("num_slots = -2", "num_slots (B) must be -1 (= epn) or in [0, epn=4], got -2",
                           [](Config&, ViewShape& v) { v.num_slots = -2; }),
        serving_config_row("view_stride = 3 (epn = 4)",
                           "view_stride (Q) must be 0 (= epn) or in [epn=4, 1048576], got 3",
                           [](Config&, ViewShape& v) { v.num_slots = 2, v.view_stride = 3; }),
        serving_config_row("view_stride = 2^20 + 1",
                           "view_stride (Q) must be 0 (= epn) or in [epn=4, 1048576], got 1048577",
                           [](Config&, ViewShape& v) { v.num_slots = 2, v.view_stride = (1 << 20) + 1; }),
        serving_config_row("R = E = 64, B = 1, view_stride = 2^20",
                           "view_stride (Q) too large: cu_seqlens' R*(R*Q + B) = 64*67108865 must fit int32 "
                           "(Q=1048576)",
                           [](Config& c, ViewShape& v) {
                               c.num_ranks = 64, c.num_experts = 64;
                               v.num_slots = 1, v.view_stride = 1 << 20;
                           }),
        serving_config_row(
            "planner kind 7", "planner kind must be greedy (0), balanced (1), owner (2) or static (3), got 7",
            [](Config&, ViewShape&) {}, PlannerKind(7)),
        serving_config_row(
            "owner planner, R*S*K over int32 (R = 64, S = 2^22, K = 16)",
            "owner planner: its receive capacity R*S*K = 64*4194304*16 = 4294967296 rows" + owner_fits,
            [](Config& c, ViewShape&) { c.num_ranks = 64, c.num_experts = 64, c.num_tokens = 1 << 22, c.topk = 16; },
            PlannerKind::kOwner),
        serving_config_row(
            "owner planner, R*NvS over int32 (R = 2, S = 2^29, K = 1, align = 1)",
            "owner planner: receive rows NvS = 1073741824 (capacity R*S*K = 1073741824) times R = 2" + owner_fits,
            [](Config& c, ViewShape&) { c.num_ranks = 2, c.num_experts = 2, c.num_tokens = 1 << 29; },
            PlannerKind::kOwner),
        serving_config_row(
            "static planner, R*S*K over int32 (R = 64, S = 2^22, K = 16)",
            "static planner: its receive capacity R*S*K = 64*4194304*16 = 4294967296 rows must fit int32 (the worst "
            "case of any placement)",
            [](Config& c, ViewShape&) { c.num_ranks = 64, c.num_experts = 64, c.num_tokens = 1 << 22, c.topk = 16; },
            PlannerKind::kStatic),
    };
    EXPECT_EQ(check_rows(config_rows), "");

    // The planner's entry points: a name, and a plan whose planner and layout disagree (plan_counts, the host
    // planner a Buffer runs; a Buffer builds its layout for its own planner, so only a direct call can mix them).
    Config owner_config = base_config();
    owner_config.num_experts = 4;
    const Layout owner_layout = make_layout(owner_config, PlannerKind::kOwner);
    const Layout balanced_layout = make_layout(owner_config, PlannerKind::kBalanced);
    auto plan_with = [](const Layout& l, PlannerKind kind) {
        return [l, kind] {
            planner::HostPlan plan(l);  // tpe_all zero: a valid request
            planner::plan_counts(l, kind, plan.view);
        };
    };
    const std::string same_kind = ": make_layout(config, planner) with the same kind";
    const std::vector<Row> planner_rows = {
        {"planner_from_name(\"fast\")", ErrorCategory::kInvalidArgument,
         "planner must be 'greedy', 'balanced', 'owner' or 'static', got 'fast'", [] { planner_from_name("fast"); }},
        {"plan_counts: balanced planner on an owner layout", ErrorCategory::kInvalidArgument,
         "planner balanced on a layout made for the owner planner" + same_kind,
         plan_with(owner_layout, PlannerKind::kBalanced)},
        {"plan_counts: greedy planner on an owner layout", ErrorCategory::kInvalidArgument,
         "planner greedy on a layout made for the owner planner" + same_kind,
         plan_with(owner_layout, PlannerKind::kGreedy)},
        {"plan_counts: owner planner on a balancing layout", ErrorCategory::kInvalidArgument,
         "planner owner on a layout made for a balancing planner" + same_kind,
         plan_with(balanced_layout, PlannerKind::kOwner)},
        {"plan_counts: static planner on a balancing layout", ErrorCategory::kInvalidArgument,
         "planner static on a layout made for a balancing planner" + same_kind,
         plan_with(balanced_layout, PlannerKind::kStatic)},
        {"plan_counts: static planner without a placement table", ErrorCategory::kInvalidArgument,
         "planner static needs a placement table (make_placement_table), got null",
         plan_with(make_layout(owner_config, PlannerKind::kStatic), PlannerKind::kStatic)},
    };
    EXPECT_EQ(check_rows(planner_rows), "");

    // ExpertPools: serving pools (epn = 4, B = 2; experts of [4][8] bf16 = 64 bytes) and the Buffers whose plans they
    // take. Q depends on the transport's granularity (64 on 4096-byte pages; design §5), so the rows read it back.
    LocalHostWorld world(1, 10.0);
    ExpertPools serving(world.transport(0), 4, {{4, 8}}, 2);
    ExpertLayer serving_layer = serving.register_layer();
    const std::string q = std::to_string(serving.view_stride());
    ASSERT_GE(serving.view_stride(), 4);
    Config training_config = base_config();
    training_config.num_experts = 4;
    Buffer training_buffer(training_config, world.transport(0));
    Buffer serving_buffer(training_config, serving);  // made from the pools: their B and Q
    // A Buffer of B = 2 and Q + 1 made without the pools (only the internal API can: a plan of other pools' groups).
    const std::unique_ptr<Buffer> stride_buffer =
        internal::make_buffer(training_config, world.transport(0), PlannerKind::kBalanced,
                              ViewShape{.num_slots = 2, .view_stride = serving.view_stride() + 1});
    const int32_t idx[4] = {0, 1, 2, 3};
    const Plan training_plan = training_buffer.plan(idx, 4, 4);
    const Plan serving_plan = serving_buffer.plan(idx, 4, 4);
    const Plan stride_plan = stride_buffer->plan(idx, 4, 4);
    // Training-layout pools (B = epn) that cannot train: an e4m3 projection; and bf16 training pools.
    ExpertPools e4m3(world.transport(0), 4, {{4, 8, 1}});
    ExpertLayer e4m3_layer = e4m3.register_layer();
    ExpertPools training(world.transport(0), 4, {{4, 8}});
    const std::vector<float> grad(size_t(4 * 2 * 4 * 8));
    const std::string rebuild = "; build the Buffer from these pools (Buffer(config, pools))";
    const std::string serving_only =
        "these pools are forward-only (serving: num_slots < epn); gradients need "
        "num_slots = epn and bf16 weights";
    const std::string not_bf16 =
        "these pools are forward-only (a projection's weights are not bf16); gradients need "
        "num_slots = epn and bf16 weights";
    const std::vector<Row> pools_rows = {
        {"ExpertPools: num_slots = 5 (epn = 4)", ErrorCategory::kInvalidArgument,
         "ExpertPools: num_slots (B) must be -1 (= epn) or in [0, epn=4], got 5",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8}}, 5);
         }},
        {"ExpertPools: num_slots = -2", ErrorCategory::kInvalidArgument,
         "ExpertPools: num_slots (B) must be -1 (= epn) or in [0, epn=4], got -2",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8}}, -2);
         }},
        {"ExpertPools: view_stride = 2 on training pools", ErrorCategory::kInvalidArgument,
         "ExpertPools: view_stride is for serving pools (num_slots < epn=4), got 2",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8}}, -1, 2);
         }},
        {"ExpertPools: view_stride below the smallest that fits", ErrorCategory::kInvalidArgument,
         "ExpertPools: view_stride must be 0 (the smallest that fits, " + q + ") or in [" + q + ", 1048576], got " +
             std::to_string(serving.view_stride() - 1),
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8}}, 2, serving.view_stride() - 1);
         }},
        {"Buffer(config, pools): E/R differs from the pools' epn", ErrorCategory::kInvalidArgument,
         "Buffer: the config has E/R = 8/1 = 8 experts per rank but the pools have experts_per_rank=4",
         [&] {
             Config c = training_config;
             c.num_experts = 8;
             Buffer b(c, serving);
         }},
        {"ExpertPools: projection elem_bytes = 3", ErrorCategory::kInvalidArgument,
         "ExpertPools: projection 0 must have elem_bytes 1 (e4m3), 2 (bf16) or 4 (fp32), got 3",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8, 3}}, 2);
         }},
        {"ExpertPools: projection elem_bytes = 0", ErrorCategory::kInvalidArgument,
         "ExpertPools: projection 1 must have elem_bytes 1 (e4m3), 2 (bf16) or 4 (fp32), got 0",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 8}, {4, 8, 0}});
         }},
        {"ExpertPools: e4m3 expert of 12 bytes", ErrorCategory::kInvalidArgument,
         "ExpertPools: projection 0 of [4][3] has 12 bytes per expert (e4m3), not a multiple of 16; rows * cols must "
         "be a multiple of 16",
         [&] {
             ExpertPools p(world.transport(0), 4, {{4, 3, 1}}, 2);
         }},
        {"ExpertPools: fp32 expert of 8 bytes", ErrorCategory::kInvalidArgument,
         "ExpertPools: projection 0 of [2][1] has 8 bytes per expert (fp32), not a multiple of 16; rows * cols must "
         "be a multiple of 4",
         [&] {
             ExpertPools p(world.transport(0), 4, {{2, 1, 4}});
         }},
        {"prefetch: serving pools, plan of a training Buffer", ErrorCategory::kInvalidArgument,
         "prefetch: plan has num_slots=4 view_stride=4 but the pools have num_slots=2 view_stride=" + q + rebuild,
         [&] { serving.prefetch(training_plan, serving_layer); }},
        {"prefetch: serving pools, plan of a Buffer with view_stride = Q + 1", ErrorCategory::kInvalidArgument,
         "prefetch: plan has num_slots=2 view_stride=" + std::to_string(serving.view_stride() + 1) +
             " but the pools have num_slots=2 view_stride=" + q + rebuild,
         [&] { serving.prefetch(stride_plan, serving_layer); }},
        {"prefetch: training pools, plan of a serving Buffer", ErrorCategory::kInvalidArgument,
         "prefetch: plan has num_slots=2 view_stride=" + q + " but the pools have num_slots=4 view_stride=4" + rebuild,
         [&] { e4m3.prefetch(serving_plan, e4m3_layer); }},
        {"reduce_grad on serving pools", ErrorCategory::kInvalidArgument, "reduce_grad: " + serving_only,
         [&] { serving.reduce_grad(serving_plan, serving_layer); }},
        {"write_grads on serving pools", ErrorCategory::kInvalidArgument, "write_grads: " + serving_only,
         [&] { serving.write_grads(serving_plan, serving_layer, 0, grad.data(), 4); }},
        {"write_grads on pools with an e4m3 projection", ErrorCategory::kInvalidArgument, "write_grads: " + not_bf16,
         [&] { e4m3.write_grads(training_plan, e4m3_layer, 0, grad.data(), 4); }},
        {"reduce_grad on pools with an e4m3 projection", ErrorCategory::kInvalidArgument, "reduce_grad: " + not_bf16,
         [&] { e4m3.reduce_grad(training_plan, e4m3_layer); }},
        {"view_row(e) on training pools", ErrorCategory::kInvalidArgument,
         "view_row: the serving view's rows (num_slots < epn); these pools train (num_slots = epn)",
         [&] { training.view_row(0); }},
        {"view_row(e = E)", ErrorCategory::kInvalidArgument, "view_row: expert must be in [0, E=4), got 4",
         [&] { serving.view_row(4); }},
    };
    EXPECT_EQ(check_rows(pools_rows), "");
    // Every refusal left the serving pools usable: the step's prefetch runs, and the view rows are as documented.
    EXPECT_NO_THROW(serving.prefetch(serving_plan, serving_layer));
    EXPECT_EQ(serving.view_row(3), 3);
    EXPECT_EQ(serving.view_rows(), serving.view_stride() + 2);
    EXPECT_EQ(serving_layer.grads(0), nullptr);
    EXPECT_EQ(serving.reduce_pool(0), nullptr);
    EXPECT_FALSE(e4m3.trains());
    EXPECT_TRUE(training.trains());
}

// check_plan on an owner plan that breaks the owner rule (a planner bug, never bad input: check_plan returns the
// line, tests and flatep-plan report it). R = 2, E = 4, S = 4, K = 1: rank 0 routes 3 entries to expert 0 (home 0).
TEST(BadInput, CheckPlanOwnerRule) {
    Config c = base_config();
    c.num_ranks = 2, c.num_experts = 4;
    const Layout l = make_layout(c, PlannerKind::kOwner);
    planner::HostPlan plan(l);
    plan.view.tpe_all[0 * 4 + 0] = 3;
    planner::plan_counts(l, PlannerKind::kOwner, plan.view);
    ASSERT_EQ(planner::check_plan(l, plan.view), "");
    ASSERT_EQ(plan.view.alloc[0 * 4 + 0], 3);
    plan.view.alloc[0 * 4 + 0] = 0, plan.view.alloc[1 * 4 + 0] = 3;  // expert 0's entries moved off its home rank
    EXPECT_EQ(planner::check_plan(l, plan.view), "owner: alloc[1][0] = 3, expected 0 (home rank 0)");
}

// prefetch's contract (check_prefetch_args, run by ExpertPools::prefetch before either backend): the rows an op of
// several projections adds. A pull of 2 projections of 32-byte experts on 2 ranks, B = 1, is valid; each row breaks
// one field.
TEST(BadInput, PrefetchArgsContract) {
    alignas(16) static uint8_t own[2][2][64], slots[2][32];
    static const int32_t slot_expert[4] = {2, -1, 0, -1};
    auto valid = [] {
        PrefetchArgs a{};
        a.num_ranks = 2, a.experts_per_rank = 2, a.num_slots = 1, a.slot_expert = slot_expert, a.pull = true;
        a.num_projections = 2;
        for (int p = 0; p < 2; ++p) {
            a.projections[p].expert_bytes = 32;
            a.projections[p].slot_pools[0] = slots[p];
            for (int r = 0; r < 2; ++r) a.projections[p].owners[r] = own[p][r];
        }
        return a;
    };
    auto row = [&](const std::string& input, const std::string& message, std::function<void(PrefetchArgs&)> change) {
        return Row{"prefetch Args: " + input, ErrorCategory::kInvalidArgument, message, [valid, change] {
                       PrefetchArgs a = valid();
                       change(a);
                       check_prefetch_args(a);
                   }};
    };
    EXPECT_NO_THROW(check_prefetch_args(valid()));
    const std::string max = std::to_string(kMaxPrefetchProjections);
    const std::vector<Row> rows = {
        row("num_projections = 0", "prefetch: num_projections must be in [1, " + max + "], got 0",
            [](PrefetchArgs& a) { a.num_projections = 0; }),
        row("num_projections = kMaxPrefetchProjections + 1",
            "prefetch: num_projections must be in [1, " + max + "], got " + std::to_string(kMaxPrefetchProjections + 1),
            [](PrefetchArgs& a) { a.num_projections = kMaxPrefetchProjections + 1; }),
        row("the second projection's expert_bytes = 24",
            "prefetch: projection 1: expert_bytes must be a positive multiple of 16, got 24",
            [](PrefetchArgs& a) { a.projections[1].expert_bytes = 24; }),
        row("the second projection's owner weights of rank 1 null (pull)", "prefetch: an owner's weights is null",
            [](PrefetchArgs& a) { a.projections[1].owners[1] = nullptr; }),
        row("the second projection's slot pool null (pull, B = 1)", "prefetch: a slot pool is null",
            [](PrefetchArgs& a) { a.projections[1].slot_pools[0] = nullptr; }),
    };
    EXPECT_EQ(check_rows(rows), "");
}

TEST(BadInput, LaunchersAndTransports) {
    const std::vector<Row> rows = {
        {"run_forked: num_ranks = 0", ErrorCategory::kInvalidArgument,
         "run_forked: num_ranks must be in [1, 64], got 0",
         [] { run_forked(0, [](int, std::shared_ptr<Bootstrap>) { return 0; }); }},
        {"run_forked: empty function", ErrorCategory::kInvalidArgument, "run_forked: fn is empty",
         [] { run_forked(1, {}); }},
        {"make_socket_bootstrap: job_id with a space", ErrorCategory::kInvalidArgument,
         "socket rendezvous: job_id may only hold [A-Za-z0-9._-], got 'a b'",
         [] { make_socket_bootstrap("a b", 0, 1, 1.0); }},
        {"make_socket_bootstrap: rank = num_ranks", ErrorCategory::kInvalidArgument,
         "socket rendezvous: rank 2 outside [0, 2)", [] { make_socket_bootstrap("job", 2, 2, 1.0); }},
        {"make_ipc_transport: bootstrap = nullptr", ErrorCategory::kInvalidArgument, "ipc transport: bootstrap is null",
         [] { make_ipc_transport(nullptr, MemoryKind::kHost, 1.0); }},
    };
    EXPECT_EQ(check_rows(rows), "");
}

// The expert FFN's row kernels (include/flatep/ffn.hpp): every refusal comes before a launch, so the rows run in any
// build (host addresses stand in for device memory; nothing is read).
TEST(BadInput, FfnRows) {
    static uint16_t rows_buf[16];
    static int32_t end_word = 0;
    const int32_t* end = &end_word;
    auto activate = [](int64_t rows, int64_t ffn, FfnActivation act, const int32_t* at, const uint16_t* h, int num_sms,
                       PastEnd past_end = PastEnd::kZero) {
        return [=] { activate_rows(h, rows_buf, rows, ffn, act, at, past_end, Launch{nullptr, num_sms}); };
    };
    const FfnActivation swiglu = FfnActivation::kSwiglu;
    const std::vector<Row> rows = {
        {"activate_rows: rows = -1", ErrorCategory::kInvalidArgument, "activate_rows: rows must be >= 0, got -1",
         activate(-1, 8, swiglu, end, rows_buf, 0)},
        {"activate_rows: ffn = 0", ErrorCategory::kInvalidArgument, "activate_rows: ffn must be >= 1, got 0",
         activate(1, 0, swiglu, end, rows_buf, 0)},
        {"activate_rows: end = nullptr", ErrorCategory::kInvalidArgument,
         "activate_rows: end is null; pass the device address of the last group end (int32)",
         activate(1, 8, swiglu, nullptr, rows_buf, 0)},
        {"activate_rows: activation = 7", ErrorCategory::kInvalidArgument,
         "activate_rows: activation must be FfnActivation::kSwiglu (0) or kSilu (1), got 7",
         activate(1, 8, static_cast<FfnActivation>(7), end, rows_buf, 0)},
        {"activate_rows: past_end = 2", ErrorCategory::kInvalidArgument,
         "activate_rows: past_end must be PastEnd::kZero (0) or kUntouched (1), got 2",
         activate(1, 8, swiglu, end, rows_buf, 0, static_cast<PastEnd>(2))},
        {"activate_rows: h = nullptr with rows = 1", ErrorCategory::kInvalidArgument,
         "activate_rows: h and a must be set when rows > 0", activate(1, 8, swiglu, end, nullptr, 0)},
        {"activate_rows: num_sms = -2", ErrorCategory::kInvalidArgument,
         "activate_rows: num_sms (the most thread blocks one launch uses, 0 = no cap) must be in [0, 1048576], got -2",
         activate(1, 8, swiglu, end, rows_buf, -2)},
        {"zero_rows_from_end: cols = 0", ErrorCategory::kInvalidArgument,
         "zero_rows_from_end: cols must be >= 1, got 0", [end] { zero_rows_from_end(rows_buf, 1, 0, end); }},
        {"zero_rows_from_end: y = nullptr with rows = 2", ErrorCategory::kInvalidArgument,
         "zero_rows_from_end: y must be set when rows > 0", [end] { zero_rows_from_end(nullptr, 2, 8, end); }},
    };
    EXPECT_EQ(check_rows(rows), "");
}

// Every timeout is a finite number of seconds in (0, 86400]; 0 (the default argument) means FLATEP_TIMEOUT_S. NaN
// used to switch the timeout off, a negative value to mean the default, infinity to wait forever.
TEST(BadInput, Timeouts) {
    constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const std::string range = " must be a finite number of seconds in (0, 86400], got ";
    auto ipc = [](double t) {
        return [t] { make_ipc_transport(std::make_shared<SoloBootstrap>(), MemoryKind::kHost, t); };
    };
    auto fork_with = [](ForkOptions options) {
        return [options] {
            run_forked(
                1, [](int, std::shared_ptr<Bootstrap>) { return 0; }, options);
        };
    };
    const std::vector<Row> rows = {
        env_timeout_row("inf"),
        env_timeout_row("nan"),
        env_timeout_row("0"),
        env_timeout_row("-5"),
        env_timeout_row("86401"),
        env_timeout_row("3s"),
        {"make_ipc_transport: timeout_s = NaN", ErrorCategory::kInvalidArgument,
         "ipc transport: timeout_s" + range + "nan", ipc(kNan)},
        {"make_ipc_transport: timeout_s = -1", ErrorCategory::kInvalidArgument,
         "ipc transport: timeout_s" + range + "-1", ipc(-1)},
        {"make_ipc_transport: timeout_s = inf", ErrorCategory::kInvalidArgument,
         "ipc transport: timeout_s" + range + "inf", ipc(kInf)},
        {"make_ipc_transport: timeout_s = 2 days", ErrorCategory::kInvalidArgument,
         "ipc transport: timeout_s" + range + "172800", ipc(172800)},
        {"make_socket_bootstrap: timeout_s = NaN", ErrorCategory::kInvalidArgument,
         "socket rendezvous: timeout_s" + range + "nan", [kNan] { make_socket_bootstrap("job", 0, 1, kNan); }},
        {"make_socket_bootstrap: timeout_s = -1", ErrorCategory::kInvalidArgument,
         "socket rendezvous: timeout_s" + range + "-1", [] { make_socket_bootstrap("job", 0, 1, -1); }},
        {"LocalHostWorld: timeout_s = NaN", ErrorCategory::kInvalidArgument,
         "LocalHostWorld: timeout_s" + range + "nan", [kNan] { LocalHostWorld world(1, kNan); }},
        {"LocalHostWorld: timeout_s = -0.5", ErrorCategory::kInvalidArgument,
         "LocalHostWorld: timeout_s" + range + "-0.5", [] { LocalHostWorld world(1, -0.5); }},
        {"run_forked: timeout_s = NaN", ErrorCategory::kInvalidArgument, "run_forked: timeout_s" + range + "nan",
         fork_with(ForkOptions{kNan, 0})},
        {"run_forked: deadline_s = inf", ErrorCategory::kInvalidArgument, "run_forked: deadline_s" + range + "inf",
         fork_with(ForkOptions{1.0, kInf})},
        {"Transport::set_timeout_s(NaN)", ErrorCategory::kInvalidArgument, "Transport: timeout_s" + range + "nan",
         [kNan] { LocalHostWorld(1, 1.0).transport(0)->set_timeout_s(kNan); }},
        {"Transport::set_timeout_s(0)", ErrorCategory::kInvalidArgument, "Transport: timeout_s" + range + "0",
         [] { LocalHostWorld(1, 1.0).transport(0)->set_timeout_s(0); }},
        // Values just past a bound print as given, not rounded onto it.
        {"Transport::set_timeout_s(86400.000001)", ErrorCategory::kInvalidArgument,
         "Transport: timeout_s" + range + "86400.000001",
         [] { LocalHostWorld(1, 1.0).transport(0)->set_timeout_s(86400.000001); }},
        {"make_ipc_transport: timeout_s = 86400.5", ErrorCategory::kInvalidArgument,
         "ipc transport: timeout_s" + range + "86400.5", ipc(86400.5)},
    };
    EXPECT_EQ(check_rows(rows), "");

    // The bounds themselves are valid, and 0 still means FLATEP_TIMEOUT_S.
    ScopedEnv env("FLATEP_TIMEOUT_S", "7.5");
    EXPECT_EQ(env::timeout_seconds(), 7.5);
    EXPECT_EQ(LocalHostWorld(1, 0).transport(0)->timeout_s(), 7.5);
    EXPECT_EQ(LocalHostWorld(1, env::kMaxTimeoutSeconds).transport(0)->timeout_s(), 86400.0);
    EXPECT_EQ(make_ipc_transport(std::make_shared<SoloBootstrap>(), MemoryKind::kHost, 0)->timeout_s(), 7.5);
    EXPECT_EQ(make_ipc_transport(std::make_shared<SoloBootstrap>(), MemoryKind::kHost, 1e-3)->timeout_s(), 1e-3);
}

}  // namespace
}  // namespace flatep
