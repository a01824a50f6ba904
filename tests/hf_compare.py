"""What the Hugging Face equality tests (tests/test_convert.py, tests/test_mla.py) measure of a run pair
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
