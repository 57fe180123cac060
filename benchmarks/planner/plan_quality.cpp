// flatep-plan-quality: the host half of the planner-quality benchmark (driven by benchmarks/planner/plan_quality.py),
// and the host check of every shape a GPU benchmark sweeps (issue 22). For every case of the sweep
// (benchmarks/common/flags.hpp:
// --preset and the shape lists, --maxvio targets) and several seeds it generates the count matrices with the routing
// generator, writes each one as a flatep-plan / plan_optimum.py request (JSON) when asked, and plans it with the
// greedy and the balanced planner for every capacity factor, writing one CSV row per (case, seed, capacity factor,
// planner) with P, replicas, entries moved, local fraction, the median host planner time, whether the plan is valid
// (check_plan: exact balance, slots, conservation) and, for the balanced planner, whether it is no worse than the
// greedy on P and on total replicas. Exit status 1 when any plan is invalid or worse than the greedy (after the CSV).
//
//   flatep-plan-quality [--preset moonep] [--ranks 8] [--experts 384] [--tokens 8192] [--topk 8] [--align 128]
//                       [--maxvio 0.2,1,10,20] [--seeds 3] [--factors 1,1.05,1.1,1.25] [--iters 11] [--dump DIR]
//                       [--csv plan_quality_host.csv]
//   flatep-plan-quality --preset moonep-sweep --seeds 1 --factors 1 --iters 1 --bisection-ranks 8
//                                                       # every shape of MoonEP's sweep (sigmas as ops_bench's)
//
// Request files are named DIR/R{R}_E{E}_S{S}_K{K}_mv{maxvio}_s{seed}_f{factor}.json (_sg{sigma} for --sigma).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "common/csv.hpp"
#include "common/flags.hpp"
#include "common/routing_cases.hpp"
#include "common/timing.hpp"
#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "internal/api.hpp"

namespace {

struct Options {
    std::vector<flatep::bench::Case> cases;
    std::vector<double> factors{1.0, 1.05, 1.1, 1.25};
    int seeds = 3;
    int iters = 11, warmup = 0;
    int bisection_ranks = 0;
    uint64_t sigma_seed = 1;
    std::string sigma_cache;
    std::string dump;
    std::string csv = "plan_quality_host.csv";
};

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "flatep-plan-quality: error: %s\n", message.c_str());
    std::exit(1);
}

Options parse(int argc, char** argv) {
    Options o;
    flatep::bench::Flags flags("flatep-plan-quality",
                               "Greedy and balanced host plans of generated routings: quality, validity, CSV");
    flags.add_sweep({"moonep"});
    flags.add("--seeds", &o.seeds, "routings per target maxvio (seeds 1..n)", 1);
    flags.add("--factors", &o.factors, "capacity factors to plan every matrix with");
    flags.add_timing(&o.iters, &o.warmup);
    flags.add("--dump", &o.dump, "write every count matrix as a request file into this folder");
    flags.add("--bisection-ranks", &o.bisection_ranks, "find each target's sigma on min(R, this) ranks (0: R)", 0);
    flags.add("--sigma-seed", &o.sigma_seed, "routing seed of each target's sigma bisection (ops_bench: 42)");
    flags.add("--sigma-cache", &o.sigma_cache, "CSV of sigmas found before: read, and appended to");
    flags.add_csv(&o.csv);
    flags.parse(argc, argv);
    o.cases = flags.cases();
    for (const flatep::bench::Case& c : o.cases) {
        flags.validated(c.shape);
    }
    if (o.factors.empty()) flags.fail("--factors needs at least one value");
    for (double f : o.factors)
        if (!(f >= 1.0 && f <= 4.0)) flags.fail("--factors: capacity factors lie in [1, 4], got " + std::to_string(f));
    return o;
}

std::string fmt(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

void write_request(const std::string& path, const flatep::Config& c, const std::vector<int32_t>& counts) {
    std::ofstream out(path);
    if (!out) usage_error("cannot write " + path);
    out << "{\"R\":" << c.num_ranks << ",\"E\":" << c.num_experts << ",\"S\":" << c.num_tokens << ",\"K\":" << c.topk
        << ",\"align\":" << c.align << ",\"capacity_factor\":" << fmt(c.capacity_factor) << ",\"tpe\":[";
    for (int s = 0; s < c.num_ranks; ++s) {
        out << (s ? ",[" : "[");
        for (int e = 0; e < c.num_experts; ++e) out << (e ? "," : "") << counts[size_t(s) * c.num_experts + e];
        out << "]";
    }
    out << "]}\n";
}

}  // namespace

