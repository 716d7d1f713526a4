#!/usr/bin/python3
"""References for tests/nn_attention.cpp, computed by PyTorch (Debian's python3-torch) in float64.

torch.nn.MultiheadAttention(4, 2, batch_first=True) called as attn(x, x, x) with the weights below
(duet's in_proj is PyTorch's in_proj_weight and in_proj_bias), causal through attn_mask (-inf
above the diagonal), at lengths 5 then 3; the output, the loss mse_loss(out, target) and the
gradients of the loss with respect to x, in_proj_weight, in_proj_bias, out_proj.weight and
out_proj.bias. Then with a key padding mask on a padded batch of three at length 5 (the
sequences 5, 3 and 1 tokens long): a bool mask (True past each sequence's end), with and
without the causal mask, and a float mask added to the scores (whose gradient is printed
too). Then with PyTorch's attn_mask (a pattern that leaves every query key 0): bool [5, 5]
alone, causal with a bool key padding mask, float [5, 5] alone and with a bool key padding
mask, and float [B * H, 5, 5] (whose gradients are printed). Prints the C++ arrays
nn_attention.cpp holds.
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


def case(length, causal, mask_kind=None, attn_kind=None, attn_rank=2):
    batch = B if mask_kind is None else 3
    attn = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    with torch.no_grad():
        attn.in_proj_weight.copy_(f32(filled(3 * E * E, lambda i: 0.4 * math.sin(0.9 * i + 0.2)).view(3 * E, E)))
        attn.in_proj_bias.copy_(f32(filled(3 * E, lambda i: 0.1 * math.cos(1.7 * i))))
        attn.out_proj.weight.copy_(f32(filled(E * E, lambda i: 0.5 * math.cos(0.55 * i + 0.3)).view(E, E)))
        attn.out_proj.bias.copy_(f32(filled(E, lambda i: 0.05 * i - 0.1)))
    n = batch * length * E
    x = f32(filled(n, lambda i: math.sin(0.37 * i + 0.1)).view(batch, length, E)).requires_grad_()
    target = f32(filled(n, lambda i: math.cos(0.29 * i)).view(batch, length, E))
    mask = torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1) if causal else None
    if mask_kind == "bool":
        lengths = torch.tensor([5, 3, 1])
        padding = torch.arange(length).view(1, length) >= lengths.view(3, 1)
    elif mask_kind == "float":
        padding = f32(filled(3 * length, lambda i: 0.8 * math.sin(1.3 * i)).view(3, length)).requires_grad_()
    else:
        padding = None
    given = None
    if attn_kind == "bool":
        given = torch.tensor([[j > 0 and i != j and (i + 2 * j) % 3 == 0 for j in range(length)] for i in range(length)])
        if mask is not None:
            given_or_causal = given.logical_or(torch.isinf(mask))
        mask = given if mask is None else given_or_causal
    elif attn_kind == "float":
        shape = (length, length) if attn_rank == 2 else (batch * H, length, length)
        count = math.prod(shape)
        given = f32(filled(count, lambda i: 0.7 * math.sin(0.9 * i + 0.3)).view(*shape)).requires_grad_()
        mask = given if mask is None else given + mask
    out, _ = attn(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False)
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    name = f"t{length}{'_causal' if causal else ''}{'_' + mask_kind + '_mask' if mask_kind else ''}"
    arrays = [("out", out), ("dx", x.grad), ("d_in_proj_weight", attn.in_proj_weight.grad),
              ("d_in_proj_bias", attn.in_proj_bias.grad), ("d_out_proj_weight", attn.out_proj.weight.grad),
              ("d_out_proj_bias", attn.out_proj.bias.grad)]
    if attn_kind is not None:
        name = f"t{length}{'_causal' if causal else ''}_{attn_kind}_attn_mask{'_3d' if attn_rank == 3 else ''}" + \
            (f"_{mask_kind}_key_padding" if mask_kind else "")
        arrays.append(("d_attn_mask", given.grad if given.grad is not None else torch.zeros(0)))
    masked = mask_kind is not None and attn_kind is None
    lines = [f"    /* {label} */ {{{', '.join(f'{v:.17g}' for v in t.detach().flatten().tolist())}}}"
             for label, t in arrays]
    if masked:
        extra = [f"    /* {label} */ {{{'' if t is None else ', '.join(f'{v:.17g}' for v in t.detach().double().flatten().tolist())}}}"
                 for label, t in (("mask", padding), ("d_mask", padding.grad))]
        plain = f"    {{{length}, {'true' if causal else 'false'}, {loss.item():.17g},\n" + ",\n".join(lines) + "}"
        print(f"const MaskedReference {name}{{")
        print(",\n".join([plain] + extra))
    elif attn_kind is not None:
        plain = f"    {{{length}, {'true' if causal else 'false'}, {loss.item():.17g},\n" + ",\n".join(lines[:6]) + "}"
        values = lambda t: ", ".join(f"{v:.17g}" for v in t.detach().double().flatten().tolist())
        print(f"const AttnMaskedReference {name}{{")
        print(",\n".join([plain, f"    /* attn_mask_shape */ {{{', '.join(str(d) for d in given.shape)}}}",
                           f"    /* attn_mask */ {{{values(given)}}}", lines[6],
                           f"    /* key_padding_mask */ {{{'' if padding is None else values(padding)}}}"]))
    else:
        print(f"const Reference {name}{{{length}, {'true' if causal else 'false'}, {loss.item():.17g},")
        print("".join(line + ",\n" for line in lines), end="")
    print("};")


for causal in (False, True):
    for length in (5, 3):
        case(length, causal)
case(5, False, "bool")
case(5, True, "bool")
case(5, False, "float")
case(5, False, None, "bool")
case(5, True, "bool", "bool")
case(5, False, None, "float")
case(5, False, "bool", "float")
case(5, False, None, "float", 3)
