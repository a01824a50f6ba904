"""A pairwise covering array of the trainer's options (tests/trainer/ranks/lane2/test_train_pairs.py runs it
against one device).

Each technique the trainer composes is a **factor** with its levels (``FACTORS``); a **row** gives
every factor a level and is a trainer layout at ``WORLD`` ranks. A pair of levels of two factors is
**allowed** when some row that holds it is a layout the trainer accepts: the support table
(``refimpl.support.refusals``, MoE rows included), the shapes (``refimpl.support.shape_refusals``)
and what ``WORLD`` ranks can hold (a degree product of 4: at most two of tp, cp and pp at 2; HSDP
needs 2 data-parallel ranks to replicate over, ``--ep 2`` two ``dp x cp`` ranks). ``covering_rows``
picks rows greedily (each the candidate that covers the most pairs not yet covered, ties to the first
in the factors' order: deterministic) until every allowed pair is in some row: the AETG construction
(Cohen et al. 1997). A new option is one more line in ``FACTORS`` (and its flags in
``row_flags``): the array grows to cover its pairs with everything else.
"""

from __future__ import annotations

import itertools
from functools import cache

from refimpl.config import ModelConfig, ParallelConfig
from refimpl.support import refusals, shape_refusals

WORLD = 4
SEQ_LEN = 16
# 4 blocks: the interleaved schedule's 2 stages x 2 virtual stages; sizes multiples of 16 (fp8's GEMMs)
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", str(SEQ_LEN),
         "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
         "--checkpoint-every", "0", "--no-report"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-aux-loss-coeff", "0.1"]
# precision level -> the trainer's flags (the one-device reference runs the same flags)
PRECISIONS = {"fp32": ["--precision", "fp32"], "bf16": ["--precision", "bf16"],
              "fp16": ["--precision", "fp16"], "fp8": ["--precision", "fp8"],
              "fp8-rowwise": ["--precision", "fp8", "--fp8-scaling", "rowwise"]}
FACTORS: dict[str, tuple] = {
    "precision": tuple(PRECISIONS),
    "pp": ("off", "1f1b", "gpipe", "interleaved", "zbh1"),
    "zero": (0, 1, 2, 3),
    "tp": ("off", "tp", "tp+sp"),
    "cp": ("off", "ring", "ulysses"),
    "experts": ("dense", "moe", "ep"),
    "hsdp": (False, True),
    "recompute": (False, True),
    "accumulation": (False, True),
}

Row = dict[str, object]


