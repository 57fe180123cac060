"""Autograd functions of dispatch and combine (design §3).

Forward                                   Backward (with the plan saved by the forward)
dispatch(plan, x, w) -> recv_x, recv_w    grad_x = combine(plan, grad_recv_x)            (unweighted: sums K copies)
                                          grad_w = entry_values(plan, grad_recv_w)       (each entry reads its row)
combine(plan, y, weights) -> out          rows = dispatch(plan, grad_out)                (rows go where they came from)
                                          grad_y, grad_weights = combine_grad(plan, rows, y, weights)
                                          (local: rows * weights and <rows, y> on real rows, zero elsewhere;
                                          weighted: the rows stay in the receive region, zero copy)

Every backward op but combine_grad (local) is collective: autograd runs the same graph on every rank, so the ranks meet
in the same order.

launch (a flatep.launch.OpLaunch or None): the forward runs inside it (its stream; its SM budget passed to every C++
call); the backward runs on the same stream with the same budget, complete in the current stream's order (the backward
stream waits for the current one, the current one for it), with record_stream on the tensors crossing.
torch.compile does not use these functions: flatep.ops registers the same backward on the custom ops.
"""

import contextlib

import torch

from .launch import OpLaunch, num_sms_of


@contextlib.contextmanager
def _backward_launch(buffer, launch, reads, writes):
    """The backward's OpLaunch (same stream and SM budget as the forward's launch); yields the SM budget the body
    passes to its ops (-1: the Buffer's); `writes` is filled by the body."""
    if launch is None:
        yield -1
        return
    again = OpLaunch(buffer.device, launch.side, None, launch.num_sms, "backward")
    with again:
        yield again.num_sms
    again.finish(False, reads, writes)


def _forward(launch):
    return launch if launch is not None else contextlib.nullcontext()


class DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, plan, x, topk_weights, launch=None):
        ctx.buffer, ctx.plan, ctx.launch = buffer, plan, launch
        ctx.has_weights = topk_weights is not None
        with _forward(launch):
            recv_x, recv_w = buffer._dispatch_raw(plan, x, topk_weights, num_sms=num_sms_of(launch))
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        buffer, plan = ctx.buffer, ctx.plan
        grad_x = grad_w = None
        rows = grad_recv_x.to(torch.bfloat16).contiguous() if ctx.needs_input_grad[2] else None
        values = grad_recv_w.to(torch.float32).contiguous() if ctx.has_weights and ctx.needs_input_grad[3] else None
        writes = []
        with _backward_launch(buffer, ctx.launch, (rows, values, plan._storage), writes) as num_sms:
            if rows is not None:
                grad_x = buffer._combine_raw(plan, rows, None, num_sms=num_sms)
            if values is not None:
                grad_w = buffer._entry_values_raw(plan, values, num_sms=num_sms)
            writes += [grad_x, grad_w]
        return None, None, grad_x, grad_w, None


class CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, plan, y, weights, launch=None):
        ctx.buffer, ctx.plan, ctx.launch = buffer, plan, launch
        ctx.has_weights = weights is not None
        if weights is not None:
            ctx.save_for_backward(y, weights)
        with _forward(launch):
            return buffer._combine_raw(plan, y, weights, num_sms=num_sms_of(launch))

    @staticmethod
    def backward(ctx, grad_out):
        buffer, plan = ctx.buffer, ctx.plan
        grad_out = grad_out.to(torch.bfloat16).contiguous()
        y = weights = None
        if ctx.has_weights:
            y, weights = ctx.saved_tensors
        grad_y = grad_weights = None
        writes = []
        with _backward_launch(buffer, ctx.launch, (grad_out, y, weights, plan._storage), writes) as num_sms:
            want_y, want_weights = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
            if ctx.has_weights and (want_y or want_weights):
                # The rows only feed combine_grad (rows holding no entry get zeros, y never read there): they stay in
                # the receive region, read by combine_grad right after (Buffer._combine_backward_raw).
                grad_y, grad_weights = buffer._combine_backward_raw(plan, grad_out, y, weights, want_y, want_weights,
                                                                    num_sms=num_sms)
                writes += [grad_y, grad_weights]
            else:
                # Unweighted: the rows are grad_y itself, which must be defined (zero) on every row. (Weighted with
                # neither gradient wanted: the collective still runs, as on every rank.)
                rows, _ = buffer._dispatch_raw(plan, grad_out, None, want_weights=False, zero_fill=not ctx.has_weights,
                                               num_sms=num_sms)
                writes.append(rows)
                if not ctx.has_weights:
                    grad_y = rows
        return None, None, grad_y, grad_weights, None