int main(int argc, char** argv) {
    bool all_ok = true;
    try {
        const Options o = parse(argc, argv);
        flatep::bench::CsvWriter csv(
            o.csv, {"preset", "R", "E", "S", "K", "capacity_factor", "maxvio_target", "maxvio_real", "seed", "request",
                    "planner", "makespan", "total_replicas", "entries_moved", "entries_total", "local_fraction",
                    "host_time_us", "valid", "not_worse_than_greedy"});
        flatep::bench::SigmaTable sigmas(o.bisection_ranks, o.sigma_cache);
        sigmas.prepare(o.cases, {o.sigma_seed});
        for (const flatep::bench::Case& cs : o.cases) {
            const flatep::Config base = cs.shape.config();
            const int R = base.num_ranks, E = base.num_experts, S = base.num_tokens, K = base.topk;
            const double target = cs.skew.maxvio_target();  // -1: the routing's sigma was given
            const std::string skew_name = (cs.skew.is_sigma ? "_sg" : "_mv") + fmt(cs.skew.value);
            const double sigma = sigmas.sigma(cs, o.sigma_seed);
            for (int si = 0; si < o.seeds; ++si) {
                const uint64_t seed = uint64_t(si) + 1;
                const std::vector<int32_t> counts = flatep::bench::generate_counts_parallel(R, E, S, K, sigma, seed);
                const double real = flatep::routing::maxvio(counts.data(), R, E);
                for (double factor : o.factors) {
                    flatep::Config c = base;
                    c.capacity_factor = factor;
                    const flatep::Layout l = flatep::make_layout(c);
                    std::string request;
                    if (!o.dump.empty()) {
                        request = o.dump + "/R" + std::to_string(R) + "_E" + std::to_string(E) + "_S" +
                                  std::to_string(S) + "_K" + std::to_string(K) + skew_name + "_s" +
                                  std::to_string(seed) + "_f" + fmt(factor) + ".json";
                        write_request(request, c, counts);
                    }
                    int greedy_p = 0, greedy_replicas = 0;
                    for (flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
                        flatep::planner::HostPlan plan(l);
                        std::copy(counts.begin(), counts.end(), plan.view.tpe_all);
                        const flatep::bench::Timing t = flatep::bench::time_host(
                            o.iters, o.warmup, [&] { flatep::planner::plan_counts(l, kind, plan.view); });
                        const std::string bad = flatep::planner::check_plan(l, plan.view);
                        const flatep::PlanStats& st = *plan.view.stats;
                        const bool greedy = kind == flatep::PlannerKind::kGreedy;
                        if (greedy) greedy_p = st.makespan, greedy_replicas = st.total_replicas;
                        const bool not_worse =
                            greedy || (st.makespan <= greedy_p && st.total_replicas <= greedy_replicas);
                        const std::string where = cs.shape.label() + " " + skew_name.substr(1) + " seed " +
                                                  std::to_string(seed) + " factor " + fmt(factor);
                        if (!bad.empty()) {
                            std::fprintf(stderr, "flatep-plan-quality: FAIL: invalid %s plan (%s): %s\n",
                                         flatep::planner_name(kind), where.c_str(), bad.c_str());
                            all_ok = false;
                        }
                        if (!not_worse) {
                            std::fprintf(stderr,
                                         "flatep-plan-quality: FAIL: balanced plan worse than the greedy (%s): P %d "
                                         "vs %d, replicas %d vs %d\n",
                                         where.c_str(), st.makespan, greedy_p, st.total_replicas, greedy_replicas);
                            all_ok = false;
                        }
                        const double local =
                            st.entries_total ? double(st.entries_on_source) / double(st.entries_total) : 1.0;
                        csv.row(cs.preset, R, E, S, K, fmt(factor), fmt(target), real, seed, request,
                                std::string(flatep::planner_name(kind)), st.makespan, st.total_replicas,
                                st.entries_moved, st.entries_total, local, t.median_us, int(bad.empty()),
                                int(not_worse));
                    }
                }
            }
        }
        std::printf("flatep-plan-quality: %zu cases, %s; CSV %s\n", o.cases.size(),
                    all_ok ? "every plan valid and the balanced one never worse than the greedy" : "FAILED (see above)",
                    o.csv.c_str());
    } catch (const flatep::Error& e) {
        usage_error(e.message());
    }
    return all_ok ? 0 : 1;
}