def degrees(row: Row) -> dict[str, int]:
    """The row's degrees at ``WORLD`` ranks (dp: what tp, cp and pp leave; 0 when they leave none)."""
    tp, cp, pp = (1 if row[axis] == "off" else 2 for axis in ("tp", "cp", "pp"))
    return {"tp": tp, "cp": cp, "pp": pp, "dp": WORLD // (tp * cp * pp) if WORLD % (tp * cp * pp) == 0 else 0}


def parallel_config(row: Row) -> ParallelConfig:
    d = degrees(row)
    precision = str(row["precision"])
    return ParallelConfig(
        dp=d["dp"], tp=d["tp"], cp=d["cp"], pp=d["pp"], dp_replicate=2 if row["hsdp"] else 1,
        ep=2 if row["experts"] == "ep" else 1, zero_stage=int(row["zero"]),  # type: ignore[call-overload]
        precision="fp8" if precision.startswith("fp8") else precision,
        fp8_scaling="rowwise" if precision == "fp8-rowwise" else "tensorwise",
        sequence_parallel=row["tp"] == "tp+sp", cp_method="ulysses" if row["cp"] == "ulysses" else "ring",
        pp_schedule="1f1b" if row["pp"] == "off" else str(row["pp"]),
        virtual_stages=2 if row["pp"] == "interleaved" else 1,
        activation_checkpointing="all" if row["recompute"] else None)


def why_not(row: Row) -> list[str]:
    """Why the trainer would refuse ``row`` at ``WORLD`` ranks (none: it runs it); what the 4 ranks
    cannot hold comes first, alone, its sentence opening with "4 ranks:"."""
    d = degrees(row)
    if not d["dp"]:
        return [f"{WORLD} ranks: tp {d['tp']} x cp {d['cp']} x pp {d['pp']} exceeds them"]
    out = []
    if row["hsdp"] and d["dp"] % 2:
        out.append(f"{WORLD} ranks: HSDP replicates over 2 data-parallel ranks")
    if row["experts"] == "ep" and (d["dp"] * d["cp"]) % 2:
        out.append(f"{WORLD} ranks: --ep 2 splits the experts over 2 of the dp x cp ranks")
    if out:
        return out
    config = parallel_config(row)
    model = ModelConfig(vocab_size=256, num_layers=4, hidden_size=32, num_attention_heads=4,
                        max_seq_len=SEQ_LEN, num_experts=4 if row["experts"] != "dense" else 0)
    return ([r.message() for r in refusals(config, moe=row["experts"] != "dense")]
            + shape_refusals(model, config, seq_len=SEQ_LEN))


def row_flags(row: Row) -> list[str]:
    """The trainer's flags of ``row`` (besides ``MODEL`` and the data), at ``WORLD`` ranks."""
    flags = list(PRECISIONS[str(row["precision"])]) + ["--zero-stage", str(row["zero"])]
    if row["pp"] != "off":
        flags += ["--pp", "2", "--pp-schedule", str(row["pp"])]
        flags += ["--virtual-stages", "2"] * (row["pp"] == "interleaved")
    if row["tp"] != "off":
        flags += ["--tp", "2"] + ["--sequence-parallel"] * (row["tp"] == "tp+sp")
    if row["cp"] != "off":
        flags += ["--cp", "2", "--cp-method", str(row["cp"])]
    flags += MOE * (row["experts"] != "dense") + ["--ep", "2"] * (row["experts"] == "ep")
    flags += ["--dp-replicate", "2"] * bool(row["hsdp"])
    flags += ["--activation-checkpointing"] * bool(row["recompute"])
    flags += ["--micro-batch-size", "1"] * bool(row["accumulation"])
    return flags


def row_name(row: Row) -> str:
    """A short id: the levels that are not off."""
    parts = [str(row["precision"]), f"zero{row['zero']}"]
    parts += [f"pp-{row['pp']}"] * (row["pp"] != "off") + [str(row["tp"])] * (row["tp"] != "off")
    parts += [f"cp-{row['cp']}"] * (row["cp"] != "off") + [str(row["experts"])] * (row["experts"] != "dense")
    parts += ["hsdp"] * bool(row["hsdp"]) + ["recompute"] * bool(row["recompute"])
    parts += ["accum"] * bool(row["accumulation"])
    return "-".join(parts)


def _pairs(row: Row) -> set[tuple]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(FACTORS, 2)}


@cache
def accepted_rows() -> tuple[tuple, ...]:
    """Every row the trainer accepts at ``WORLD`` ranks, as tuples of levels in ``FACTORS``' order."""
    return tuple(levels for levels in itertools.product(*FACTORS.values())
                 if not why_not(dict(zip(FACTORS, levels, strict=True))))


def allowed_pairs() -> set[tuple]:
    """The pairs some accepted row holds (module docstring)."""
    return set().union(*(_pairs(dict(zip(FACTORS, levels, strict=True))) for levels in accepted_rows()))


@cache
def covering_rows() -> tuple[Row, ...]:
    """Accepted rows that together hold every allowed pair (greedy, deterministic: module docstring)."""
    candidates = [(dict(zip(FACTORS, levels, strict=True)),) for levels in accepted_rows()]
    pairs = [(row, _pairs(row)) for (row,) in candidates]
    left, chosen = allowed_pairs(), []
    while left:
        best, covered = max(pairs, key=lambda item: len(item[1] & left))
        chosen.append(best)
        left -= covered
    return tuple(chosen)
