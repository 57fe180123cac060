"""flatep.optim.MainGradOptimizer: a torch optimizer over fp32 master weights for parameters whose gradient lives in
``main_grad`` (flatep.nn.MoE's expert weights), the way Megatron's mixed-precision optimizer works.

flatep.nn.MoE's expert parameters are bf16 tensors over the library's memory (what the grouped GEMM reads) and their
fp32 gradients accumulate in ``param.main_grad`` (the pools' gradient view); ``.grad`` stays None. This wrapper keeps
an fp32 master copy of each such parameter, points the master's ``.grad`` at ``main_grad`` (the same memory: no copy),
runs the wrapped optimizer on the masters and writes each master back into its bf16 parameter (round to nearest
even): one copy per optimizer step, none per forward or backward. Parameters without ``main_grad`` (the router, norms)
are handed to the wrapped optimizer as they are.

    opt = flatep.optim.MainGradOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3)
    for batch in data:
        opt.zero_grad()              # also zeroes every main_grad (backward adds into it)
        loss(model(batch)).backward()
        opt.step()
"""

import torch


class MainGradOptimizer:
    """Args:
    optimizer_class: a torch.optim.Optimizer class (e.g. torch.optim.Adam).
    params: iterable of parameters (a model's parameters()); those with a ``main_grad`` attribute get fp32 masters.
    **kwargs: passed to optimizer_class.
    """

    def __init__(self, optimizer_class, params, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self._pairs = []  # (bf16 parameter, fp32 master)
        handed = []
        for p in self.params:
            if hasattr(p, "main_grad"):
                if p.main_grad.dtype != torch.float32 or p.main_grad.shape != p.shape:
                    raise ValueError(
                        f"MainGradOptimizer: main_grad must be fp32 of the parameter's shape {list(p.shape)}, got "
                        f"{str(p.main_grad.dtype)[6:]} {list(p.main_grad.shape)}"
                    )
                master = torch.nn.Parameter(p.detach().float())
                self._pairs.append((p, master))
                handed.append(master)
            else:
                handed.append(p)
        self.optimizer = optimizer_class(handed, **kwargs)

    @property
    def masters(self):
        """The fp32 master copies, in the order of the parameters that have main_grad."""
        return [m for _, m in self._pairs]

    @torch.no_grad()
    def step(self):
        for p, master in self._pairs:
            master.grad = p.main_grad  # the same memory: the accumulated fp32 gradient
        self.optimizer.step()
        for p, master in self._pairs:
            p.copy_(master)  # into the library's memory, in place

    @torch.no_grad()
    def zero_grad(self, set_to_none=True):
        for p, master in self._pairs:
            p.main_grad.zero_()
            master.grad = None
        for p in self.params:
            if not hasattr(p, "main_grad"):
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state):
        masters = state["masters"]
        if len(masters) != len(self._pairs):
            raise ValueError(f"MainGradOptimizer: state has {len(masters)} masters, this optimizer {len(self._pairs)}")
        for (p, master), saved in zip(self._pairs, masters):
            master.copy_(saved)
            p.copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])
