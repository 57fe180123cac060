// Golden plans that reach the balanced planner's branches (design §4): for every candidate kind an input whose kept
// plan comes from that kind (path, transport, pack, tree; greedy when none is kept), and for the branches a one-line
// slip would change, an input where it does: the tree's relay and overshoot, the receivers' fit and budget rules,
// the path order, the covering expert, the ties of the selection and of the slack targets. Each case pins, bit for
// bit, the greedy allocation, the balanced plan (alloc, keep, spill_start, take_start, group_row, slot_expert,
// cu_seqlens, statistics), the candidate the selection keeps, and the allocation of the candidates listed in
// "pinned_candidates" (where the branch shows, when it does not show in the kept plan).
//
// The inputs were found by search: random count matrices (R <= 5, epn <= 3, S <= 11), each kept when it reached a
// candidate kind or a planted one-line bug changed a candidate there (the smallest such matrix per branch). The
// expected values are the planner's own at the commit that recorded them, reviewed where they were recorded: a
// change of planner behaviour shows as a diff of golden_plans.json. Re-record (then review the diff) with
//   FLATEP_RECORD_GOLDENS=tests/unit/planner/golden_plans.json build/tests/flatep_planner_tests \
//       --gtest_filter='PlannerBranchGoldens.*'
// Coverage of the planner under these tests: scripts/coverage.sh.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "planner/planner_core.hpp"
#include "planner_test_util.hpp"

