"""A step of R virtual ranks on one GPU, eager and captured in CUDA graphs, for the graph tests (test_gpu_graphs.py,
test_gpu_static.py): every rank's static inputs (topk_idx [S, K] int64, x [S, H] bf16, topk_weights [S, K] fp32),
written per trial, its own stream, and step(buffer, idx, x, w) -> a tuple of tensors run eagerly or captured once per
rank with torch.cuda.graph (capture_error_mode "global": any cudaMalloc, synchronising copy or device synchronisation
an op made would fail the capture) and replayed."""

import torch


class GraphedRanks:
    def __init__(self, bufs, device, S, H, E, K, step):
        self.bufs, self.E, self.S, self.K, self.step = bufs, E, S, K, step
        R = len(bufs)
        self.streams = [torch.cuda.Stream(device) for _ in range(R)]
        self.idx = [torch.zeros(S, K, dtype=torch.int64, device=device) for _ in range(R)]
        self.x = [torch.zeros(S, H, dtype=torch.bfloat16, device=device) for _ in range(R)]
        self.w = [torch.zeros(S, K, device=device) for _ in range(R)]
        self.graphs, self.static = [], []

    def write_inputs(self, trial):
        """Trial `trial`'s routing (skew growing with the trial) and data into the static inputs."""
        from flatep import testing

        for r in range(len(self.bufs)):
            self.idx[r].copy_(testing.sample_topk(self.E, self.S, self.K, r, sigma=0.5 + 0.4 * trial,
                                                  seed=trial).long())
            g = torch.Generator().manual_seed(100 * trial + r)
            self.x[r].copy_(torch.randn(self.S, self.x[r].shape[1], generator=g).to(torch.bfloat16))
            self.w[r].copy_(torch.rand(self.S, self.K, generator=g))
        torch.cuda.synchronize()

    def _run(self, r):
        return self.step(self.bufs[r], self.idx[r], self.x[r], self.w[r])

    @staticmethod
    def _copies(results):
        return [tuple(t.clone() for t in result) for result in results]

    def eager(self):
        """Every rank's step on its stream now; copies of its results."""
        outs = []
        for r in range(len(self.bufs)):
            with torch.cuda.stream(self.streams[r]), torch.no_grad():
                outs.append(self._run(r))
        torch.cuda.synchronize()
        return self._copies(outs)

    def capture(self):
        """Every rank's step captured as a graph of its own (run eager() once before: kernel attributes, pools)."""
        for r in range(len(self.bufs)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.streams[r], capture_error_mode="global"), torch.no_grad():
                self.static.append(self._run(r))
            self.graphs.append(graph)
        torch.cuda.synchronize()

    def replay(self):
        """Every rank's graph replayed on its stream; copies of the captured results."""
        for r, graph in enumerate(self.graphs):
            with torch.cuda.stream(self.streams[r]):
                graph.replay()
        torch.cuda.synchronize()
        return self._copies(self.static)
