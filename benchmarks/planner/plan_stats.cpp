// flatep-plan-stats: quality and host time of the planners (one-donor greedy vs the default balanced planner) on
// generated routings over a maxvio sweep. Prints a table and writes CSV.
//
//   flatep-plan-stats [--ranks 8] [--experts 384] [--tokens 8192] [--topk 8] [--align 128] [--capacity-factor 1.0]
//                     [--maxvio 0.2,1,10,20] [--seeds 3] [--iters 21] [--csv plan_stats.csv]
//
// (benchmarks/common/flags.hpp: the flag set every driver shares.) sigma for each target maxvio is found once
// (routing::sigma_for_maxvio with seed 1) and every seed then draws its own routing with that sigma; the realised
// maxvio of each draw is reported next to the target. --iters: host planner runs per plan, median reported.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "common/flags.hpp"
#include "common/timing.hpp"
#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "internal/api.hpp"

namespace {

struct Options {
    flatep::Config config;
    std::vector<double> maxvio{0.2, 1.0, 10.0, 20.0};
    int seeds = 3;
    int iters = 21, warmup = 0;
    std::string csv = "plan_stats.csv";
};

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "flatep-plan-stats: error: %s\n", message.c_str());
    std::exit(1);
}

Options parse(int argc, char** argv) {
    Options o;
    flatep::bench::Shape shape;
    shape.hidden = 8;  // the planner does not read H
    flatep::bench::Flags flags("flatep-plan-stats", "Quality and host time of the greedy and balanced planners");
    flags.add_shape(&shape);
    flags.add("--maxvio", &o.maxvio, "target maxvios of the routing (sigma by bisection)");
    flags.add("--seeds", &o.seeds, "routings per target", 1);
    flags.add_timing(&o.iters, &o.warmup);
    flags.add_csv(&o.csv);
    flags.parse(argc, argv);
    if (o.maxvio.empty()) flags.fail("--maxvio needs at least one value");
    o.config = flags.validated(shape);
    return o;
}

struct Row {
    std::string planner;
    double maxvio_target, maxvio_real;
    uint64_t seed;
    double max_load_before;  // multiple of S*K
    int makespan, total_replicas, max_in, max_out;
    int64_t entries_moved, entries_total;
    double local_fraction;
    double time_us;
};

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options o = parse(argc, argv);
        const flatep::Layout l = flatep::make_layout(o.config);
        const int R = l.num_ranks, E = l.num_experts;
        const double sk = double(l.num_entries());
        std::vector<Row> rows;
        for (double target : o.maxvio) {
            const double sigma = flatep::routing::sigma_for_maxvio(target, R, E, l.num_tokens, l.topk, 1);
            for (int si = 0; si < o.seeds; ++si) {
                const uint64_t seed = uint64_t(si) + 1;
                const std::vector<int32_t> counts =
                    flatep::routing::generate_counts(R, E, l.num_tokens, l.topk, sigma, seed);
                const double real = flatep::routing::maxvio(counts.data(), R, E);
                for (flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
                    flatep::planner::HostPlan plan(l);
                    std::copy(counts.begin(), counts.end(), plan.view.tpe_all);
                    const flatep::bench::Timing t = flatep::bench::time_host(
                        o.iters, o.warmup, [&] { flatep::planner::plan_counts(l, kind, plan.view); });
                    const std::string bad = flatep::planner::check_plan(l, plan.view);
                    if (!bad.empty()) {
                        std::fprintf(stderr, "flatep-plan-stats: error: invalid %s plan (maxvio %g seed %llu): %s\n",
                                     flatep::planner_name(kind), target, (unsigned long long)seed, bad.c_str());
                        return 1;
                    }
                    const flatep::PlanStats& st = *plan.view.stats;
                    rows.push_back(Row{
                        flatep::planner_name(kind), target, real, seed, st.max_load_before / sk, st.makespan,
                        st.total_replicas, st.max_replicas_in, st.max_replicas_out, st.entries_moved, st.entries_total,
                        st.entries_total ? double(st.entries_on_source) / double(st.entries_total) : 1, t.median_us});
                }
            }
        }
        std::printf("planner statistics: R=%d E=%d S=%d K=%d align=%d capacity_factor=%g (C=%d), %d seeds per maxvio\n",
                    R, E, l.num_tokens, l.topk, l.align, o.config.capacity_factor, l.capacity, o.seeds);
        std::printf("%-9s %6s %6s %4s %9s %3s %8s %6s %7s %11s %7s %9s\n", "planner", "maxvio", "real", "seed",
                    "maxload", "P", "replicas", "in/out", "", "moved", "local", "time_us");
        for (const Row& r : rows)
            std::printf("%-9s %6.1f %6.2f %4llu %8.3fx %3d %8d %3d/%-3d %7s %11lld %7.4f %9.1f\n", r.planner.c_str(),
                        r.maxvio_target, r.maxvio_real, (unsigned long long)r.seed, r.max_load_before, r.makespan,
                        r.total_replicas, r.max_in, r.max_out, "", (long long)r.entries_moved, r.local_fraction,
                        r.time_us);
        // Per-maxvio summary: balanced vs greedy (means over seeds).
        std::printf("\nsummary (mean over seeds): P and replicas, balanced vs greedy\n");
        std::printf("%6s %9s %9s %12s %12s %14s %14s\n", "maxvio", "P_greedy", "P_flatep", "rep_greedy", "rep_flatep",
                    "moved_greedy", "moved_flatep");
        for (double target : o.maxvio) {
            double pg = 0, pb = 0, rg = 0, rb = 0, mg = 0, mb = 0;
            int n = 0;
            for (const Row& r : rows) {
                if (r.maxvio_target != target) continue;
                const bool g = r.planner == "greedy";
                (g ? pg : pb) += r.makespan;
                (g ? rg : rb) += r.total_replicas;
                (g ? mg : mb) += double(r.entries_moved);
                n += g;
            }
            std::printf("%6.1f %9.2f %9.2f %12.2f %12.2f %14.0f %14.0f\n", target, pg / n, pb / n, rg / n, rb / n,
                        mg / n, mb / n);
        }
        std::ofstream csv(o.csv);
        if (!csv) usage_error("cannot write " + o.csv);
        csv << "planner,R,E,S,K,capacity_factor,maxvio_target,maxvio_real,seed,max_load_before_x,makespan,"
               "total_replicas,max_replicas_in,max_replicas_out,entries_moved,entries_total,local_fraction,"
               "host_time_us\n";
        for (const Row& r : rows)
            csv << r.planner << ',' << R << ',' << E << ',' << l.num_tokens << ',' << l.topk << ','
                << o.config.capacity_factor << ',' << r.maxvio_target << ',' << r.maxvio_real << ',' << r.seed << ','
                << r.max_load_before << ',' << r.makespan << ',' << r.total_replicas << ',' << r.max_in << ','
                << r.max_out << ',' << r.entries_moved << ',' << r.entries_total << ',' << r.local_fraction << ','
                << r.time_us << '\n';
        std::printf("\nwrote %s\n", o.csv.c_str());
    } catch (const flatep::Error& e) {
        std::fprintf(stderr, "flatep-plan-stats: error: %s\n", e.message().c_str());
        return 1;
    }
    return 0;
}