namespace flatep {
namespace {

namespace pc = planner;
using nlohmann::json;
using test::copy_of;
using test::make_test_layout;
using test::plan_of;

std::filesystem::path goldens_path() { return std::filesystem::path(__FILE__).parent_path() / "golden_plans.json"; }

// "path v1", "transport v3 (budget 2)", ... for candidate index i; "greedy" for -1.
std::string candidate_name(int i) {
    if (i < 0) return "greedy";
    if (i < pc::kNumPathVariants) return "path v" + std::to_string(i);
    const int budget = (i - pc::kNumPathVariants) / pc::kVariantsPerBudget + 1;
    int v = (i - pc::kNumPathVariants) % pc::kVariantsPerBudget;
    std::string kind = "transport";
    if (v >= pc::kNumTransportVariants + pc::kNumPackVariants) {
        kind = "tree", v -= pc::kNumTransportVariants + pc::kNumPackVariants;
    } else if (v >= pc::kNumTransportVariants) {
        kind = "pack", v -= pc::kNumTransportVariants;
    }
    return kind + " v" + std::to_string(v) + " (budget " + std::to_string(budget) + ")";
}

// Candidate i built alone (fresh workspace, poisoned), as the GPU planner builds it: its allocation, or empty when
// it yields no plan.
std::vector<int32_t> candidate_alloc(const Layout& l, const std::vector<int32_t>& tpe, int i) {
    std::vector<int32_t> ws(pc::planner_workspace_words(l), -7), cand(tpe.size(), -7);
    const pc::Workspace w = pc::make_workspace(l, ws.data());
    if (!pc::build_candidate(l, tpe.data(), cand.data(), w, i)) return {};
    return cand;
}

// The index select_candidate keeps (-1: the greedy stays), every candidate built independently.
int kept_candidate(const Layout& l, const std::vector<int32_t>& tpe) {
    std::vector<int32_t> ws(pc::planner_workspace_words(l)), greedy(tpe.size());
    const pc::Workspace w = pc::make_workspace(l, ws.data());
    pc::greedy_alloc(l, tpe.data(), greedy.data(), w);
    const pc::PlanQuality gq = pc::evaluate_alloc(l, tpe.data(), greedy.data(), w.num_in, w.num_out);
    const int count = pc::num_candidates(gq.makespan);
    std::vector<pc::PlanQuality> quality(count);
    for (int i = 0; i < count; ++i) {
        const std::vector<int32_t> cand = candidate_alloc(l, tpe, i);
        quality[i] = cand.empty() ? pc::PlanQuality{pc::kNoCandidate, 0, 0}
                                  : pc::evaluate_alloc(l, tpe.data(), cand.data(), w.num_in, w.num_out);
    }
    return pc::select_candidate(gq, quality.data(), count);
}

// Everything a case pins, computed from its inputs.
json observe(const json& c) {
    const int R = c.at("R"), E = c.at("E");
    const Layout l = make_test_layout(R, E, c.at("S"), c.at("K"), c.at("align"), c.at("capacity_factor"));
    std::vector<int32_t> tpe;
    for (const json& row : c.at("tpe")) {
        for (const json& v : row) tpe.push_back(v.get<int32_t>());
    }
    EXPECT_EQ(tpe.size(), size_t(R) * E) << c.at("name");
    json out;
    auto greedy = plan_of(l, tpe, PlannerKind::kGreedy);
    auto balanced = plan_of(l, tpe, PlannerKind::kBalanced);
    EXPECT_EQ(planner::check_plan(l, greedy->view), "") << c.at("name");
    EXPECT_EQ(planner::check_plan(l, balanced->view), "") << c.at("name");
    const PlanView& p = balanced->view;
    const int64_t re = int64_t(R) * E;
    out["greedy_alloc"] = copy_of(greedy->view.alloc, re);
    const int kept = kept_candidate(l, tpe);
    out["kept"] = kept;
    out["kept_kind"] = candidate_name(kept);
    out["alloc"] = copy_of(p.alloc, re);
    out["keep"] = copy_of(p.keep, re);
    out["spill_start"] = copy_of(p.spill_start, re);
    out["take_start"] = copy_of(p.take_start, re);
    out["group_row"] = copy_of(p.group_row, re);
    out["slot_expert"] = copy_of(p.slot_expert, int64_t(R) * l.experts_per_rank);
    out["cu_seqlens"] = copy_of(p.cu_seqlens, int64_t(R) * l.num_groups());
    out["stats"] = {{"makespan", p.stats->makespan},
                    {"total_replicas", p.stats->total_replicas},
                    {"entries_moved", p.stats->entries_moved},
                    {"max_load_after", p.stats->max_load_after},
                    {"min_load_after", p.stats->min_load_after}};
    json pinned = json::object();
    for (const json& i : c.at("pinned_candidates")) {
        const std::vector<int32_t> cand = candidate_alloc(l, tpe, i.get<int>());
        pinned[std::to_string(i.get<int>()) + " " + candidate_name(i.get<int>())] =
            cand.empty() ? json(nullptr) : json(cand);
    }
    out["candidates"] = pinned;
    return out;
}

// One case as JSON text, every array on one line (the file stays reviewable as a diff).
std::string case_text(const json& c) {
    std::ostringstream os;
    const char* inputs[] = {"name", "why", "R", "E", "S", "K", "align", "capacity_factor", "tpe", "pinned_candidates"};
    os << "  {\n";
    for (const char* key : inputs) os << "    \"" << key << "\": " << c.at(key).dump() << ",\n";
    const json& expect = c.at("expect");
    os << "    \"expect\": {\n";
    bool first = true;
    for (const auto& [key, value] : expect.items()) {
        os << (first ? "" : ",\n") << "      \"" << key << "\": ";
        if (key == "candidates") {
            os << "{";
            bool first_cand = true;
            for (const auto& [name, alloc] : value.items()) {
                os << (first_cand ? "\n" : ",\n") << "        \"" << name << "\": " << alloc.dump();
                first_cand = false;
            }
            os << (first_cand ? "}" : "\n      }");
        } else {
            os << value.dump();
        }
        first = false;
    }
    os << "\n    }\n  }";
    return os.str();
}

TEST(PlannerBranchGoldens, EveryCaseAsRecorded) {
    std::ifstream in(goldens_path());
    ASSERT_TRUE(in) << "cannot read " << goldens_path();
    json cases = json::parse(in);
    ASSERT_GE(cases.size(), 20u);
    if (const char* record = std::getenv("FLATEP_RECORD_GOLDENS")) {
        std::ofstream out(record);
        out << "[\n";
        for (size_t i = 0; i < cases.size(); ++i) {
            cases[i]["expect"] = observe(cases[i]);
            out << case_text(cases[i]) << (i + 1 < cases.size() ? ",\n" : "\n");
        }
        out << "]\n";
        GTEST_SKIP() << "recorded " << cases.size() << " cases into " << record;
    }
    std::vector<std::string> kinds;
    for (const json& c : cases) {
        SCOPED_TRACE(c.at("name").get<std::string>() + ": " + c.at("why").dump() +
                     "; after an intended planner change, re-record (test header)");
        const json got = observe(c);
        const json& want = c.at("expect");
        for (const auto& [key, value] : want.items()) {
            if (key == "candidates") {
                for (const auto& [name, alloc] : value.items()) {
                    EXPECT_EQ(got.at(key).at(name), alloc) << "candidate " << name;
                }
            } else {
                EXPECT_EQ(got.at(key), value) << key;
            }
        }
        EXPECT_EQ(got.size(), want.size());
        const std::string kind = got.at("kept_kind").get<std::string>();
        kinds.push_back(kind.substr(0, kind.find(' ')));
    }
    // Every kind of plan the balanced planner can keep is among the cases.
    for (const char* kind : {"greedy", "path", "transport", "pack", "tree"}) {
        EXPECT_NE(std::find(kinds.begin(), kinds.end(), kind), kinds.end()) << "no case keeps a " << kind << " plan";
    }
}

TEST(PlannerBranchGoldens, CandidateNames) {
    EXPECT_EQ(candidate_name(-1), "greedy");
    EXPECT_EQ(candidate_name(3), "path v3");
    EXPECT_EQ(candidate_name(4), "transport v0 (budget 1)");
    EXPECT_EQ(candidate_name(4 + 6), "pack v0 (budget 1)");
    EXPECT_EQ(candidate_name(4 + 10), "tree v0 (budget 1)");
    EXPECT_EQ(candidate_name(4 + 18 + 17), "tree v7 (budget 2)");
}

}  // namespace
}  // namespace flatep
