#!/usr/bin/python3
"""References for tests/nn_attention.cpp, computed by PyTorch (Debian's python3-torch) in float64.

torch.nn.MultiheadAttention(4, 2, batch_first=True) called as attn(x, x, x) with the weights below
(duet's in_proj is PyTorch's in_proj_weight and in_proj_bias), causal through attn_mask (-inf
above the diagonal), at lengths 5 then 3; the output, the loss mse_loss(out, target) and the
gradients of the loss with respect to x, in_proj_weight, in_proj_bias, out_proj.weight and
out_proj.bias. Prints the C++ arrays nn_attention.cpp holds.
"""
import math
import sys

try:
    import torch
except ImportError as missing:
    print(f"SKIPPED: {missing.name} is not installed (Debian: python3-torch)")
    sys.exit(77)

E, H, B = 4, 2, 2


def filled(n, f):
    return torch.tensor([f(i) for i in range(n)], dtype=torch.float64)


# The same formulas as nn_attention.cpp's, rounded to float32 as duet holds them.
def f32(t):
    return t.float().double()


def case(length, causal):
    attn = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    with torch.no_grad():
        attn.in_proj_weight.copy_(f32(filled(3 * E * E, lambda i: 0.4 * math.sin(0.9 * i + 0.2)).view(3 * E, E)))
        attn.in_proj_bias.copy_(f32(filled(3 * E, lambda i: 0.1 * math.cos(1.7 * i))))
        attn.out_proj.weight.copy_(f32(filled(E * E, lambda i: 0.5 * math.cos(0.55 * i + 0.3)).view(E, E)))
        attn.out_proj.bias.copy_(f32(filled(E, lambda i: 0.05 * i - 0.1)))
    n = B * length * E
    x = f32(filled(n, lambda i: math.sin(0.37 * i + 0.1)).view(B, length, E)).requires_grad_()
    target = f32(filled(n, lambda i: math.cos(0.29 * i)).view(B, length, E))
    mask = torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1) if causal else None
    out, _ = attn(x, x, x, attn_mask=mask, need_weights=False)
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    name = f"t{length}{'_causal' if causal else ''}"
    arrays = [("out", out), ("dx", x.grad), ("d_in_proj_weight", attn.in_proj_weight.grad),
              ("d_in_proj_bias", attn.in_proj_bias.grad), ("d_out_proj_weight", attn.out_proj.weight.grad),
              ("d_out_proj_bias", attn.out_proj.bias.grad)]
    print(f"const Reference {name}{{{length}, {'true' if causal else 'false'}, {loss.item():.17g},")
    for label, t in arrays:
        values = ", ".join(f"{v:.17g}" for v in t.detach().flatten().tolist())
        print(f"    /* {label} */ {{{values}}},")
    print("};")


for causal in (False, True):
    for length in (5, 3):
        case(length, causal)
