"""What the Hugging Face equality tests (tests/unit/models/test_convert.py, tests/unit/models/test_mla.py)
measure of a run pair
``{"hf": {"logits", "grads"}, "ours": {...}}``: the largest absolute difference per tensor, and each
tensor's scale; the tolerance is derived from the same pair's float32 distance, scaled to float64."""

from __future__ import annotations

EPS64_OVER_EPS32 = 2.0 ** -29  # float64's machine epsilon over float32's


def distances(run: dict) -> dict[str, float]:
    """``max |hf - ours|`` of the logits and of every gradient, by name."""
    hf, ours = run["hf"], run["ours"]
    out = {"logits": (hf["logits"] - ours["logits"]).abs().max().item()}
    for name, g in hf["grads"].items():
        out[name] = (g - ours["grads"][name]).abs().max().item()
    return out


def scales(run: dict) -> dict[str, float]:
    """``max |hf|`` of the logits and of every gradient, by name (for a floor of a few ulps)."""
    hf = run["hf"]
    grads = {n: g.abs().max().item() for n, g in hf["grads"].items()}
    return {"logits": hf["logits"].abs().max().item(), **grads}


def rms_norm_in_input_dtype(norm, x):
    """Hugging Face's RMSNorm without its float32 cast (``norm.weight``, ``norm.variance_epsilon``): a float64
    model then normalises in float64, as ours does."""
    import torch

    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def rotary_in_float64(freqs):
    """A rotary embedding's ``forward(x, position_ids) -> (cos, sin)`` whose angles are float64 (``freqs``:
    our inverse frequencies), in place of Hugging Face's float32 ones (rotate-half layout)."""
    import torch

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].double() * freqs
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    return forward
