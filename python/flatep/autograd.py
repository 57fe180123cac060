"""Autograd functions of dispatch and combine (design §3).

Forward                                   Backward (with the plan saved by the forward)
dispatch(plan, x, w) -> recv_x, recv_w    grad_x = combine(plan, grad_recv_x)            (unweighted: sums K copies)
                                          grad_w = entry_values(plan, grad_recv_w)       (each entry reads its row)
combine(plan, y, weights) -> out          rows = dispatch(plan, grad_out)                (rows go where they came from)
                                          grad_y, grad_weights = combine_grad(plan, rows, y, weights)
                                          (local: rows * weights and <rows, y> on real rows, zero elsewhere)

Every backward op but combine_grad (local) is collective: autograd runs the same graph on every rank, so the ranks meet
in the same order.
"""

import torch


class DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, plan, x, topk_weights):
        ctx.buffer, ctx.plan = buffer, plan
        ctx.has_weights = topk_weights is not None
        recv_x, recv_w = buffer._dispatch_raw(plan, x, topk_weights)
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        buffer, plan = ctx.buffer, ctx.plan
        grad_x = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_x = buffer._combine_raw(plan, grad_recv_x.to(torch.bfloat16).contiguous(), None)
        if ctx.has_weights and ctx.needs_input_grad[3]:
            grad_w = buffer._entry_values_raw(plan, grad_recv_w.to(torch.float32).contiguous())
        return None, None, grad_x, grad_w


class CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, plan, y, weights):
        ctx.buffer, ctx.plan = buffer, plan
        ctx.has_weights = weights is not None
        if weights is not None:
            ctx.save_for_backward(y, weights)
        return buffer._combine_raw(plan, y, weights)

    @staticmethod
    def backward(ctx, grad_out):
        buffer, plan = ctx.buffer, ctx.plan
        # Weighted: rows only feed combine_grad, which never reads rows past the last group end, so they need no fill.
        # Unweighted: the rows are grad_y itself, which must be defined (zero) on every row.
        rows, _ = buffer._dispatch_raw(
            plan, grad_out.to(torch.bfloat16).contiguous(), None, want_weights=False, zero_fill=not ctx.has_weights
        )
        grad_y = grad_weights = None
        if not ctx.has_weights:
            return None, None, rows, None
        y, weights = ctx.saved_tensors
        want_y, want_weights = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        if want_y or want_weights:  # one fused local op; rows holding no entry get zeros (their y is never read)
            grad_y, grad_weights = buffer._combine_grad_raw(plan, rows, y, weights, want_y, want_weights)
        return None, None, grad_y, grad_weights
